"""``foundry tp``'s orchestration on the CPU: a rank whose process fails still yields a result that
names the rank, the phase and its error (the GPU run is tests/gpu/test_tensor_parallel.py)."""

import argparse

from foundry_tools import tp
from foundry_tools.options import add_tp_arguments


def test_a_failed_rank_is_a_result_naming_it(tmp_path):
    p = argparse.ArgumentParser()
    add_tp_arguments(p)
    args = p.parse_args(["--world-size", "1", "--preset", "tiny"])
    args.workdir, args.reproduce, args.timeout = str(tmp_path), False, 120.0
    result = tp.orchestrate(args)  # no GPU here: the SAVE process fails at its first CUDA call
    assert result["ok"] is False and result["ranks"] == []
    assert result["failed"].startswith("rank 0's save process failed: ")
    assert "Error" in result["failed"] or "exit" in result["failed"]
    assert (tmp_path / "save1" / "save-rank0.err").read_text()  # its stderr kept beside the archive
