"""benchmarks/engine_faults.py without an engine or a GPU: archive directories as it sees them
(faults_archive), on real archives written with foundry_core.archive."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from foundry_core.archive import ArchiveWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import faults_archive  # noqa: E402
import faults_cases  # noqa: E402


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
