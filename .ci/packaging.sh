#!/usr/bin/env bash
# CI step: build the three distributions and install each plugin ALONE, from its wheel, in a fresh
# venv without the test extras, then check what a user gets (.ci/check_install.py). Engines, torch
# and cuda-bindings are left out (--no-deps: this step must stay fast); their declared ranges are
# read from the wheels' metadata instead.
#   .ci/packaging.sh           (from anywhere)      PYTHON: interpreter for the venvs (python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Built from a copy of the working tree (tracked and untracked, not ignored files): the builds'
# egg-info and build/ folders stay out of the checkout, whose src/ the tests put on sys.path.
mkdir "$work/tree"
git ls-files -co --exclude-standard -z | tar -c --null -T - -f - | tar -x -C "$work/tree" -f -
(cd "$work/tree" &&
    "$python" -m pip wheel --quiet --no-deps --wheel-dir "$work/wheels" . packages/sglang packages/vllm)
ls "$work/wheels"
for engine in sglang vllm; do
    echo "== foundry-graphs-$engine alone"
    "$python" -m venv "$work/venv-$engine"
    # packaging: the release gate's one light dependency that check_install imports.
    "$work/venv-$engine/bin/python" -m pip install --quiet --no-deps packaging \
        "$work"/wheels/foundry_graphs-[0-9]*.whl "$work"/wheels/foundry_graphs_"$engine"-*.whl
    (cd "$work" && PATH="$work/venv-$engine/bin:$PATH" "$work/venv-$engine/bin/python" \
        "$OLDPWD/.ci/check_install.py" "$engine" "$work/wheels")
done
