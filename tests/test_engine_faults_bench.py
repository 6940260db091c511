"""benchmarks/engine_faults.py without an engine or a GPU: its pure helpers (arguments, log facts,
archive states, verdicts, budget) and whole runs against a stand-in engine, a small script that
answers like a server with Foundry, prints the plugins' lines and writes real archives with
foundry_core.archive (so a SIGKILL, a full disk or a flipped byte does to it what it does to an
engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from foundry_core.archive import ArchiveWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine_faults  # noqa: E402  (benchmarks/ is no package)
import engine_run as cs  # noqa: E402
import faults_answers  # noqa: E402
import faults_archive  # noqa: E402
import faults_cases  # noqa: E402
import faults_catalog  # noqa: E402
import faults_context  # noqa: E402
import faults_log  # noqa: E402
import faults_result  # noqa: E402
import faults_runner  # noqa: E402
import faults_server  # noqa: E402
import faults_sustained  # noqa: E402
import faults_table  # noqa: E402
import faults_verdicts  # noqa: E402

TINY = json.loads((ROOT / "examples" / "qwen3-tiny" / "config.json").read_text())


# --- arguments and command lines ---------------------------------------------------------------------


def _args(*extra: str) -> list[str]:
    return ["--engine", "sglang", "--out", "/tmp/x.json", "--logs", "/tmp/l", *extra]


def test_parse_args_defaults_and_fixed_order():
    opts = engine_faults.parse_args(_args())
    assert opts.cases == list(faults_catalog.DEFAULT_CASES) and "sustained_load" not in opts.cases
    assert opts.kill_points == ["persisting"] and opts.max_bs == 64 and opts.weights == "dummy"
    assert opts.model_config == str(ROOT / "examples" / "qwen3-tiny" / "config.json")
    opts = engine_faults.parse_args(
        _args(
            "--cases",
            "damaged_cache,kill_during_save",
            "--kill-points",
            "complete,capture",
            "--model",
            "1.7b",
        )
    )
    assert opts.cases == ["kill_during_save", "damaged_cache"]  # the method's order, not the caller's
    assert opts.kill_points == ["capture", "complete"] and opts.model_config is None


@pytest.mark.parametrize(
    "extra",
    [
        ("--cases", "kill_during_save,nope"),
        ("--cases", "disk_full,disk_full"),
        ("--cases", ","),
        ("--kill-points", "halfway"),
        ("--model", "/no/such/config.json"),
        ("--parallel", "0"),
    ],
)
def test_parse_args_refuses(extra):
    with pytest.raises(SystemExit):
        engine_faults.parse_args(_args(*extra))


def test_server_argv_pins_batch_and_kv_before_the_foundry_flags(tmp_path):
    toml = tmp_path / "f.toml"
    argv = faults_server.server_argv(
        "sglang", tmp_path, 1234, toml, dummy=False, max_bs=64, kv_tokens=1000, kv_bytes=5
    )
    at = argv.index("--enable-foundry")
    assert argv[argv.index("--cuda-graph-max-bs-decode") + 1] == "64"
    assert argv.count("--cuda-graph-max-bs-decode") == 1
    assert argv[argv.index("--max-total-tokens") + 1] == "1000" and argv.index("--max-total-tokens") < at
    assert "--kv-cache-memory-bytes" not in argv and argv[-1] == str(toml)
    argv = faults_server.server_argv(
        "vllm", tmp_path, 1234, toml, dummy=True, max_bs=8, kv_tokens=1000, kv_bytes=5
    )
    assert argv[argv.index("--max-num-seqs") + 1] == "8" and argv.count("--max-num-seqs") == 1
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "5" and "--max-total-tokens" not in argv
    stock = faults_server.server_argv(
        "vllm", tmp_path, 1, toml, dummy=True, max_bs=0, kv_tokens=None, kv_bytes=None
    )
    assert stock == cs.server_command("vllm", tmp_path, 1, toml, dummy=True)


def test_kv_sizes():
    # 4 layers x 8 KV heads x 128 x (K, V) x bf16 = 16 KiB a token.
    assert faults_server.kv_sizes(TINY, 4.0) == (262144, 4 << 30)
    # Qwen3-1.7B: 112 KiB a token; at least two 40960-token requests.
    tokens, nbytes = faults_server.kv_sizes(cs.MODEL_CONFIG, 4.0)
    assert tokens == 2 * 40960 and nbytes == 4 << 30
    assert faults_server.kv_sizes(TINY, 0) == (None, None)


def test_write_toml_sets_the_mode(tmp_path):
    path = tmp_path / "a" / "foundry.toml"
    faults_server.write_toml(path, tmp_path / "arch", "load", "8GiB")
    text = path.read_text()
    assert 'mode = "load"' in text and f'archive_dir = "{tmp_path / "arch"}"' in text and "8GiB" in text


# --- log facts -----------------------------------------------------------------------------------------

SGLANG_LOG = [
    (62.4, "[2026-12-01 18:56:23] Foundry SAVE: rank 0, archive /w/archive/rank0"),
    (69.4, "Capturing batches (bs=64 avail_mem=68.39 GB):   0%|          | 0/12"),
    (
        90.1,
        "[2026-12-01 18:57:53] Foundry rank 0: SAVE failed (cannot write graphs/0000.bin into /w/.rank0.tmp-1-"
        "abcdef12: No space left on device); serving with the graphs just captured, nothing saved",
    ),
    (
        91.0,
        "[2026-12-01 18:57:54] Foundry caches: /c/x not usable (held by another server); using a random folder",
    ),
]
VLLM_LOG = [
    (28.9, "(APIServer pid=1878) INFO 12-01 18:49:03 [engine_args.py:89] Foundry enabled: config /w/f.toml"),
    (
        49.5,
        "(EngineCore pid=1973) INFO 12-01 18:49:24 [session.py:170] Foundry rank 0: LOAD (valid archive for "
        "this configuration at /w/archive/rank0.vllm.json)",
    ),
    (
        49.6,
        "(EngineCore pid=1973) WARNING 12-01 18:49:24 [handover.py:220] Foundry rank 0: carried caches "
        "/w/archive/rank0.caches refused (archive /w/archive/rank0.caches: file 'caches/triton/k' fails its sha256 "
        "check; it is damaged, SAVE again); the engine compiles as usual",
    ),
    (
        58.9,
        "(EngineCore pid=1973) INFO 12-01 18:49:33 [session.py:339] Foundry rank 0: restored 51 decode graphs",
    ),
]


def test_log_facts_sglang():
    facts = faults_log.log_facts(SGLANG_LOG, "sglang")
    assert facts["mode"] == "save" and facts["mode_line"]["t_s"] == 62.4
    assert "No space left on device" in facts["lines"]["save_failed"]["reason"]
    assert facts["lines"]["no_space"]["t_s"] == 90.1 and facts["counts"]["random_cache_folder"] == 1
    assert facts["engine_pids"] == [] and "published" not in facts["lines"]
    stock = faults_log.log_facts(
        [
            (
                30.0,
                "Foundry: archive_dir /proc/x is not writable (No such file or directory); auto mode serves "
                "without Foundry this time (nothing can be saved)",
            )
        ],
        "sglang",
    )
    assert stock["mode"] == "stock" and "not_writable" in stock["lines"]


def test_log_facts_vllm():
    facts = faults_log.log_facts(VLLM_LOG, "vllm")
    assert facts["mode"] == "load" and facts["engine_pids"] == [1973]
    assert "fails its sha256 check" in facts["lines"]["caches_refused_auto"]["reason"]
    assert "caches_refused_load" not in facts["lines"]
    refused = faults_log.log_facts(
        [(20.0, "error: Foundry: carried caches /w/rank0.caches refused (x); mode=load cannot go on")], "vllm"
    )
    assert refused["mode"] is None and "caches_refused_load" in refused["lines"]
    excerpt = faults_log.excerpt(VLLM_LOG)
    assert len(excerpt) == 4 and excerpt[1].startswith("[   49.50]")


def test_pump_splits_progress_bars_and_watches_lines_as_they_come(tmp_path):
    code = (
        "import sys, time\n"
        "sys.stdout.write('start\\n'); sys.stdout.flush()\n"
        "for i in range(3):\n"
        "    sys.stdout.write(f'\\rCapturing batches (bs={i}): {i}%|'); sys.stdout.flush(); time.sleep(0.05)\n"
        "time.sleep(2)\n"
        "print('\\nend')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pump = faults_log.Pump(proc.stdout, tmp_path / "p.log", time.monotonic())
    pump.start()
    watch = pump.watch(r"Capturing batches \(bs=1\)")
    assert watch.event.wait(1.5), "a progress update is a line of its own, seen before the bar ends"
    assert proc.poll() is None and watch.line.endswith("1%|")
    late = pump.watch("start")  # a line seen before the watch was asked for
    assert late.is_set() and late.t < watch.t
    proc.wait()
    pump.join(5)
    proc.stdout.close()
    texts = [line for _, line in pump.lines]
    assert texts == ["start", *[f"Capturing batches (bs={i}): {i}%|" for i in range(3)], "end"]
    assert (tmp_path / "p.log").read_text().count("\n") == 5


# --- outputs ----------------------------------------------------------------------------------------------


def test_compare_outputs():
    ref = {
        "tokens": [[1, 2, 3], [4, 5, 6]],
        "token_logprobs": [[-1.0, -2.0, -3.0]] * 2,
        "top_logprobs": [[]] * 2,
    }
    assert faults_answers.compare_outputs(ref, json.loads(json.dumps(ref)))["equal"] is True
    other = json.loads(json.dumps(ref))
    other["tokens"][1][2] = 9
    other["token_logprobs"][0][1] = -2.5
    cmp = faults_answers.compare_outputs(other, ref)
    assert cmp["equal"] is False and cmp["tokens"] is False and cmp["logprobs"] is False
    assert cmp["first_difference"] == {"prompt": 1, "position": 2, "got": [9], "want": [6]}
    assert cmp["max_logprob_difference"] == 0.5
    assert faults_answers.compare_outputs(None, ref)["equal"] is None


def test_sustained_requests_mix_batch_sizes():
    requests = faults_sustained.sustained_requests(16)
    assert [len(r) for r in requests] == [1, 3, 8, 16]
    flat = [tuple(p) for r in requests for p in r]
    assert len(set(flat)) == len(flat)  # every prompt differs
    assert all(
        len(cs.TOKENIZER_SPECIALS) <= t < len(cs.TOKENIZER_SPECIALS) + cs.TOKENIZER_WORDS
        for p in flat
        for t in p
    )
    assert [len(r) for r in faults_sustained.sustained_requests(0)] == list(faults_sustained.SUSTAIN_SIZES)


def _answer(seed: int, prompts: int = 2) -> dict:
    """An answer as extract_outputs makes it: ids, chosen logprobs, top logprobs as [key, value] pairs."""
    ids = [[(seed * 7 + p * 3 + k) % 50 for k in range(4)] for p in range(prompts)]
    lps = [[-0.25 - ((t + seed) % 5) / 8 for t in row] for row in ids]
    tops = [[[[str(t), lp], ["x", lp - 1.0]] for t, lp in zip(row, lrow)] for row, lrow in zip(ids, lps)]
    return {"tokens": ids, "token_logprobs": lps, "top_logprobs": tops, "text": ["a"] * prompts}


def _variant(answer: dict, change) -> dict:
    out = json.loads(json.dumps(answer))
    change(out)
    return out


@pytest.mark.parametrize(
    ("change", "equal"),
    [
        (lambda a: None, True),
        (lambda a: a.update(text=["other"] * 2), True),  # text is not compared
        (lambda a: a["top_logprobs"][1][2][0].__setitem__(1, -9.0), False),
        (lambda a: a["token_logprobs"][0].__setitem__(3, -0.3), False),
        (lambda a: a["tokens"][1].__setitem__(0, 49), False),
        (lambda a: a["tokens"].append([1]), False),
        (lambda a: a.pop("top_logprobs"), False),
        (lambda a: a["token_logprobs"].__setitem__(1, None), False),
    ],
)
def test_answer_digest_equal_exactly_where_compare_outputs_is(change, equal):
    ref = _answer(3)
    got = _variant(ref, change)
    assert faults_answers.compare_outputs(got, ref)["equal"] is equal
    assert (faults_answers.answer_digest(got) == faults_answers.answer_digest(ref)) is equal


def test_answer_digest_of_odd_floats_and_errors():
    ref = _answer(1)
    ref["token_logprobs"][0][0] = 0.0
    negative_zero = _variant(ref, lambda a: a["token_logprobs"][0].__setitem__(0, -0.0))
    assert faults_answers.compare_outputs(negative_zero, ref)["equal"] is True  # -0.0 == 0.0
    assert faults_answers.answer_digest(negative_zero) == faults_answers.answer_digest(ref)
    infinite = _variant(ref, lambda a: a["top_logprobs"][0][0][1].__setitem__(1, float("-inf")))
    assert faults_answers.compare_outputs(infinite, json.loads(json.dumps(infinite)))["equal"] is True
    assert faults_answers.answer_digest(infinite) == faults_answers.answer_digest(
        json.loads(json.dumps(infinite))
    )
    assert faults_answers.answer_digest(infinite) != faults_answers.answer_digest(ref)
    nan = _variant(ref, lambda a: a["token_logprobs"][1].__setitem__(2, float("nan")))
    nan_again = json.loads(json.dumps(nan))
    assert faults_answers.compare_outputs(nan, nan_again)["equal"] is False  # NaN equals nothing
    assert faults_answers.answer_digest(nan) != faults_answers.answer_digest(nan_again)
    assert faults_answers.answer_digest({"error": "RuntimeError: boom"}) is None
    assert faults_answers.answer_digest({}) is None


def _passes(n: int, requests: int = 3) -> list[list[dict]]:
    return [[_answer(10 * i + 1) for i in range(requests)] for _ in range(n)]


def _stock_case(load: list[list[dict]], stock: list[list[dict]] | None) -> dict:
    digests = [[faults_answers.answer_digest(g) for g in p] for p in load]
    return faults_answers.compare_with_stock(load[:2], digests, stock)


def test_compare_with_stock_counts_and_names_a_late_mismatch():
    stock = _passes(2)
    stock[1][1] = _answer(99)  # stock's second pass differs from its first: pass p >= 1 is against it
    load = _passes(8)
    for p in range(1, 8):
        load[p][1] = _answer(99)
    assert _stock_case(load, stock) == {"compared": 24, "mismatches": 0, "first_mismatch": None}
    load[5][2] = _variant(load[5][2], lambda a: a["top_logprobs"][0][3][1].__setitem__(1, -7.5))
    assert _stock_case(load, stock) == {
        "compared": 24,
        "mismatches": 1,
        "first_mismatch": {
            "pass": 5,
            "request": 2,
            "equal": False,
            "digests_differ": True,
            "load_error": False,
            "stock_error": False,
        },
    }
    # The same difference in a pass still kept whole: compare_outputs's detail.
    load[1][0] = _variant(load[1][0], lambda a: a["token_logprobs"][1].__setitem__(2, -4.0))
    out = _stock_case(load, stock)
    assert out["mismatches"] == 2 and out["first_mismatch"]["pass"] == 1
    assert out["first_mismatch"]["request"] == 0 and out["first_mismatch"]["tokens"] is True
    assert out["first_mismatch"]["logprobs"] is False and out["first_mismatch"]["max_logprob_difference"] > 3


def test_compare_with_stock_counts_errors_on_either_side():
    stock, load = _passes(2), _passes(6)
    load[3][0] = {"error": "RuntimeError: /v1/completions answered 500"}
    out = _stock_case(load, stock)
    assert out["mismatches"] == 1
    assert out["first_mismatch"] == {
        "pass": 3,
        "request": 0,
        "equal": False,
        "digests_differ": True,
        "load_error": True,
        "stock_error": False,
    }
    stock[1][2] = {"error": "OSError: reset"}  # against every LOAD pass from the second on
    out = _stock_case(load, stock)
    assert out["compared"] == 18 and out["mismatches"] == 1 + 5
    assert out["first_mismatch"] == {"pass": 1, "request": 2, "equal": False, "error": "OSError: reset"}


def test_without_stock_passes_nothing_is_compared():
    nothing = {"compared": 0, "mismatches": None, "first_mismatch": None}
    assert _stock_case(_passes(4), None) == nothing
    assert _stock_case(_passes(4), []) == nothing
    assert _stock_case([], _passes(2)) == nothing


_UNUSED = {"compared": 0, "mismatches": None, "first_mismatch": None}
_SAME = {"compared": 12, "mismatches": 0, "first_mismatch": None}
_DIFFERS = {"compared": 12, "mismatches": 2, "first_mismatch": {"pass": 0, "request": 1}}


@pytest.mark.parametrize(
    "base_reference, mismatches, stock_answered, vs_load, vs_reference, want",
    [
        # No base reference: stock is the reference, or nothing is.
        (False, None, False, _UNUSED, _UNUSED, (None, None)),
        (False, 0, True, _UNUSED, _UNUSED, (True, True)),
        (False, 3, True, _UNUSED, _UNUSED, (False, False)),
        # A base reference: stock equals every LOAD pass only through the base's two passes.
        (True, 0, True, _SAME, _SAME, (True, True)),
        (True, 0, True, _DIFFERS, _SAME, (True, False)),
        (True, 1, True, _SAME, _SAME, (False, False)),
        (True, 0, False, _UNUSED, _UNUSED, (True, None)),
    ],
)
def test_sustained_output_checks(base_reference, mismatches, stock_answered, vs_load, vs_reference, want):
    got = faults_answers.sustained_output_checks(
        base_reference, mismatches, stock_answered, vs_load, vs_reference
    )
    assert (got["outputs_equal_reference"], got["outputs_equal_stock"]) == want


# --- archive directories ------------------------------------------------------------------------------------


def _write(path: Path, kind: str, members: dict[str, bytes], meta: dict | None = None) -> str:
    with ArchiveWriter(path) as w:
        for rel, data in members.items():
            w.add_bytes(rel, data)
        return w.commit(fingerprint={"fake": 1}, meta={"kind": kind, **(meta or {})})


def _complete_archive(d: Path, engine: str = "sglang") -> None:
    slots = {"memory_pool_config": {"tokens": 8}}
    graphs = [{"name": "decode/size=1"}, {"name": "decode/size=2"}]
    _write(
        d / "rank0",
        "foundry-graphs",
        {"graphs/0.bin": b"g" * 5000, "graphs/1.bin": b"h" * 300},
        {"graphs": graphs, "slots": slots},
    )
    _write(
        d / "rank0.caches",
        "foundry-caches",
        {"caches/triton/k.cubin": os.urandom(4000), "caches/cuda/x": b"x"},
    )
    if engine == "sglang":
        record = {"fingerprint": {}, "slots": slots, "outputs": {"decode/size=1": {}}}
        (d / "rank0.sglang.json").write_text(json.dumps(record))
    else:
        record = {"kind": "foundry-vllm", "schema": 1, "fingerprint": {}, "sizing": slots, "graphs": graphs}
        (d / "rank0.vllm.json").write_text(json.dumps(record))


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_archive_state_of_a_complete_archive(tmp_path, engine):
    _complete_archive(tmp_path, engine)
    state = faults_archive.archive_state(tmp_path, engine)
    assert (
        state["complete"] and state["consistent"] and not state["loadable_partial"] and state["any_archive"]
    )
    assert state["graph"]["graphs"] == 2 and state["graph"]["max_member"] == {
        "name": "graphs/0.bin",
        "bytes": 5000,
    }
    assert state["record"]["matches_graph_archive"] is True and state["leftovers"] == []
    assert {k: len(v) for k, v in state["versions"].items()} == {"rank0": 1, "rank0.caches": 1}
    # The record from another SAVE (its pool sizing differs): complete, but not consistent.
    name = faults_archive.RECORD_NAMES[engine]
    record = json.loads((tmp_path / name).read_text())
    record["slots" if engine == "sglang" else "sizing"] = {"memory_pool_config": {"tokens": 9}}
    (tmp_path / name).write_text(json.dumps(record))
    state = faults_archive.archive_state(tmp_path, engine)
    assert state["complete"] and not state["consistent"] and state["record"]["matches_graph_archive"] is False


def test_archive_state_after_kills(tmp_path):
    # Killed while persisting: a scratch directory, nothing published.
    (tmp_path / ".rank0.tmp-123-abcdef12").mkdir()
    (tmp_path / ".rank0.lock").write_text("")
    state = faults_archive.archive_state(tmp_path, "sglang")
    assert (
        state["leftovers"] == [".rank0.tmp-123-abcdef12"] and state["any_archive"] and not state["complete"]
    )
    quick = faults_archive.quick_state(tmp_path, "sglang")
    assert quick == {"scratch": [".rank0.tmp-123-abcdef12"], "link": None, "record": False}
    # A record with no graph archive behind it is what must never be offered to a LOAD.
    (tmp_path / "rank0.sglang.json").write_text(json.dumps({"fingerprint": {}}))
    assert faults_archive.archive_state(tmp_path, "sglang")["loadable_partial"] is True
    # Published graphs without caches and record: not complete, nothing loadable.
    other = tmp_path / "published"
    other.mkdir()
    _write(other / "rank0", "foundry-graphs", {"graphs/0.bin": b"g"}, {"graphs": [], "slots": {}})
    state = faults_archive.archive_state(other, "vllm")
    assert state["graph"]["ok"] and not state["complete"] and not state["loadable_partial"]
    assert faults_archive.quick_state(other, "vllm")["link"].startswith(".rank0.")
    # A lock file alone is no archive; a missing directory neither.
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / ".rank0.lock").write_text("")
    assert not faults_archive.archive_state(lonely, "sglang")["any_archive"]
    assert faults_archive.archive_state(tmp_path / "missing", "sglang")["exists"] is False


def test_stage_copy_and_flipped_byte(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    _complete_archive(base)
    (base / ".rank0.lock").write_text("1")
    (base / "rank0.start.json").write_text("{}")
    (base / ".rank0.caches.tmp-9-0123abcd").mkdir()  # a late caches save the base's stop interrupted
    copy = tmp_path / "case" / "archive"
    faults_archive.stage_archive(base, copy)
    skipped = {e for e in os.listdir(base) if e.endswith(".lock")} | {
        "rank0.start.json",
        ".rank0.caches.tmp-9-0123abcd",
    }
    assert {".rank0.lock", ".rank0.caches.lock"} <= skipped
    assert sorted(os.listdir(copy)) == sorted(set(os.listdir(base)) - skipped)
    assert os.readlink(copy / "rank0") == os.readlink(base / "rank0")  # relative: resolves in the copy
    assert faults_archive.archive_state(copy, "sglang")["consistent"]
    flipped = faults_archive.flip_byte(copy / "rank0.caches")
    assert flipped["member"] == "caches/triton/k.cubin" and flipped["new"] == flipped["old"] ^ 0xFF
    state = faults_archive.archive_state(copy, "sglang")
    assert (
        state["graph"]["ok"]
        and not state["caches"]["ok"]
        and "fails its sha256 check" in state["caches"]["error"]
    )
    base_state = faults_archive.archive_state(base, "sglang")  # the base is untouched (its leftover aside)
    assert base_state["complete"] and base_state["caches"]["ok"] and base_state["leftovers"]


def test_largest_file_and_rlimit_threshold(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "big").write_bytes(b"x" * 300)
    (tmp_path / "small").write_bytes(b"x" * 10)
    os.symlink(tmp_path / "a" / "big", tmp_path / "link")
    assert faults_archive.largest_file([tmp_path, tmp_path / "missing"]) == {
        "bytes": 300,
        "path": str(tmp_path / "a" / "big"),
    }
    assert faults_archive.rlimit_threshold(4000, 1000) == (
        3000,
        faults_archive.rlimit_threshold(4000, 1000)[1],
    )
    limit, why = faults_archive.rlimit_threshold(2000, 1300)
    assert limit is None and "not clearly larger" in why
    assert faults_archive.rlimit_threshold(None, 10)[0] is None
    assert (
        faults_cases.parse_size("1m") == 1 << 20
        and faults_cases.parse_size("64KiB") == 64 << 10
        and faults_cases.parse_size("123") == 123
    )


# --- verdicts and budget ------------------------------------------------------------------------------------------


def test_verdict_and_kill_rules():
    assert faults_verdicts.verdict({"a": True, "b": True}) == "pass"
    assert faults_verdicts.verdict({"a": True, "b": None}) == "inconclusive"
    assert faults_verdicts.verdict({"a": None, "b": False}) == "fail"
    assert faults_verdicts.verdict({}) == "inconclusive"
    complete = {"state_after": {"complete": True}}
    partial = {"state_after": {"complete": False}}
    assert (
        faults_verdicts.restart_ok(partial, "save") is True
        and faults_verdicts.restart_ok(complete, "save") is True
    )
    assert faults_verdicts.restart_ok(partial, "load") is False  # a LOAD of what a killed SAVE left
    assert (
        faults_verdicts.restart_ok(complete, "load") is True
        and faults_verdicts.restart_ok(partial, None) is None
    )
    assert faults_verdicts.requests_equal({}) is None
    assert faults_verdicts.requests_equal({"requests": [{"equal": True}, {"equal": False}]}) is False
    rec = {
        "ready_s": None,
        "exited_by_itself": True,
        "exit_code": 1,
        "facts": {"lines": {"save_refused": {}}},
    }
    assert faults_verdicts.refused_cleanly(rec, "save_refused") == {
        "never_ready": True,
        "exited_nonzero": True,
        "line": True,
    }
    served = {"ready_s": 3.0, "exited_by_itself": False, "exit_code": -15, "facts": {"lines": {}}}
    assert faults_verdicts.refused_cleanly(served, "save_refused") == {
        "never_ready": False,
        "exited_nonzero": False,
        "line": False,
    }


def test_estimates_and_skipping():
    opts = types.SimpleNamespace(kill_points=["persisting", "published"], sustain=100.0)
    times = {"save": 100.0, "load": 50.0, "refuse": 30.0}
    assert faults_runner.estimate_s("kill_during_save", opts, times) == 300 + faults_context.MARGIN_S
    assert faults_runner.estimate_s("sustained_load", opts, times) == 160 + faults_context.MARGIN_S
    ctx = types.SimpleNamespace(opts=opts, times=times, left=lambda: 200.0)
    assert (
        faults_runner.skip_reason("archive_replaced", ctx, True)
        == "skipped: needs about 245 s, 200 s of the budget left"
    )
    assert faults_runner.skip_reason("damaged_cache", ctx, True) is None
    assert "base SAVE" in faults_runner.skip_reason("damaged_cache", ctx, False)


def test_assemble_and_summary():
    meta = {"engine": "sglang", "cases_requested": ["disk_full", "two_replicas"]}
    cases = {
        "two_replicas": {"verdict": "fail", "not_passed_checks": ["exactly_one_published"], "seconds": 3},
        "disk_full": {"verdict": "pass", "seconds": 2},
    }
    out = faults_result.assemble(meta, {"ok": True}, cases)
    assert list(out["cases"]) == ["disk_full", "two_replicas"] and out["all_passed"] is False
    assert out["summary"]["fail"] == ["two_replicas"] and out["verdicts"]["disk_full"] == "pass"
    lines = faults_result.summary_lines(out)
    assert "two_replicas: fail (3 s) exactly_one_published" in lines[-1]
    cases["two_replicas"]["verdict"] = "pass"
    assert faults_result.assemble(meta, None, cases)["all_passed"] is True
    assert (
        faults_result.assemble({**meta, "cases_requested": ["damaged_cache"]}, None, cases)["all_passed"]
        is False
    )


# --- whole runs against a stand-in engine --------------------------------------------------------------------------

FAKE_ENGINE = textwrap.dedent(
    """
    import json, os, sys, tempfile, time, tomllib
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path

    from foundry_core.archive import ArchiveError, ArchiveWriter, open_archive

    style = os.environ.get("FAKE_STYLE", "sglang")
    knob = lambda name, default: float(os.environ.get("FAKE_" + name, default))
    argv = sys.argv
    port = int(argv[argv.index("--port") + 1])
    if "--foundry-config" in argv:
        cfg = tomllib.loads(Path(argv[argv.index("--foundry-config") + 1]).read_text())
        mode, adir = cfg["mode"], Path(cfg["archive_dir"])
    else:  # a stock server: no Foundry at all
        mode, adir = "stock", Path(tempfile.mkdtemp())
    record = adir / ("rank0.sglang.json" if style == "sglang" else "rank0.vllm.json")
    pid = os.getpid()
    slots = {"memory_pool_config": {"tokens": 64}}
    graphs = [{"name": "decode/size=1"}, {"name": "decode/size=2"}]


    def log(msg):
        prefix = f"(EngineCore pid={pid}) INFO " if style == "vllm" else "[2026-12-01 10:00:00] "
        print(prefix + msg, flush=True)


    def writable(d):
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=d)
            os.close(fd)
            os.unlink(probe)
            return True
        except OSError as e:
            return e.strerror


    def complete():
        try:
            open_archive(adir / "rank0")
        except (ArchiveError, OSError):
            return False
        return record.exists()


    problem = writable(adir) if mode == "save" or not complete() else True
    if mode == "save" and problem is not True:
        print(f"error: Foundry: archive_dir {adir} is not writable ({problem}); mode = save cannot go on")
        sys.stdout.flush()
        if os.environ.get("FAKE_HANG_AFTER_REFUSAL"):  # a launcher that says why but does not end
            time.sleep(600)
        sys.exit(1)
    decided = {"auto": "load" if complete() else "save"}.get(mode, mode)
    if decided == "load" and not complete():
        print(f"error: mode=load but {adir} holds no complete archive"); sys.exit(1)
    foundry = mode != "stock"
    if style == "sglang" and decided == "save" and problem is not True:
        log(f"Foundry: archive_dir {adir} is not writable ({problem}); auto mode serves without Foundry this time")
        foundry = False
    report = {"mode": decided, "pid": pid, "caches": {}}
    if foundry:
        if style == "vllm":
            log(f"Foundry rank 0: {decided.upper()} (fake)")
        else:
            log(f"Foundry {decided.upper()}: rank 0, archive {adir}/rank0")
        if decided == "load":
            try:
                caches = open_archive(adir / "rank0.caches")
                report["caches"] = {"digest": caches.digest, "new_files": {"total": 0}}
            except ArchiveError as e:
                line = f"carried caches {adir}/rank0.caches refused ({e})"
                if mode == "load":
                    print(f"error: Foundry: {line}; mode=load cannot go on", flush=True)
                    sys.exit(1)
                log(f"Foundry rank 0: {line}; the engine compiles as usual")
                report["caches"] = {"refused": str(e), "new_files": {"total": 3}}
        else:
            record.unlink(missing_ok=True)
    quiet = os.environ.get("FAKE_QUIET_CAPTURE")  # a capture that logs nothing
    log("Capture target decode CUDA graph begin. bs=[1, 2]") if not quiet else None
    for i in range(0 if quiet else 3):
        sys.stdout.write(f"\\rCapturing batches (bs={2 - i}): {33 * i}%|")
        sys.stdout.flush()
        time.sleep(knob("CAPTURE_S", 0.1) / 3)
    print()
    log("Capture target decode CUDA graph end. elapsed=0.1 s") if not quiet else None
    # FAKE_STAGGER: servers of archive directories whose path contains it wait for each other to
    # have decided, then the second to get here writes 1.5 s after the first.
    stagger = adir.parent / "stagger"
    match = os.environ.get("FAKE_STAGGER")
    if match and match in str(adir) and foundry and decided == "save":
        stagger.mkdir(exist_ok=True)
        Path(stagger, f"decided-{pid}").touch()
        t_wait = time.monotonic() + 10
        while len(list(Path(stagger).glob("decided-*"))) < 2 and time.monotonic() < t_wait:
            time.sleep(0.01)
        try:
            os.close(os.open(os.path.join(stagger, "first"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            time.sleep(1.5)
    if foundry and decided == "save":
        try:
            with ArchiveWriter(adir / "rank0") as w:
                w.add_bytes("graphs/0000.bin", b"g" * int(knob("GRAPH_BYTES", 200000)))
                w.add_bytes("graphs/stamp", str(time.time_ns()).encode())
                time.sleep(knob("PERSIST_S", 0))
                w.commit(fingerprint={"fake": 1}, meta={"kind": "foundry-graphs", "graphs": graphs, "slots": slots})
            if style == "vllm":
                log(f"Foundry rank 0: wrote 2 decode graphs to {adir}/rank0 in 0.1 s; published with the manifest")
            time.sleep(knob("PUBLISH_GAP_S", 0))
            with ArchiveWriter(adir / "rank0.caches") as w:
                w.add_bytes("caches/triton/k.cubin", os.urandom(3000))
                digest = w.commit(fingerprint={}, meta={"kind": "foundry-caches", "kinds": {}})
            report["caches"] = {"digest": digest}
            log(f"Foundry rank 0: compile caches saved to {adir}/rank0.caches (triton 1 files) in 0.01 s")
            if style == "vllm":
                data = {"kind": "foundry-vllm", "schema": 1, "fingerprint": {}, "sizing": slots, "graphs": graphs}
            else:
                data = {"fingerprint": {}, "slots": slots, "outputs": {g["name"]: {} for g in graphs}}
            tmp = record.with_name(record.name + ".x.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, record)
            if style == "sglang":
                log(f"Foundry SAVE: 2 decode graphs persisted to {adir}/rank0")
            report["saved"] = True
        except (ArchiveError, OSError) as e:
            if mode == "save":
                print("Traceback (most recent call last):")
                print(f"foundry_core.archive.errors.ArchiveError: {e}", flush=True)
                sys.exit(1)
            log(f"Foundry rank 0: SAVE failed ({e}); serving with the graphs just captured, nothing saved")
            report["saved"] = False
    if foundry:
        if style == "sglang":
            rdir = Path(os.environ["FOUNDRY_SGLANG_REPORT_DIR"])
            rdir.mkdir(parents=True, exist_ok=True)
            (rdir / "rank0.json").write_text(json.dumps(report))
        else:
            try:
                (adir / "rank0.start.json").write_text(json.dumps(report))
            except OSError as e:
                log(f"Foundry rank 0: start report not written: {e}")


    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, data):
            raw = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._send({"data": [{"id": "fake-model"}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            choices = []
            shift = 1 if mode == "stock" and os.environ.get("FAKE_STOCK_DIFFERS") else 0
            for i, prompt in enumerate(body["prompt"]):
                ids = [(sum(prompt) * 31 + len(prompt) + k + shift) % 4000 for k in range(body["max_tokens"])]
                lps = [-0.5 - (t % 7) / 8 for t in ids]
                tops = [{str(t): lp, "x": lp - 1} for t, lp in zip(ids, lps)]
                choices.append({"index": i, "text": "", "token_ids": ids,
                                "logprobs": {"token_logprobs": lps, "top_logprobs": tops}})
            self._send({"choices": choices})


    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("INFO:     Application startup complete.", flush=True)
    server.serve_forever()
    """
)


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)

    def command(engine, model_dir, port, toml, **kwargs):
        argv = [sys.executable, str(script), "--port", str(port)]
        return argv + (["--enable-foundry", "--foundry-config", str(toml)] if toml else [])

    monkeypatch.setattr(cs, "server_command", command)
    monkeypatch.setattr(
        faults_cases,
        "cli_verify",
        lambda path: {"ok": faults_archive.archive_state(path.parent, "sglang")["graph"]["ok"]},
    )
    samples = iter(range(1000, 100000, 1))  # device memory that grows 1 MiB a sample
    monkeypatch.setattr(
        faults_sustained, "gpu_memory_of", lambda pgid: {"server_mib": next(samples), "device_mib": None}
    )
    for knob in (
        "CAPTURE_S",
        "PERSIST_S",
        "PUBLISH_GAP_S",
        "GRAPH_BYTES",
        "STYLE",
        "QUIET_CAPTURE",
        "STAGGER_DIR",
        "STOCK_DIFFERS",
    ):
        monkeypatch.delenv(f"FAKE_{knob}", raising=False)

    def run(*extra: str, engine: str = "sglang") -> tuple[int, dict]:
        out = tmp_path / "out" / f"faults-{engine}.json"
        argv = ["--engine", engine, "--out", str(out), "--logs", str(tmp_path / "logs")]
        argv += ["--workdir", str(tmp_path / "work"), "--weights", "dummy", "--timeout", "60", *extra]
        rc = engine_faults.main(argv)
        return rc, json.loads(out.read_text())

    return run


def _checks(result: dict, case: str) -> dict:
    return result["cases"][case]["checks"]


def test_kill_during_save_chain_and_two_replicas(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_PERSIST_S", "1.0")  # the graph archive's scratch directory lives 1 s
    monkeypatch.setenv("FAKE_PUBLISH_GAP_S", "1.0")  # published graphs, no record, for 1 s
    rc, result = fake_engine(
        "--cases", "kill_during_save,two_replicas", "--kill-points", "capture,persisting,published"
    )
    assert result["base"]["ok"] and result["base"]["state"]["consistent"], result["base"]
    kill = result["cases"]["kill_during_save"]
    assert kill["verdict"] == "pass", (kill.get("not_passed_checks"), kill.get("error"), kill["details"])
    kills = kill["details"]["kills"]
    assert [k["point"] for k in kills] == ["capture", "persisting", "published"]
    assert "Capture" in kills[0]["how"] and "scratch directory" in kills[1]["how"]
    assert "published" in kills[2]["how"] and kills[2]["state_after"]["graph"]["ok"]
    assert not kills[2]["state_after"]["complete"] and kills[1]["state_after"]["leftovers"]
    assert [k["restart_mode"] for k in kills] == ["save", "save", "save"]
    assert list(kill["servers"]) == ["target0-capture", "target1-persisting", "target2-published", "restart"]
    assert kill["details"]["state_after_restart"]["consistent"]  # the leftovers were cleaned up
    assert all("killed_at_s" in kill["servers"][s] for s in list(kill["servers"])[:3])
    replicas = result["cases"]["two_replicas"]
    assert replicas["verdict"] == "pass", (replicas.get("not_passed_checks"), replicas["details"])
    published = replicas["details"]["published"]
    assert sorted(published.values()) == [False, True]  # the other one found the lock held
    loser = next(s for s, v in published.items() if not v)
    assert "lock_held" in replicas["servers"][loser]["facts"]["lines"]
    assert rc == 0


def test_kill_points_spread_over_resumed_calls_make_one_case(fake_engine, monkeypatch):
    # SGLang's SAVE starts (110-175 s each) do not let one device call hold the whole chain: the
    # points go into calls of their own, and --resume keeps the earlier call's kills.
    monkeypatch.setenv("FAKE_PERSIST_S", "1.0")
    monkeypatch.setenv("FAKE_PUBLISH_GAP_S", "1.0")
    rc, first = fake_engine("--cases", "kill_during_save", "--kill-points", "capture,persisting")
    assert first["cases"]["kill_during_save"]["verdict"] == "pass" and rc == 0
    rc, result = fake_engine("--cases", "kill_during_save", "--kill-points", "published", "--resume")
    kill = result["cases"]["kill_during_save"]
    assert kill["verdict"] == "pass", (kill.get("not_passed_checks"), kill["details"])
    kills = kill["details"]["kills"]
    assert [(k["point"], k.get("call")) for k in kills] == [
        ("capture", "earlier"),
        ("persisting", "earlier"),
        ("published", None),
    ]
    assert kill["details"]["kill_points_by_call"] == {
        "earlier": ["capture", "persisting"],
        "last": ["published"],
    }
    assert {"kill_capture_reached", "kill_persisting_reached", "kill_published_reached"} <= set(
        kill["checks"]
    )
    assert list(kill["servers"]) == [
        "target0-published",
        "restart",
        "earlier-target0-capture",
        "earlier-target1-persisting",
    ]
    row = faults_table.table_row("kill_during_save", "sglang", result, "faults-sglang.json")
    assert "kill points: capture (earlier call), persisting (earlier call), published" in row["notes"]
    assert row["outcome"] == "pass" and row["partial_archive_loadable"] is False and rc == 0
    # The same points again replace the earlier ones: nothing is kept twice.
    rc, again = fake_engine("--cases", "kill_during_save", "--kill-points", "capture,persisting", "--resume")
    points = [(k["point"], k.get("call")) for k in again["cases"]["kill_during_save"]["details"]["kills"]]
    assert points == [("published", "earlier"), ("capture", None), ("persisting", None)]


def test_a_failed_check_of_an_earlier_call_is_not_hidden_by_a_later_pass():
    earlier = {
        "verdict": "fail",
        "checks": {
            "kill_capture_reached": True,
            "restart_served": False,
            "no_loadable_partial_after_capture": True,
        },
        "details": {"kills": [{"point": "capture", "server": "target0-capture"}]},
        "servers": {"target0-capture": {"label": "target0-capture"}, "restart": {"label": "restart"}},
    }
    rec = {
        "checks": {"kill_published_reached": True, "restart_served": True},
        "details": {"kills": [{"point": "published", "server": "target0-published"}]},
        "servers": {"target0-published": {}, "restart": {}},
    }
    faults_cases.merge_earlier_kills(rec, earlier)
    assert rec["checks"]["restart_served"] is False and faults_verdicts.verdict(rec["checks"]) == "fail"
    assert rec["checks"]["kill_capture_reached"] is True
    assert "earlier-restart" not in rec["servers"]  # only the servers of the kept kills
    skipped = {"checks": {"restart_served": True}, "details": {"kills": []}, "servers": {}}
    faults_cases.merge_earlier_kills(skipped, {"verdict": "skipped", "reason": "budget"})
    assert skipped["checks"] == {"restart_served": True}  # a skipped earlier case adds nothing


def test_kill_after_the_record_lets_the_restart_load(fake_engine):
    rc, result = fake_engine("--cases", "kill_during_save", "--kill-points", "complete")
    kill = result["cases"]["kill_during_save"]
    first = kill["details"]["kills"][0]
    assert first["reached"] and first["how"] == "record written", first
    assert first["state_after"]["complete"] and first["restart_mode"] == "load"
    assert kill["verdict"] == "pass", kill.get("not_passed_checks")  # a LOAD of a complete archive is right
    assert rc == 0


def test_a_kill_point_never_seen_is_not_a_pass(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_QUIET_CAPTURE", "1")  # no capture line: the point is never seen
    rc, result = fake_engine("--cases", "kill_during_save", "--kill-points", "capture,persisting")
    kill = result["cases"]["kill_during_save"]
    assert result["base"]["ok"]
    kills = kill["details"]["kills"]
    assert len(kills) == 1 and not kills[0]["reached"] and kills[0]["why"] == "server became ready first"
    assert list(kill["servers"]) == ["target0-capture"]  # the chain stops; that server is the one checked
    assert kill["checks"]["kill_capture_reached"] is False and kill["checks"]["restart_served"] is True
    assert kill["verdict"] == "fail" and rc == 1


def test_disk_full_and_read_only_without_mounts(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_GRAPH_BYTES", str(2 << 20))  # much bigger than any other file it writes
    rc, result = fake_engine("--cases", "disk_full,read_only_dir", "--no-mount")
    disk = result["cases"]["disk_full"]
    assert disk["details"]["limit"]["method"] == "rlimit", disk["details"]
    assert disk["verdict"] == "pass", (disk.get("not_passed_checks"), disk["details"], disk["servers"])
    assert "File too large" in disk["servers"]["auto"]["facts"]["lines"]["save_failed"]["reason"]
    assert disk["servers"]["save"]["rlimit_fsize"] == disk["details"]["limit"]["rlimit"]
    ro = result["cases"]["read_only_dir"]
    assert ro["verdict"] == "pass", (ro.get("not_passed_checks"), ro["details"])
    method = ro["details"]["dirs"]["auto"]["method"]
    assert method in ("chmod 0555", "a path under /proc (cannot be created)") or method.startswith("existing")
    assert ro["details"]["auto_mode"] == "stock"  # SGLang's auto serves without Foundry
    assert rc == 0


def _can_mount(tmp_path: Path) -> bool:
    if os.geteuid() != 0:
        return False
    probe = tmp_path / "mount-probe"
    probe.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "probe", str(probe)], capture_output=True
    )
    if done.returncode != 0:
        return False
    subprocess.run(["umount", str(probe)], check=True)
    return True


def test_disk_full_and_read_only_with_mounts(fake_engine, monkeypatch, tmp_path):
    if not _can_mount(tmp_path):
        pytest.skip("needs root and mount (tmpfs, bind)")
    monkeypatch.setenv("FAKE_GRAPH_BYTES", str(3 << 20))
    rc, result = fake_engine("--cases", "disk_full,read_only_dir", "--disk-full-size", "1m")
    disk = result["cases"]["disk_full"]
    assert disk["details"]["limit"]["method"] == "tmpfs" and disk["details"]["limit"]["size"] == str(1 << 20)
    assert disk["verdict"] == "pass", (disk.get("not_passed_checks"), disk["details"])
    assert "No space left on device" in disk["servers"]["auto"]["facts"]["lines"]["save_failed"]["reason"]
    ro = result["cases"]["read_only_dir"]
    assert ro["details"]["dirs"]["save"]["method"] == "read-only bind mount"
    assert ro["verdict"] == "pass", (ro.get("not_passed_checks"), ro["details"])
    assert ro["checks"]["auto_wrote_nothing"] is True
    mounts = Path("/proc/mounts").read_text()
    assert str(tmp_path / "work") not in mounts  # every mount undone
    assert rc == 0


def test_staged_cases_replace_damage_and_sustain(fake_engine, monkeypatch):
    rc, result = fake_engine(
        "--cases", "archive_replaced,damaged_cache,sustained_load", "--sustain", "3", "--sample-every", "0.2"
    )
    replaced = result["cases"]["archive_replaced"]
    assert replaced["verdict"] == "pass", (replaced.get("not_passed_checks"), replaced["details"])
    assert len(replaced["servers"]["load"]["requests"]) >= 3
    damaged = result["cases"]["damaged_cache"]
    assert damaged["verdict"] == "pass", (damaged.get("not_passed_checks"), damaged["details"])
    assert "fails its sha256 check" in damaged["details"]["auto_refusal_reason"]
    assert damaged["servers"]["load"]["exit_code"] == 1
    sustained = result["cases"]["sustained_load"]
    assert sustained["details"]["passes"] >= 2 and sustained["details"]["mismatches"] == 0
    assert sustained["details"]["batch_sizes"] == [1, 3, 8, 16, 32, 64]
    assert sustained["checks"]["memory_growth_under_256_mib"] is True
    assert sustained["checks"]["outputs_equal_stock"] is True
    stock = sustained["details"]["stock"]
    assert stock["passes"] == 2 and stock["vs_load"] == {
        "compared": 12,
        "mismatches": 0,
        "first_mismatch": None,
    }
    assert stock["vs_reference"]["compared"] == 12 and stock["vs_reference"]["mismatches"] == 0
    stock_server = sustained["servers"]["stock"]
    assert "--enable-foundry" not in stock_server["command"] and stock_server["exit_code"] is not None
    assert sustained["verdict"] == "pass", sustained.get("not_passed_checks")
    # Every staged start used the base's TOML path (part of vLLM's fingerprint).
    tomls = {
        s["toml"]
        for c in ("archive_replaced", "damaged_cache")
        for s in result["cases"][c]["servers"].values()
    }
    assert tomls == {result["base"]["server"]["toml"]}
    assert 'mode = "load"' in damaged["servers"]["load"]["toml_text"]
    # ... the base's archive path and cache root too (private cache folders named alike: warm LOADs),
    # each case from a fresh copy of the base archive (the damage and the new SAVE did not stay).
    staged = [
        s
        for c in ("archive_replaced", "damaged_cache", "sustained_load")
        for label, s in result["cases"][c]["servers"].items()
        if label != "stock"  # sustained_load's stock server has no archive
    ]
    assert {s["archive_dir"] for s in staged} == {result["base"]["server"]["archive_dir"]}
    sustained_load = result["cases"]["sustained_load"]["servers"]["load"]
    assert (
        sustained_load["mode_logged"] == "load"
        and sustained_load["report"]["caches"]["new_files"]["total"] == 0
    )
    assert rc == 0


def test_sustained_load_fails_where_stock_answers_otherwise(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_STOCK_DIFFERS", "1")
    rc, result = fake_engine("--cases", "sustained_load", "--sustain", "0.5", "--sample-every", "0.2")
    sustained = result["cases"]["sustained_load"]
    assert sustained["details"]["mismatches"] == 0  # the LOAD still equals the base SAVE
    assert sustained["checks"]["outputs_equal_stock"] is False
    assert sustained["details"]["stock"]["vs_load"]["mismatches"] == 12
    assert sustained["details"]["stock"]["vs_load"]["first_mismatch"]["pass"] == 0
    assert sustained["verdict"] == "fail" and rc == 1


def test_sustained_load_runs_two_passes_however_short(fake_engine):
    # Stock's two passes are compared with the LOAD's first two: a --sustain shorter than one pass
    # (a slow host) must still give two, or that comparison covers half the schedule's answers.
    rc, result = fake_engine("--cases", "sustained_load", "--sustain", "0", "--sample-every", "0")
    case = result["cases"]["sustained_load"]
    details = case["details"]
    servers = {
        n: {k: s.get(k) for k in ("port", "exit_code", "log_tail")} for n, s in case["servers"].items()
    }
    assert details["passes"] == 2 and details["stock"]["vs_load"]["compared"] == 12, servers
    # Which comparison differed, and how (an answer that errored counts as differing): this test
    # failed now and then in whole-suite runs on a loaded 2-core host and passed alone.
    why = {k: details.get(k) for k in ("mismatches", "first_mismatch", "errors", "stock", "reference")}
    assert case["verdict"] == "pass" and rc == 0, (case.get("not_passed_checks"), why, servers)


def test_sustained_load_on_a_base_without_its_reference_is_judged_against_stock(
    fake_engine, monkeypatch, capsys
):
    monkeypatch.setitem(
        faults_runner.CASE_FUNCS, "read_only_dir", lambda ctx, run: run.rec["checks"].update(ran=True)
    )
    rc, result = fake_engine("--cases", "read_only_dir")  # this base keeps no answers to the schedule
    assert "sustained_reference" not in result["base"] and rc == 0
    capsys.readouterr()
    rc, result = fake_engine(
        "--cases", "sustained_load", "--sustain", "0.5", "--sample-every", "0.2", "--resume"
    )
    assert "the stock server's answers are the reference" in capsys.readouterr().out
    sustained = result["cases"]["sustained_load"]
    details = sustained["details"]
    assert result["base"]["reused"] is True and details["reference"] == "stock server"
    assert details["passes"] >= 2 and details["mismatches"] == 0 and details["first_mismatch"] is None
    assert (
        details["stock"]["vs_load"]["mismatches"] == 0 and details["stock"]["vs_reference"]["compared"] == 0
    )
    assert sustained["checks"]["outputs_equal_reference"] is True
    assert sustained["checks"]["outputs_equal_stock"] is True
    assert sustained["verdict"] == "pass" and rc == 0, sustained.get("not_passed_checks")
    # Stock answering otherwise: every answer of every LOAD pass is a mismatch.
    monkeypatch.setenv("FAKE_STOCK_DIFFERS", "1")
    rc, result = fake_engine(
        "--cases", "sustained_load", "--sustain", "0.5", "--sample-every", "0.2", "--resume"
    )
    sustained = result["cases"]["sustained_load"]
    details = sustained["details"]
    assert details["mismatches"] == details["requests"] == 6 * details["passes"]
    first = details["first_mismatch"]
    assert first["pass"] == 0 and first["request"] == 0 and first["tokens"] is False
    assert sustained["checks"]["outputs_equal_reference"] is False
    assert sustained["checks"]["outputs_equal_stock"] is False
    assert sustained["verdict"] == "fail" and rc == 1


def test_stock_env_is_what_the_plugins_pin():
    from foundry_core.engine.inductor import PINNED

    assert faults_server.STOCK_ENV == {env: "1" if value else "0" for value, env, _why in PINNED.values()}


def test_vllm_reports_by_engine_pid_and_a_wrong_output_fails(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_STYLE", "vllm")
    monkeypatch.setenv("FAKE_PERSIST_S", "1.0")
    real_check = faults_server.Server.check

    def check(self, reference, what="request"):  # one replica answers something else
        if self.label == "replica-b":
            reference = {**reference, "tokens": [[0]]}
        return real_check(self, reference, what)

    monkeypatch.setattr(faults_server.Server, "check", check)
    rc, result = fake_engine("--cases", "two_replicas", engine="vllm")
    replicas = result["cases"]["two_replicas"]
    servers = replicas["servers"]
    for label in ("replica-a", "replica-b"):
        assert servers[label]["report"]["pid"] in servers[label]["facts"]["engine_pids"]
    assert sorted(replicas["details"]["published"].values()) == [False, True]
    assert replicas["checks"]["both_outputs_equal_reference"] is False and replicas["verdict"] == "fail"
    assert rc == 1 and result["all_passed"] is False


def test_budget_too_small_skips_with_reasons_and_writes_the_result(fake_engine):
    rc, result = fake_engine("--cases", "disk_full,two_replicas", "--budget", "5")
    assert rc == 1 and result["base"]["ok"] is False and "budget" in result["base"]["skipped"]
    assert result["verdicts"] == {"disk_full": "skipped", "two_replicas": "skipped"}
    assert all("base SAVE" in c["reason"] for c in result["cases"].values())


def test_each_case_is_written_as_it_ends_and_resume_keeps_them(fake_engine, monkeypatch, tmp_path):
    seen = []

    def first(ctx, run):
        run.rec["checks"]["ran"] = True

    def second(ctx, run):
        seen.append(json.loads((tmp_path / "out" / "faults-sglang.json").read_text())["verdicts"])
        run.rec["checks"]["ran"] = False

    monkeypatch.setitem(faults_runner.CASE_FUNCS, "disk_full", first)
    monkeypatch.setitem(faults_runner.CASE_FUNCS, "two_replicas", second)
    rc, result = fake_engine("--cases", "disk_full,two_replicas")
    assert seen == [{"disk_full": "pass", "two_replicas": None}]
    assert result["verdicts"] == {"disk_full": "pass", "two_replicas": "fail"} and rc == 1
    base_date = result["base"]["server"]["spawn_offset_s"]
    # A later call (a new device call on the same machine) adds a case; the base is not saved again.
    monkeypatch.setitem(faults_runner.CASE_FUNCS, "read_only_dir", first)
    rc, result = fake_engine("--cases", "read_only_dir", "--resume")
    assert result["base"]["reused"] is True and result["base"]["server"]["spawn_offset_s"] == base_date
    assert result["verdicts"] == {"disk_full": "pass", "read_only_dir": "pass", "two_replicas": "fail"}
    assert result["cases_requested"] == ["disk_full", "read_only_dir", "two_replicas"] and rc == 1


def test_parallel_cases_and_a_case_that_raises(fake_engine, monkeypatch):
    def boom(ctx, run):
        raise RuntimeError("boom")

    monkeypatch.setitem(faults_runner.CASE_FUNCS, "disk_full", boom)
    monkeypatch.setenv("FAKE_PERSIST_S", "1.0")  # the replicas' writes overlap: one finds the lock held
    rc, result = fake_engine("--cases", "disk_full,two_replicas,damaged_cache", "--parallel", "3")
    assert (
        result["cases"]["disk_full"]["verdict"] == "error" and "boom" in result["cases"]["disk_full"]["error"]
    )
    assert result["verdicts"]["two_replicas"] == "pass" and result["verdicts"]["damaged_cache"] == "pass"
    assert rc == 1


def test_two_replicas_publishing_one_after_the_other_is_reported(fake_engine, monkeypatch):
    # Both SAVE, but their writes do not overlap: the lock never refuses, both publish, the last
    # one's archive stays.
    monkeypatch.setenv("FAKE_STAGGER", "/cases/two_replicas/")
    rc, result = fake_engine("--cases", "two_replicas")
    replicas = result["cases"]["two_replicas"]
    assert replicas["details"]["published"] == {"replica-a": True, "replica-b": True}
    assert {s["mode_logged"] for s in replicas["servers"].values()} == {"save"}
    assert replicas["checks"]["exactly_one_published"] is False
    assert replicas["checks"]["archive_consistent"] is True and replicas["checks"]["both_ready"] is True
    assert replicas["verdict"] == "fail" and rc == 1


def test_a_refusal_that_does_not_end_is_stopped_and_fails(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_HANG_AFTER_REFUSAL", "1")
    monkeypatch.setattr(faults_server, "REFUSAL_GRACE_S", 1.0)
    t0 = time.monotonic()
    rc, result = fake_engine("--cases", "read_only_dir", "--no-mount")
    ro = result["cases"]["read_only_dir"]
    assert ro["details"]["save_outcome"] == "timeout" and time.monotonic() - t0 < 30
    assert ro["checks"]["save_line"] is True and ro["checks"]["save_never_ready"] is True
    assert ro["checks"]["save_exited_nonzero"] is False and ro["verdict"] == "fail" and rc == 1


def test_sigterm_ends_the_servers_and_writes_the_result(fake_engine, monkeypatch):
    import signal
    import threading

    started = []

    def hang(ctx, run):  # a save-mode start that says why it refuses and then does not end
        srv = run.server(
            "stuck", mode="save", archive_dir=Path("/proc/foundry-faults-archive"), toml=run.dir / "save.toml"
        )
        srv.start()
        started.append(srv)
        srv.wait_ready(time.monotonic() + 120)

    monkeypatch.setitem(faults_runner.CASE_FUNCS, "disk_full", hang)
    monkeypatch.setenv("FAKE_HANG_AFTER_REFUSAL", "1")
    previous = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        t0 = time.monotonic()
        rc, result = fake_engine("--cases", "disk_full")
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert rc == 1 and time.monotonic() - t0 < 60
    assert "SystemExit: 143" in result["error"] and result["cases"]["disk_full"]["verdict"] == "error"
    (srv,) = started
    assert srv.proc.poll() is not None and srv.rec["exit_code"] is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.proc.pid, 0)  # nothing of its process group is left
