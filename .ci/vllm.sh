#!/usr/bin/env bash
# CI for the vLLM plugin: a venv with the real vLLM package and this repository, then the README's
# test command (`python -m pytest`: every test; GPU tests skip themselves on a machine without a GPU).
#
# Run from the repository root: .ci/vllm.sh [extra pytest args]
# Environment: FOUNDRY_VLLM_VENV (default .venv-vllm), FOUNDRY_VLLM_SPEC (default vllm==0.33.0),
#              PYTHON (interpreter that creates the venv, default python3).
# Idempotent: the install step is skipped while the venv's stamp matches the vLLM spec and the
# packaging/native sources; the exit code is pytest's.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${FOUNDRY_VLLM_VENV:-.venv-vllm}"
vllm_spec="${FOUNDRY_VLLM_SPEC:-vllm==0.33.0}"
python="${PYTHON:-python3}"
stamp="$venv/.foundry-vllm-stamp"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi

want="$vllm_spec $(cat pyproject.toml setup.py packages/*/pyproject.toml native/* 2>/dev/null | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "vllm.sh: installing $vllm_spec and this repository into $venv" >&2
    "$venv/bin/python" -m pip install --quiet "$vllm_spec"
    # Editable installs: the core (foundry-graphs; the test extra brings pytest and what the core
    # tests import: hypothesis, transformers) and the vLLM plugin (foundry-graphs-vllm: registers the
    # vllm.general_plugins entry point; its vllm range is checked against the one installed).
    # The SGLang plugin is not installed, as in a user's vLLM environment (the core tests that read
    # its records import it from src/: pytest's pythonpath).
    "$venv/bin/python" -m pip install --quiet -e ".[test]" -e packages/vllm
    echo "$want" > "$stamp"
fi

# shellcheck disable=SC1091
source "$venv/bin/activate"
python -c 'import vllm, foundry_vllm_plugin; print("vllm", vllm.__version__)' >&2

# The README's test command (extra arguments, if any, are passed on for local use).
export HF_HUB_OFFLINE=1
python -m pytest "$@"
