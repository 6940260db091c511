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


def test_shared_gpus_reach_every_rank_and_let_torch_allow_it(tmp_path, monkeypatch):
    """--share-gpus: each rank's process gets the flag (it then picks GPU rank mod n) and the
    environment variable without which torch refuses a rendezvous of ranks on one device."""
    p = argparse.ArgumentParser()
    add_tp_arguments(p)
    args = p.parse_args(["--world-size", "2", "--share-gpus"])
    args.timeout = 30.0
    started = []

    class Proc:
        returncode = 1

        def __init__(self, cmd, stdout, stderr, env):
            started.append((cmd, env))

        def poll(self):
            return 1

    monkeypatch.setattr(tp.subprocess, "Popen", Proc)
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    try:
        tp._phase(args, "save", tmp_path)
    except tp.PhaseFailed as e:
        assert str(e).startswith("rank 0's save process failed")
    assert [cmd[cmd.index("--rank") + 1] for cmd, _env in started] == ["0", "1"]
    assert all("--share-gpus" in cmd for cmd, _env in started)
    assert all(env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1" for _cmd, env in started)
    args.share_gpus = False
    started.clear()
    try:
        tp._phase(args, "save", tmp_path)
    except tp.PhaseFailed:
        pass
    assert not any("--share-gpus" in cmd for cmd, _env in started)
    assert all("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES" not in env for _cmd, env in started)


def test_the_cli_says_how_many_gpus_a_run_needs(capsys, tmp_path, monkeypatch):
    from foundry_core import cli
    from tool_commands import register_tool_commands

    register_tool_commands(monkeypatch, tmp_path)  # tp comes through foundry_graphs.commands

    assert cli.main(["tp", "--world-size", "2"]) == 2
    assert "needs 2 NVIDIA GPUs" in capsys.readouterr().out
    assert cli.main(["tp", "--world-size", "2", "--share-gpus"]) == 2
    assert "needs 1 NVIDIA GPU (--share-gpus)" in capsys.readouterr().out


def test_a_run_is_ok_only_when_the_gather_matched_in_save_and_load(tmp_path, monkeypatch):
    """The engine layer's gather, checked in a graph of its own, is part of the verdict per rank."""
    p = argparse.ArgumentParser()
    add_tp_arguments(p)
    args = p.parse_args(["--world-size", "2", "--share-gpus"])
    args.workdir, args.reproduce = str(tmp_path), False
    save = {"rank": 0, "capture_s": 1.0, "ready_s": 3.0, "symmetric": {}, "all_reduce": "symm_mem.one_shot"}
    load = {
        "graphs": 2,
        "load_decode_captures": 0,
        "symm_mem_collectives": 57,
        "nccl_kernels": 0,
        "outputs_identical": True,
        "steps_identical": 8,
        "steps": 8,
        "restore_s": 0.3,
        "ready_s": 3.5,
        "greedy_tokens": [1, 2],
    }
    outcome = {"save": [True, True], "load": [True, True]}

    def phase(args, name, root):
        rows = []
        for r in range(2):
            row = {**(save if name == "save" else load), "rank": r, "gather_identical": outcome[name][r]}
            rows.append(row)
        return rows

    monkeypatch.setattr(tp, "_phase", phase)
    result = tp.orchestrate(args)
    assert result["ok"] is True
    assert all(r["gather_identical_save"] and r["gather_identical_load"] for r in result["ranks"])
    outcome["load"] = [True, False]
    result = tp.orchestrate(args)
    assert result["ok"] is False and result["ranks"][1]["gather_identical_load"] is False
