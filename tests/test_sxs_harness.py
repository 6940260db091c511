"""benchmarks/sxs.py end to end on the CPU, against stand-in engines (benchmarks/sxs_standin.py) that
answer the harness's real command lines: calls that add pairs to one work dir, the merge's result
fields and ratios, a peer refusal, the budget, and bad input; the phases read from real log lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sxs  # noqa: E402  (benchmarks/ is no package)
import sxs_merge  # noqa: E402
import sxs_model  # noqa: E402
import sxs_serving  # noqa: E402

ENTRIES = {
    "sglang": ("sglang.launch_server", "sglang.benchmark.serving"),
    "vllm": ("vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server"),
}
STUB = 'if __name__ == "__main__":\n    import sys\n\n    import sxs_standin\n\n    sys.exit(sxs_standin.main({!r}))\n'


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """Packages named like the engines whose entry modules run the stand-in."""
    stubs = tmp_path / "stubs"
    for modules in ENTRIES.values():
        for module in modules:
            parts = module.split(".")
            for i in range(1, len(parts)):
                pkg = stubs.joinpath(*parts[:i])
                pkg.mkdir(parents=True, exist_ok=True)
                (pkg / "__init__.py").touch()
            stubs.joinpath(*parts[:-1], parts[-1] + ".py").write_text(STUB.format(module))
    path = os.pathsep.join([str(stubs), str(ROOT / "benchmarks")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setitem(sxs_model.SHAPES, "tiny", (ROOT / "examples/qwen3-tiny/config.json", "dummy", "1GiB"))
    monkeypatch.setattr(sxs_serving, "RATES", {"saturating": ("inf", 8), "steady": ("4", 4)})
    return tmp_path


def _run(work: Path, engine: str, modes: str, *extra: str, peer: bool = True) -> int:
    """One call; ``peer``: a folder that looks like upstream Foundry's site (the stand-in plays it)."""
    site = work.parent / ("site-peer" if peer else "no-peer")
    if peer:
        (site / "foundry").mkdir(parents=True, exist_ok=True)
        (site / "foundry_sglang_plugin.py").touch()
    argv = ["run", "--engine", engine, "--shape", "tiny", "--modes", modes, "--workdir", str(work)]
    return sxs.main([*argv, "--budget", "120", "--timeout", "30", "--peer-site", str(site), *extra])


