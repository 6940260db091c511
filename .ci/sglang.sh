#!/usr/bin/env bash
# CI job for the SGLang plugin.
#
# Builds (once) a virtual environment holding the real SGLang release the plugin is tested against
# plus this repository, then runs the README's test command, `python -m pytest`, inside it: the
# whole suite, core tests included; tests marked `gpu` skip themselves on machines without a GPU.
#
#   .ci/sglang.sh            (from anywhere; it works from the repository root)
#
# Knobs: SGLANG_CI_VENV (default .venv-sglang), SGLANG_CI_SPEC (default sglang==0.5.23),
#        PYTHON (interpreter used to create the venv, default python3).
# Re-runs are fast: installation is skipped while the recorded spec and the hash of the packaging
# and native sources are unchanged. The script's exit status is pytest's.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

venv_dir="${SGLANG_CI_VENV:-.venv-sglang}"
sglang_spec="${SGLANG_CI_SPEC:-sglang==0.5.23}"
marker="$venv_dir/.installed-for"

[ -x "$venv_dir/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv_dir"

sources_hash="$(cat pyproject.toml setup.py packages/*/pyproject.toml native/*.c native/*.h 2>/dev/null | sha256sum | cut -d' ' -f1)"
wanted="$sglang_spec opencv-python-headless==5.1.0.95 $sources_hash"
if [ "$(cat "$marker" 2>/dev/null || true)" != "$wanted" ]; then
    echo "sglang.sh: installing $sglang_spec and this repository into $venv_dir" >&2
    "$venv_dir/bin/python" -m pip install --quiet --upgrade pip
    "$venv_dir/bin/python" -m pip install --quiet "$sglang_spec"
    # OpenCV, which GPU images bring and SGLang's launcher imports: it grows LD_LIBRARY_PATH at
    # import, which the fork server's checks must see through (tests/sglang/test_sched_start.py).
    "$venv_dir/bin/python" -m pip install --quiet "opencv-python-headless==5.1.0.95"
    # Editable installs: the core (foundry-graphs: builds the native library; the test extra brings
    # pytest and what the core tests import) and the SGLang plugin (foundry-graphs-sglang: registers
    # the sglang.srt.plugins entry point; its sglang range is checked against the one installed).
    # The vLLM plugin is not installed, as in a user's SGLang environment (the core tests that read
    # its records import it from src/: pytest's pythonpath).
    "$venv_dir/bin/python" -m pip install --quiet -e ".[test]" -e packages/sglang
    printf '%s\n' "$wanted" > "$marker"
fi

# shellcheck disable=SC1091
source "$venv_dir/bin/activate"
python -c 'import sglang, foundry_sglang_plugin; print("sglang", sglang.__version__)' >&2
python -m pytest
