"""GPU: plain vLLM, Foundry SAVE and Foundry LOAD produce the same tokens; LOAD restores, never captures.

Runs examples/vllm/run.py three times in fresh processes (about two minutes each on an H200).  Skipped
on machines without a GPU (root conftest).  This is the validation the CPU suite cannot do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "examples" / "vllm" / "run.py"


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(RUN), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "INFO"},
    )
    log = proc.stdout + proc.stderr
    (tmp_path / f"{name}.log").write_text(log)
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


def test_save_then_load_matches_plain_vllm(tmp_path):
    toml = tmp_path / "foundry.toml"
    toml.write_text(f'mode = "auto"\narchive_dir = "{tmp_path / "archive"}"\n[region]\nsize = "64GiB"\n')
    plain, _ = _run(tmp_path, "plain")
    saved, save_log = _run(tmp_path, "save", "--foundry-config", str(toml))
    assert "Foundry rank 0: SAVE" in save_log and "saved" in save_log
    assert (tmp_path / "archive" / "rank0.vllm.json").is_file()
    loaded, load_log = _run(tmp_path, "load", "--foundry-config", str(toml))
    assert "Foundry rank 0: LOAD" in load_log and "restored" in load_log
    assert "Capturing CUDA graphs" not in load_log and "Graph capturing finished" not in load_log
    assert plain["tokens"] == saved["tokens"] == loaded["tokens"]
    artifacts = os.environ.get("FOUNDRY_TEST_ARTIFACTS")
    if artifacts:  # keep logs for the report
        shutil.copytree(tmp_path, Path(artifacts) / "vllm_roundtrip", dirs_exist_ok=True)