def _merge(work: Path, engine: str, out: Path) -> dict:
    assert sxs.main(["merge", "--engine", engine, "--workdir", str(work), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_merge_elsewhere_keeps_the_facts_of_the_machine_the_starts_ran_on(standin, monkeypatch):
    """Start records merged again on a machine without a GPU (after a parse fix) keep the date,
    commit, machine and versions the merge on the GPU machine left in the work dir."""
    work = standin / "work"
    assert _run(work, "vllm", "foundry", "--no-floor") == 0
    gpu = {"date": "2026-12-05T18:30:51Z", "commit": "068d9cc", "machine": "1x NVIDIA H100 80GB HBM3, 580"}
    monkeypatch.setattr(sxs_merge, "_machine", lambda: gpu["machine"])
    monkeypatch.setenv("FOUNDRY_COMMIT", gpu["commit"])
    first = _merge(work, "vllm", standin / "a.json")
    assert first["machine"] == gpu["machine"] and "merged_again" not in first
    monkeypatch.setattr(sxs_merge, "_machine", lambda: "no GPU seen; host here")
    monkeypatch.setenv("FOUNDRY_COMMIT", "later")
    again = _merge(work, "vllm", standin / "b.json")
    assert {k: again[k] for k in ("date", "commit", "machine")} == {
        k: first[k] for k in ("date", "commit", "machine")
    }
    assert again["merged_again"]["commit"] == "later"


def test_sglang_calls_accumulate_pairs_and_merge(standin):
    work = standin / "work"
    modes = "stock_naive,stock_best,foundry,peer,stock_default"
    assert _run(work, "sglang", modes, "--serving") == 0
    assert _run(work, "sglang", modes, "--pairs", "2", "--no-floor") == 0
    result = _merge(work, "sglang", standin / "out" / "sxs-sglang-h200.json")
    shape = result["shapes"]["tiny"]
    assert {"date", "commit", "machine", "command", "engine_version", "torch_version"} <= set(result)
    assert set(shape["modes"]) == {"stock_naive", "stock_best", "foundry", "peer", "stock_default"}
    foundry = shape["modes"]["foundry"]
    assert foundry["ttft_cold_s"]["n"] == 3 and foundry["warm"]["ttft_cold_s"]["n"] == 3
    assert foundry["save"]["starts"] == 1  # one SAVE for three pairs
    assert foundry["ttft_cold_s"]["min"] >= foundry["ready_s"]["min"] > 0
    assert foundry["phases"]["graphs"] is not None and foundry["phases"]["weights"] is not None
    for name in (
        "foundry_vs_stock_best",
        "foundry_vs_stock_naive",
        "foundry_vs_peer",
        "foundry_vs_peer_best",
    ):
        assert shape["ratios"][name]["n"] == 3 and len(shape["ratios"][name]["pairs"]) == 3, name
    serving = shape["ratios"]["serving_throughput_vs_stock_default"]
    assert serving["saturating"]["median"] == 1.0 and serving["steady"]["n"] == 1  # serving in call 1 only
    assert shape["modes"]["stock_default"]["serving"]["saturating"]["output_tok_s"] == 1000.0
    best = shape["modes"]["stock_best"]
    assert best["outputs_identical_to_stock"] is True and best["outputs_differ_by_prompt"] is True
    assert best["batched_outputs_identical_to_stock"] is True
    assert best["settings_diff_from_foundry"] == {
        "args": ["--enable-foundry", "--foundry-config"],
        "env": ["PYTHONPATH", "SGLANG_PLUGINS"],
    }
    assert "FOUNDRY_GRAPH_EXTENSION_CONFIG" in shape["modes"]["peer"]["settings_diff_from_foundry"]["env"]
    assert shape["floor"]["import_entry_module_s"]["n"] == 1
    assert shape["floor"]["import_entry_module_warm_s"]["n"] == 1  # the import with its files cached too
    assert len(shape["floor"]["import_page_cache_dropped"]) == 1
    # pairs alternate: pair 2 ran its modes in the reverse order of pair 1
    starts = [json.loads(p.read_text()) for p in sorted((work / "tiny" / "starts").glob("*.json"))]
    # stock_best's caches come from one start of its own settings from empty caches, not stock_naive's
    # (vLLM keys its compile cache on the configuration those settings change)
    fills = [s for s in starts if (s["mode"], s["variant"]) == ("stock_best", "fill")]
    bests = [s for s in starts if (s["mode"], s["variant"]) == ("stock_best", "best")]
    assert len(fills) == 1 and best["fill"]["starts"] == 1 and len(bests) == 3
    same = sxs_merge.modes.settings_diff(sxs_merge._launch(fills[0]), sxs_merge._launch(bests[0]))
    assert same == {"args": [], "env": []}
    # upstream as a careful user runs it: the same launch as its cold LOAD, with stock_best's caches
    peer_cold, peer_best = (
        [s for s in starts if (s["mode"], s["variant"]) == ("peer", v)] for v in ("cold", "best")
    )
    assert len(peer_best) == 3 and all(s["caches"] == "stock" and s["page_cache_dropped"] for s in peer_best)
    same = sxs_merge.modes.settings_diff(sxs_merge._launch(peer_cold[0]), sxs_merge._launch(peer_best[0]))
    assert same == {"args": [], "env": []} and shape["modes"]["peer"]["best"]["ttft_cold_s"]["n"] == 3
    order = {p: [s["mode"] for s in starts if s["pair"] == p and s["variant"] != "warm"] for p in (1, 2)}
    assert order[2] == list(reversed(order[1]))
    assert (standin / "out" / "sxs-sglang-h200.json").stat().st_size < 200_000
    png = standin / "out" / "sxs-sglang-h200.png"
    png.unlink(missing_ok=True)
    assert (
        sxs.main(["chart", str(standin / "out" / "sxs-sglang-h200.json")]) == 0 and png.stat().st_size > 1000
    )
    plain = png.stat().st_size
    noted = standin / "out" / "noted.json"  # a note set by hand after a run goes under the chart
    noted.write_text(json.dumps(dict(result, note="stock_best recompiled at every start " * 8)))
    assert sxs.main(["chart", str(noted)]) == 0 and (standin / "out" / "noted.png").stat().st_size > plain


def test_vllm_and_a_peer_refusal(standin, monkeypatch):
    work = standin / "work"
    assert _run(work, "vllm", "stock_naive,foundry") == 0
    result = _merge(work, "vllm", standin / "vllm.json")
    phases = result["shapes"]["tiny"]["modes"]["foundry"]["phases"]
    assert phases["compile"] is not None and phases["graphs"] == 0.05  # LOAD: the restore line's seconds
    assert result["shapes"]["tiny"]["ratios"]["foundry_vs_stock_naive"]["n"] == 1
    # vLLM hashes the TOML's path into its config hash: SAVE and LOAD must name one file (on the H100
    # on 2026-12-05 a LOAD given another file than its SAVE's was refused for another configuration).
    configs = set()
    for rec in (work / "tiny" / "starts").glob("*-foundry-*.json"):
        argv = json.loads(rec.read_text())["argv"]
        configs.add(argv[argv.index("--foundry-config") + 1])
    assert len(configs) == 1, configs

    work2 = standin / "work2"
    monkeypatch.setenv("STANDIN_REFUSE", "sglang plugin failed to activate: this sglang is too new")
    assert _run(work2, "sglang", "stock_naive,peer") == 0
    peer = _merge(work2, "sglang", standin / "sg.json")["shapes"]["tiny"]["modes"]["peer"]
    assert peer["save"]["errors"][0]["refusal"].endswith("this sglang is too new")
    # The refused SAVE only: no LOAD tried, and the mode's row does not pass the SAVE off as one.
    assert peer["starts"] == 0 and "ttft_cold_s" not in peer and peer["save"]["starts"] == 1

    work3 = standin / "work3"  # no upstream Foundry where it should be: no start under its name
    assert _run(work3, "sglang", "stock_naive,peer", peer=False) == 0
    peer = _merge(work3, "sglang", standin / "sg3.json")["shapes"]["tiny"]["modes"]["peer"]
    assert peer["save"]["errors"][0]["error"].startswith("upstream Foundry (foundry-core 0.1.0rc3) is not")


def test_budget_and_bad_input(standin, capsys, monkeypatch):
    work = standin / "work"
    # Each start takes at least 0.5 s: a pair of three starts never fits the 1 s call below, however
    # fast this machine runs the stand-in (on a quick run in CI, 0.26-0.31 s a start, it did).
    monkeypatch.setenv("STANDIN_START_S", "0.5")
    assert _run(work, "sglang", "stock_naive", "--budget", "5", "--no-floor") == 0
    # nothing measured, no floor: the start may take its whole timeout and at least that
    assert "skip stock_naive/cold pair 1: needs ~30 s (at least ~30 s), 5 s left" in capsys.readouterr().out
    assert _run(work, "sglang", "stock_naive,foundry", "--no-floor") == 0
    assert _run(work, "sglang", "stock_naive,foundry", "--no-floor", "--budget", "1") == 0
    assert "stop before pair 2: it needs at least ~" in capsys.readouterr().out  # no half pair
    assert len(list((work / "tiny" / "starts").glob("*.json"))) == 4  # naive, SAVE, cold, warm
    with pytest.raises(SystemExit):
        _run(work, "sglang", "stock_naive,fast")
    assert "--modes: unknown fast" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run(work, "vllm", "peer")
    assert _run(work, "vllm", "stock_naive", "--no-floor") == 2  # one work dir per engine
    assert "holds another engine's runs" in capsys.readouterr().err


def test_resumed_starts_on_a_fresh_machine_make_their_save_again(standin):
    work, fresh = standin / "work", standin / "fresh"
    assert _run(work, "sglang", "stock_naive,foundry", "--no-floor") == 0
    # what run_sxs_h200.sh's logs tarball carries: meta and starts, no archive and no kept caches
    (fresh / "tiny").mkdir(parents=True)
    (fresh / "meta.json").write_text((work / "meta.json").read_text())
    (fresh / "tiny" / "starts").symlink_to(work / "tiny" / "starts", target_is_directory=True)
    assert _run(fresh, "sglang", "stock_naive,foundry", "--no-floor") == 0
    starts = [json.loads(p.read_text()) for p in sorted((fresh / "tiny" / "starts").glob("*.json"))]
    assert [(s["mode"], s["variant"], s["pair"]) for s in starts[4:]] == [
        ("foundry", "save", None),  # the archive did not come along: SAVE again
        ("foundry", "cold", 2),
        ("foundry", "warm", 2),
        ("stock_naive", "cold", 2),
    ]


def test_the_device_site_path_carries_what_its_pth_files_add(tmp_path):
    # As the CUTLASS DSL's wheel installs into a pip --target site: a package whose .pth puts a
    # folder of it on sys.path, where the module SGLang imports lives.
    site = tmp_path / "site"
    (site / "dsl" / "dsl_packages" / "cutlass_like").mkdir(parents=True)
    (site / "dsl" / "__init__.py").write_text("")
    (site / "dsl" / "dsl_packages" / "cutlass_like" / "__init__.py").write_text("")
    (site / "dsl.pth").write_text(
        "import sys, os, dsl; sys.path.insert(0, os.path.join(dsl.__path__[0], 'dsl_packages'))\n"
    )
    script = ROOT / "benchmarks" / "device_site.sh"
    path = subprocess.run(
        ["bash", "-c", f'source "{script}" && site_path "{site}"'], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert path.split(os.pathsep)[0] == str(site)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", "import cutlass_like"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_ratio_never_sets_a_start_that_reads_from_disk_against_one_that_finds_its_files_cached():

    def start(mode, variant, pair, ttft, dropped):
        rec = {"mode": mode, "variant": variant, "pair": pair, "ttft_cold_s": ttft}
        return dict(rec, page_cache_dropped=True) if dropped else rec

    recs = [
        # pair 1: stock_best with its page cache kept (before 2026-12-05): the warm LOAD compares
        start("stock_best", "best", 1, 55.0, False),
        start("foundry", "cold", 1, 60.0, True),
        start("foundry", "warm", 1, 50.0, False),
        # pair 2: a fresh container on both sides
        start("stock_best", "best", 2, 70.0, True),
        start("foundry", "cold", 2, 56.0, True),
        start("foundry", "warm", 2, 45.0, False),
        # pair 3: no Foundry start in stock_best's state
        start("stock_best", "best", 3, 70.0, True),
        start("foundry", "warm", 3, 45.0, False),
    ]
    numerators, denominator = sxs_merge.RATIOS["foundry_vs_stock_best"]
    ratio = sxs_merge.paired(recs, numerators, denominator, lambda r: r["ttft_cold_s"])
    assert ratio["pairs"] == [round(50 / 55, 4), 0.8] and ratio["n"] == 2
    assert ratio["pairs_without_a_match"] == 1
    assert ratio["compared"] == [
        "foundry cold / stock_best best, page cache dropped",
        "foundry warm / stock_best best, page cache kept",
    ]


def test_foundry_lines_of_a_start_log_go_into_its_record_and_the_mode_summary(tmp_path):
    """The log lines Foundry writes (as the plugins word them) become each start's ``foundry`` facts,
    and the merge sums them up per mode: steps, the archive check's split, read-ahead, scheduler start."""
    import sxs_server

    report = {
        "foundry_critical_s": 0.31,
        "foundry_steps_s": {"check_archive": 0.11, "recording": 0.06},
        "check_archive_split": {"inflate_s": 0.0, "hash_s": 0.01},
        "scheduler_start": {"method": "forkserver", "reason": None},
        "caches": {"new_files": {"total": 0}},
        "graphs": 36,
        "gc_frozen": True,  # vLLM's worker: the import heap set aside (gcheap)
    }
    log = tmp_path / "start.log"
    log.write_text(
        "[   13.000] [2026-12-05 15:05:42] Foundry: reading ahead 9415 files (9288 MB) from 2 list(s), "
        "planned in 0.41 s by a helper process; skipped missing 62\n"
        "[   27.500] [2026-12-05 15:05:44] Foundry: schedulers start by forkserver\n"
        "[   30.000] [2026-12-05 15:05:47] Foundry: read ahead 9400 of 9415 files (9288 MB) in 17.0 s\n"
        f"[   48.000] [2026-12-05 15:06:11] Foundry LOAD report: {json.dumps(report)}\n"
    )
    facts = sxs_server.foundry_facts(sxs_server.read_log(log))
    assert facts["readahead_planned_at_s"] == 13.0 and facts["readahead_plan_s"] == 0.41
    assert facts["readahead_read"] == {"files": 9400, "of": 9415, "mb": 9288.0}
    assert facts["scheduler_start"] == {"method": "forkserver", "reason": None}
    assert facts["report"]["foundry_critical_s"] == 0.31 and facts["report"]["caches_new_files"] == 0
    assert "graphs" not in facts["report"]  # the rest stays in the log
    assert facts["report"]["gc_frozen"] is True
    summary = sxs_merge.foundry_summary([facts, facts])
    assert summary["critical_s"]["median"] == 0.31 and summary["steps_s"]["check_archive"] == 0.11
    assert summary["scheduler_start"] == ["forkserver"] and summary["readahead_plan_s"]["n"] == 2
    assert summary["gc_frozen"] == ["True"] and "gc_frozen_objects" not in summary
    # Planned at interpreter start (the site hook), logged once the plugin registered: the line's
    # own "s into this process" is when it was planned, not when it reached the log
    log.write_text(
        "[   21.900] Foundry: reading ahead 9415 files (9288 MB) from 2 list(s), planned in 1.20 s by "
        "a helper process, 1.65 s into this process; skipped none\n"
    )
    facts = sxs_server.foundry_facts(sxs_server.read_log(log))
    assert facts["readahead_planned_at_s"] == 1.65 and facts["readahead_plan_s"] == 1.2


def _floor(work: Path, seconds: float) -> None:
    """A floor record as sxs_floor.measure writes it, adding up to ``seconds``."""
    floor = work / "tiny" / "floor"
    floor.mkdir(parents=True, exist_ok=True)
    (floor / "0000.json").write_text(
        json.dumps(
            {
                "import_entry_module": {"wall_s": seconds - 0.5, "page_cache_dropped": True},
                "import_entry_module_warm": {"wall_s": seconds},  # slower than the cold one this time
                "read_weights": {"files": 0, "note": "no weight files (dummy weights)"},
                "cuda_context": {"wall_s": 0.7, "inner_s": 0.5},
            }
        )
    )


def test_a_start_never_measured_is_expected_from_the_kinds_it_never_outlasts(tmp_path):
    """As on the GPU with --timeout 200: after a 175 s SAVE, the cold LOAD is expected to take no
    longer than it (not the 1.5 times the longest start, capped at the timeout, of before), the warm
    LOAD no longer than the cold one, and either may run from the floor up."""
    work = sxs.Work(tmp_path / "w", "vllm", "tiny")
    _floor(tmp_path / "w", 20.0)
    work.save({"mode": "foundry", "variant": "save", "pair": None, "wall_s": 175.2})
    assert work.floor_s() == 20.0  # the faster import, no weight files, the context alone
    assert work.estimate("foundry", "cold", False, 200.0) == (175.2, 20.0)
    assert work.estimate("foundry", "warm", False, 200.0) == (175.2, 20.0)
    assert work.estimate("stock_naive", "cold", False, 200.0) == (200.0, 20.0)  # 1.5 x 175.2, capped
    work.save({"mode": "foundry", "variant": "cold", "pair": 1, "wall_s": 52.0})
    assert work.estimate("foundry", "cold", False, 200.0) == (52.0, 52.0)
    assert work.estimate("foundry", "warm", False, 200.0) == (52.0, 20.0)
    # a warm LOAD the budget cut after 30 s: needs more than that, still no more than the cold one
    work.save(
        {"mode": "foundry", "variant": "warm", "pair": 2, "wall_s": 30.0, "error": "x", "cut_by_budget": True}
    )
    assert work.estimate("foundry", "warm", False, 200.0) == (52.0, 30.0)
    # serving: its own seconds once, whatever the recorded start's wall included
    work.save({"mode": "stock_naive", "variant": "cold", "pair": 1, "wall_s": 100.0, "serving_wall_s": 60.0})
    assert work.estimate("stock_naive", "cold", True, 200.0) == (100.0, 100.0)
    work.save({"mode": "stock_best", "variant": "fill", "pair": None, "wall_s": 45.0})
    assert work.estimate("stock_best", "best", False, 200.0) == (45.0, 20.0)  # no longer than its fill


def test_a_start_the_budget_cuts_short_is_no_failure_and_runs_again(standin, capsys, monkeypatch):
    work = standin / "work"
    _floor(work, 1.0)
    monkeypatch.setenv("STANDIN_START_S", "30")  # longer than the 4 s left
    assert _run(work, "vllm", "foundry", "--no-floor", "--budget", "4") == 0
    out = capsys.readouterr().out
    assert "foundry/save pair None: needs ~30 s, 4 s left: its timeout cut to that" in out
    assert "cut by the budget: TimeoutError" in out
    starts = [json.loads(p.read_text()) for p in sorted((work / "tiny" / "starts").glob("*.json"))]
    assert len(starts) == 1 and starts[0]["cut_by_budget"] is True and starts[0]["timeout_s"] <= 4
    save = _merge(work, "vllm", standin / "cut.json")["shapes"]["tiny"]["modes"]["foundry"]["save"]
    assert save["cut_by_budget"] == 1 and "errors" not in save

    monkeypatch.delenv("STANDIN_START_S")
    assert _run(work, "vllm", "foundry", "--no-floor") == 0  # the cut SAVE is made again, not given up
    starts = [json.loads(p.read_text()) for p in sorted((work / "tiny" / "starts").glob("*.json"))]
    assert [(s["variant"], "error" in s) for s in starts] == [
        ("save", True),
        ("save", False),
        ("cold", False),
        ("warm", False),
    ]


def _log(path: Path, lines: list[str]) -> list:
    import sxs_server

    path.write_bytes("\n".join(lines).encode() + b"\n")  # bytes: a bar's carriage returns stay
    return sxs_server.read_log(path)


def test_vllm_0_33_phases_sum_both_capture_stages_and_count_the_flashinfer_build(tmp_path):
    """vLLM 0.33.0's SAVE (lines of a real log, cut short): its memory profiling captures 2 graphs in
    a first stage, the real capture 51 in a second; a progress bar's line is written when the bar
    closes, so a stage counts from the engine's line before. FlashInfer's JIT build of the sampling
    module (no flashinfer-jit-cache) lasts until the engine's next line; the API server's lines in
    between are another process."""
    import sxs_server

    bar = (
        "\rCapturing CUDA graphs (FULL):   0%| | 0/{n} [00:00<?]\rCapturing CUDA graphs (FULL): 100%| {n}/{n}"
    )
    engine, jit = "(EngineCore pid=2) INFO", "2026-12-05 18:28:08,085 - INFO - core.py:594 - flashinfer.jit:"
    lines = _log(
        tmp_path / "vllm.log",
        [
            "[   17.256] (APIServer pid=1) INFO [startup.py:96] non-default args: {'model': '/m'}",
            f"[   31.527] {engine} [core.py:139] Initializing a V1 LLM engine (v0.33.0) with config: x",
            f"[   36.042] {engine} [model_runner.py:399] Loading model from scratch...",
            f"[   40.068] {engine} [default_loader.py:506] Loading weights took 2.38 seconds",
            f"[   42.517] {engine} [model_runner.py:428] Model loading took 3.22 GiB memory and 6.98 seconds",
            f"[   71.075] {engine} [monitor.py:62] [backbone] torch.compile took 27.49 s in total",
            f"[   73.207] {jit} Building JIT module sampling; this can take several minutes on first use.",
            "[  100.000] (APIServer pid=1) INFO [readahead.py:197] Foundry: read-ahead list /r.json",
            f"[  163.860] {bar.format(n=2)}",
            f"[  164.422] {engine} [model_runner.py:1163] Graph capturing finished in 1 secs, took 0.20 GiB",
            f"[  166.106] {jit} [Autotuner]: Autotuning process ends",
            f"[  169.876] {bar.format(n=51)}",
            f"[  170.586] {engine} [model_runner.py:1163] Graph capturing finished in 3 secs, took 0.34 GiB",
            "[  174.228] INFO:     Application startup complete.",
        ],
    )
    got = sxs_server.phases(lines, "vllm", 174.235)
    assert {k: v for k, v in got.items() if k != "marks"} == {
        "imports": 17.256,
        "spawn": 14.271,  # to the engine core's first line
        "setup": 4.515,  # to "Loading model from scratch"
        "weights": 6.475,  # to vLLM's own "Model loading took", not "Loading weights took"
        "after_weights_read": 2.449,  # "Loading weights took" to "Model loading took": gc passes
        "compile": 28.558,
        "jit": 90.653,  # 73.207 to the first bar's line
        "graphs": 5.042,  # 163.860-164.422 and 166.106-170.586
        "warmups": 3.649,  # from the second stage's end
    }
    assert got["marks"]["graphs_begin"] == 163.86 and got["marks"]["graphs_end"] == 170.586


def test_sglang_phases_from_its_log_lines(tmp_path):
    """SGLang 0.5.23's SAVE (lines of a real log, cut short): one capture stage whose begin line is
    written when it begins; its batches' progress bar inside; no JIT build logged."""
    import sxs_server

    lines = _log(
        tmp_path / "sglang.log",
        [
            "[   18.763] [2026-12-05 18:10:03] server_args={'model_path': '/m'}",
            "[   33.895] [2026-12-05 18:10:19] Init parallel begin.",
            "[   35.741] [2026-12-05 18:10:20] Load weight begin. avail mem=78.49 GB",
            "[   38.582] [2026-12-05 18:10:23] Load weight end. elapsed=2.84 s, type=Qwen3ForCausalLM",
            "[   39.284] [2026-12-05 18:10:24] Capture target decode CUDA graph begin. backend=full",
            "[   82.067]   0%|   | 0/36 [00:00<?]\rCapturing batches (bs=256 avail_mem=12.03 GB): 3%|",
            "[   82.608] [2026-12-05 18:11:07] Capture target decode CUDA graph end. bs=[1, 2]",
            "[   93.165] [2026-12-05 18:11:18] The server is fired up and ready to roll!",
        ],
    )
    got = sxs_server.phases(lines, "sglang", 94.168)
    assert {k: v for k, v in got.items() if k != "marks"} == {
        "imports": 18.763,
        "spawn": 15.132,  # the schedulers spawned, to their model runner's first line
        "setup": 1.846,
        "weights": 2.841,
        "compile": None,
        "jit": None,
        "graphs": 43.324,
        "warmups": 11.56,
    }


def test_outputs_compare_prompt_by_prompt_and_the_batched_request_apart():
    """A start whose batched request differs (stock does, run to run: which prompts share a prefill
    batch) still matches prompt by prompt; one whose answer to a prompt alone differs does not."""
    one = {"tokens": [[5, 6], [7, 8]], "top_logprobs": [[], []], "prompts_differ": True}
    ref = {
        "mode": "stock_naive",
        "variant": "cold",
        "outputs": dict(one, batched={"tokens": [[5, 6], [7, 8]]}),
    }
    drift = {
        "mode": "stock_best",
        "variant": "best",
        "outputs": dict(one, batched={"tokens": [[5, 9], [7, 8]]}),
    }
    out = sxs_merge.summarize([drift], ref, None)
    assert out["outputs_identical_to_stock"] is True and out["batched_outputs_identical_to_stock"] is False
    wrong = {
        "mode": "foundry",
        "variant": "cold",
        "outputs": dict(one, tokens=[[5, 6], [7, 9]], batched=ref["outputs"]["batched"]),
    }
    out = sxs_merge.summarize([wrong], ref, None)
    assert out["outputs_identical_to_stock"] is False and out["batched_outputs_identical_to_stock"] is True


def test_a_batched_answer_counts_as_stocks_when_some_stock_start_gave_it():
    """Stock's own starts answer the batched request in several ways: a Foundry start whose answer
    is one of them is among stock's; one whose answer no stock start gave is not."""
    one = {"tokens": [[5, 6], [7, 8]], "top_logprobs": [[], []], "prompts_differ": True}
    ref = {"mode": "stock_best", "variant": "fill", "outputs": dict(one, batched={"tokens": [[1]]})}
    other = {"mode": "stock_best", "variant": "best", "outputs": dict(one, batched={"tokens": [[2]]})}
    stock = [ref["outputs"]["batched"], other["outputs"]["batched"]]
    seen = {"mode": "foundry", "variant": "cold", "outputs": dict(one, batched={"tokens": [[2]]})}
    out = sxs_merge.summarize([seen], ref, None, stock)
    assert out["batched_outputs_identical_to_stock"] is False
    assert out["batched_outputs_among_stock_answers"] is True
    unseen = {"mode": "foundry", "variant": "cold", "outputs": dict(one, batched={"tokens": [[3]]})}
    assert (
        sxs_merge.summarize([seen, unseen], ref, None, stock)["batched_outputs_among_stock_answers"] is False
    )


def test_outputs_across_starts_compare_every_mode_with_the_first_answer():
    """A run with no stock start (foundry against peer) still says whether its modes agree: every
    answering start against the first, prompt by prompt; a failed start is left out, one differing
    logprob is a difference."""
    one = {"tokens": [[5, 6], [7, 8]], "top_logprobs": [[{"5": -0.1}], []], "prompts_differ": True}
    recs = [
        {"mode": "peer", "variant": "save", "outputs": dict(one, batched={"tokens": [[1]]})},
        {"mode": "foundry", "variant": "cold", "outputs": dict(one, batched={"tokens": [[1]]})},
        {"mode": "foundry", "variant": "save", "error": "cut", "outputs": {"tokens": [[9]]}},
    ]
    out = sxs_merge.outputs_across_starts(recs)
    assert out == {
        "starts": 2,
        "modes": ["foundry cold", "peer save"],
        "identical": True,
        "differ_by_prompt": True,
        "batched_identical": True,
    }
    recs.append({"mode": "peer", "variant": "cold", "outputs": dict(one, top_logprobs=[[{"5": -0.2}], []])})
    out = sxs_merge.outputs_across_starts(recs)
    assert out["identical"] is False and out["batched_identical"] is True
    assert sxs_merge.outputs_across_starts([recs[2]]) is None
