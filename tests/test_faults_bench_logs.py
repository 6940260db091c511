"""benchmarks/engine_faults.py without an engine or a GPU: what it reads in a server's output (faults_log)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import faults_log  # noqa: E402

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
