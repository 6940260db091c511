"""benchmarks/parallel_results.py: the multi-GPU result file from the core and engine results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "parallel_results", ROOT / "benchmarks" / "parallel_results.py"
)
pr = importlib.util.module_from_spec(_spec)
sys.modules["parallel_results"] = pr
_spec.loader.exec_module(pr)


def _core(ok=True, nccl=0):
    rank = {
        "rank": 0,
        "graphs": 2,
        "load_decode_captures": 0,
        "symm_mem_collectives": 17,
        "nccl_kernels": nccl,
        "outputs_identical": True,
        "capture_s": 0.77,
        "restore_s": 0.29,
        "ready_s_save": 3.7,
        "ready_s_load": 3.7,
        "greedy_tokens": [1, 2],
    }
    return {
        "date": "2026-12-05T00:00:00+00:00",
        "commit": "abc1234",
        "machine": "2x NVIDIA H200",
        "command": "foundry tp --world-size 2",
        "world_size": 2,
        "share_gpus": False,
        "ranks": [rank, dict(rank, rank=1)],
        "reproduce": {"fingerprints_equal": True, "offsets_equal": True, "per_rank": []},
        "ok": ok,
    }


def _engine(tokens=True, captures=0, refused=None):
    rank = {"graphs": 1, "load_decode_captures": captures, "symm_mem_collectives": 57, "nccl_kernels": 0}
    data = {
        "date": "2026-12-05T00:10:00+00:00",
        "commit": "abc1234",
        "machine": "2x NVIDIA H200",
        "command": "cold_start.py",
        "engine": "sglang",
        "ready_s_save": 90.0,
        "ready_s_load_cold": 30.0,
        "tokens_identical_to_save": tokens,
        "logprobs_identical_to_save": True,
        "ranks": [dict(rank, rank=0), dict(rank, rank=1)],
        "runs": {"save": {"ok": True}},
    }
    if refused is not None:
        data.update(ranks=None, tokens_identical_to_save=None, logprobs_identical_to_save=None)
        data["runs"]["save"] = {"ok": False, "error": "RuntimeError: exited 1", "log_tail": refused}
    return data


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_every_part_ok_gives_one_file_with_its_sources(tmp_path):
    out = tmp_path / "tp2.json"
    tail = "INFO starting\nerror: Foundry cannot run this vLLM configuration: tensor parallelism: NCCL\n"
    rc = pr.main(
        [
            "--out",
            str(out),
            "--core",
            str(_write(tmp_path, "core.json", _core())),
            "--engine",
            f"sglang_tp={_write(tmp_path, 'tp.json', _engine())}",
            "--engine",
            f"vllm_tp={_write(tmp_path, 'v.json', _engine(refused=tail))}",
        ]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and result["all_ok"] is True
    assert result["commit"] == "abc1234" and result["machine"] == "2x NVIDIA H200"
    assert result["date"] == ["2026-12-05T00:00:00+00:00", "2026-12-05T00:10:00+00:00"]
    assert [s["file"].rsplit("/", 1)[-1] for s in result["sources"]] == ["core.json", "tp.json", "v.json"]
    core = result["parts"]["core_tp"]
    assert core["reproduce"] == {"fingerprints_equal": True, "offsets_equal": True}
    assert [r["nccl_kernels"] for r in core["ranks"]] == [0, 0] and "greedy_tokens" not in core["ranks"][0]
    sglang = result["parts"]["sglang_tp"]
    assert sglang["outcome"] == "restored" and all(r["outputs_identical"] for r in sglang["ranks"])
    vllm = result["parts"]["vllm_tp"]
    assert vllm["outcome"] == "refused" and vllm["reason"].startswith("error: Foundry cannot run this vLLM")


def test_a_capture_at_load_an_nccl_kernel_or_other_tokens_is_not_ok(tmp_path):
    for core, engine in (
        (_core(), _engine(captures=1)),
        (_core(nccl=1, ok=False), _engine()),
        (_core(), _engine(tokens=False)),
    ):
        out = tmp_path / "r.json"
        rc = pr.main(
            [
                "--out",
                str(out),
                "--core",
                str(_write(tmp_path, "c.json", core)),
                "--engine",
                f"e={_write(tmp_path, 'e.json', engine)}",
            ]
        )
        assert rc == 1 and json.loads(out.read_text())["all_ok"] is False


def test_a_server_that_failed_without_a_refusal_is_a_failure(tmp_path):
    data = _engine(refused="Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
    part = pr.engine_part(data)
    assert part["outcome"] == "failed" and part["ok"] is False and part["reason"] == "RuntimeError: exited 1"
