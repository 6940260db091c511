"""benchmarks/sxs.py end to end on the CPU, against stand-in engines (benchmarks/sxs_standin.py) that
answer the harness's real command lines: calls that add pairs to one work dir, the merge's result
fields and ratios, a peer refusal, the budget, and bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sxs  # noqa: E402  (benchmarks/ is no package)
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
    for name in ("foundry_vs_stock_best", "foundry_vs_stock_naive", "foundry_vs_peer"):
        assert shape["ratios"][name]["n"] == 3 and len(shape["ratios"][name]["pairs"]) == 3, name
    serving = shape["ratios"]["serving_throughput_vs_stock_default"]
    assert serving["saturating"]["median"] == 1.0 and serving["steady"]["n"] == 1  # serving in call 1 only
    assert shape["modes"]["stock_default"]["serving"]["saturating"]["output_tok_s"] == 1000.0
    best = shape["modes"]["stock_best"]
    assert best["outputs_identical_to_stock"] is True and best["outputs_differ_by_prompt"] is True
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
    order = {p: [s["mode"] for s in starts if s["pair"] == p and s["variant"] != "warm"] for p in (1, 2)}
    assert order[2] == list(reversed(order[1]))
    assert (standin / "out" / "sxs-sglang-h200.json").stat().st_size < 200_000
    png = standin / "out" / "sxs-sglang-h200.png"
    png.unlink(missing_ok=True)
    assert (
        sxs.main(["chart", str(standin / "out" / "sxs-sglang-h200.json")]) == 0 and png.stat().st_size > 1000
    )


def test_vllm_and_a_peer_refusal(standin, monkeypatch):
    work = standin / "work"
    assert _run(work, "vllm", "stock_naive,foundry") == 0
    result = _merge(work, "vllm", standin / "vllm.json")
    phases = result["shapes"]["tiny"]["modes"]["foundry"]["phases"]
    assert phases["compile"] is not None and phases["graphs"] == 0.05  # LOAD: the restore line's seconds
    assert result["shapes"]["tiny"]["ratios"]["foundry_vs_stock_naive"]["n"] == 1

    work2 = standin / "work2"
    monkeypatch.setenv("STANDIN_REFUSE", "sglang plugin failed to activate: this sglang is too new")
    assert _run(work2, "sglang", "stock_naive,peer") == 0
    peer = _merge(work2, "sglang", standin / "sg.json")["shapes"]["tiny"]["modes"]["peer"]
    assert peer["save"]["errors"][0]["refusal"].endswith("this sglang is too new")
    assert peer["starts"] == 1 and peer["ttft_cold_s"] is None  # the refused SAVE only: no LOAD tried

    work3 = standin / "work3"  # no upstream Foundry where it should be: no start under its name
    assert _run(work3, "sglang", "stock_naive,peer", peer=False) == 0
    peer = _merge(work3, "sglang", standin / "sg3.json")["shapes"]["tiny"]["modes"]["peer"]
    assert peer["save"]["errors"][0]["error"].startswith("upstream Foundry (foundry-core 0.1.0rc3) is not")


def test_budget_and_bad_input(standin, capsys):
    work = standin / "work"
    assert _run(work, "sglang", "stock_naive", "--budget", "5", "--no-floor") == 0
    assert "skip stock_naive/cold pair 1: needs ~30 s, 5 s left" in capsys.readouterr().out
    assert _run(work, "sglang", "stock_naive,foundry", "--no-floor") == 0
    assert _run(work, "sglang", "stock_naive,foundry", "--no-floor", "--budget", "1") == 0
    assert "stop before pair 2: it needs ~" in capsys.readouterr().out  # no half pair
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
    import sxs_merge

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
    import sxs_merge
    import sxs_server

    report = {
        "foundry_critical_s": 0.31,
        "foundry_steps_s": {"check_archive": 0.11, "recording": 0.06},
        "check_archive_split": {"inflate_s": 0.0, "hash_s": 0.01},
        "scheduler_start": {"method": "forkserver", "reason": None},
        "caches": {"new_files": {"total": 0}},
        "graphs": 36,
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
    summary = sxs_merge.foundry_summary([facts, facts])
    assert summary["critical_s"]["median"] == 0.31 and summary["steps_s"]["check_archive"] == 0.11
    assert summary["scheduler_start"] == ["forkserver"] and summary["readahead_plan_s"]["n"] == 2
