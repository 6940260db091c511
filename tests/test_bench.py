"""The bench's arithmetic and plot on the CPU, from a recorded-shape result (no GPU)."""

import pytest

from foundry_tools import bench


def _result(tmp_path):
    archive = tmp_path / "archive"
    (archive / "modules").mkdir(parents=True)
    (archive / "modules" / "a.cubin").write_bytes(b"x" * 1000)
    (archive / "manifest.json").write_bytes(b"{}")
    return {
        "graphs": 2,
        "nodes": 400,
        "capture_s": 4.0,
        "restore_s": 0.5,
        "restore_breakdown": {"archive_read_s": 0.1, "memory_s": 0.0, "modules_s": 0.1, "graphs_s": 0.3},
        "replay_us_native": {"1": 100.0, "8": 200.0},
        "replay_us_restored": {"1": 101.0, "8": 198.0},
        "replay_host_us_native": {"1": 20.0, "8": 21.0},
        "replay_host_us_restored": {"1": 26.5, "8": 21.5},
        "save_s": 0.3,
        "save_breakdown": {"walk_s": 0.2, "encode_s": 0.05},
        "archive": str(archive),
        "bit_exact_all": True,
        "load_stream_captures": 0,
    }


def test_summary_figures(tmp_path):
    s = bench.summarize(_result(tmp_path))
    assert s["speedup"] == pytest.approx(8.0)
    assert s["replay_ratio"] == {"1": pytest.approx(1.01), "8": pytest.approx(0.99)}
    assert s["replay_ratio_max"] == pytest.approx(1.01)
    assert s["us_per_node"] == pytest.approx(1250.0)
    assert s["archive_bytes"] == 1002
    assert s["save_s"] == 0.3 and s["save_walk_us_per_node"] == pytest.approx(500.0)  # 0.2 s / 400 nodes
    # the launch cost on the CPU, restored graph against its native twin
    assert s["replay_host_us_extra"] == {"1": pytest.approx(6.5), "8": pytest.approx(0.5)}
    # graphs finished after load(): what their first replays waited is reported beside the restore
    waited = bench.summarize({**_result(tmp_path / "tail"), "tail_graphs": 1, "first_replay_wait_s": 0.25})
    assert waited["restore_s"] == 0.5 and waited["restore_until_replayed_s"] == pytest.approx(0.75)


def test_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    s = bench.summarize(_result(tmp_path))
    out = tmp_path / "bench.png"
    assert bench.plot(s, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_list_is_long():
    assert len(bench.BENCH_BATCH_SIZES) >= 50
    assert max(bench.BENCH_BATCH_SIZES) == 256


def test_the_load_options_reach_the_load_worker_only(tmp_path, monkeypatch):
    """bench/demo --upload and --no-prepare are LOAD options: the SAVE worker never gets them (the
    probe runs of benchmarks/run_h200_core.sh compare them), the LOAD worker always does."""
    import argparse

    from foundry_core.cli import build_parser
    from foundry_tools import demo
    from tool_commands import register_tool_commands

    register_tool_commands(monkeypatch, tmp_path)  # bench comes through foundry_graphs.commands

    load_options = ["--upload", "--no-prepare", "--check-structure", "--reinstantiate"]
    args = build_parser().parse_args(["bench", *load_options])
    assert isinstance(args, argparse.Namespace)
    save = demo._worker_args(args, "save", "/a", "/r")
    load = demo._worker_args(args, "load", "/a", "/r")
    assert not set(load_options) & set(save)
    assert set(load_options) <= set(load)
    plain = build_parser().parse_args(["bench"])
    assert "--upload" not in demo._worker_args(plain, "load", "/a", "/r")


def test_paired_differences_cancel_what_moves_both():
    """The host's speed moving during a run (both calls of a round slower alike) shows in the two
    medians' difference and not in the paired one."""
    from foundry_tools.demo import paired_difference

    native = [100.0, 100.0, 100.0, 100.0, 180.0, 180.0, 180.0, 180.0, 180.0]
    restored = [101.0, 101.0, 101.0, 101.0, 181.0, 181.0, 181.0, 181.0, 181.0]
    restored[4:] = [100.0, 100.0, 100.0, 100.0, 181.0]  # the slow phase began one call later for these
    paired = paired_difference(native, restored)
    assert paired["median"] == pytest.approx(1.0) and paired["rounds"] == 9
    assert paired["p25"] < 0 < paired["p75"]  # 4 of 9 rounds the other way: no gap shown
    steady = paired_difference([100.0 + i for i in range(8)], [102.0 + i for i in range(8)])
    assert steady == {"median": 2.0, "p25": 2.0, "p75": 2.0, "rounds": 8}
    assert paired_difference([1.0], [2.0])["median"] == 1.0  # too few rounds for quartiles


def test_the_summary_prints_the_paired_differences(tmp_path, capsys):
    paired = {"1": {"median": 0.4, "p25": -0.2, "p75": 1.1, "rounds": 200}}
    result = {**_result(tmp_path), "replay_host_us_paired": paired, "launch_host_us_paired": paired}
    result["launch_host_us_native"], result["launch_host_us_restored"] = {"1": 80.0}, {"1": 81.0}
    s = bench.summarize(result)
    assert s["launch_host_us_paired"] == paired
    bench.print_table(s)
    assert "paired +0.40 us [-0.20, +1.10]" in capsys.readouterr().out
