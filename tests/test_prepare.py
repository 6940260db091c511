"""The rebuild ahead of a LOAD (foundry_core.prepare, foundry_core/restore.py) and the engine layer's use of it, on
the CPU: who owns what the thread made, what happens when it fails, and that a refused archive
never leaves it loaded. The rebuild itself (modules, graphs) runs on the GPU: tests/gpu."""

from __future__ import annotations

import logging
import threading

import pytest

import foundry_core as fc
from foundry_core import rebuilding, restore
from foundry_core import restored as restored_module
from foundry_core.archive import Archive, ArchiveError
from foundry_core.config import config_from_dict
from foundry_core.engine import prepare as engine_prepare
from foundry_core.trust import ArchiveLocationError


class FakeRebuilding:
    def __init__(self):
        self.discarded = 0
        self.timings = {"modules_s": 0.01}
        self.graphs = {}

    def discard(self):
        self.discarded += 1


def _archive(path) -> Archive:
    manifest = {"meta": {"kind": "foundry-graphs"}, "fingerprint": {}, "format_version": 2}
    return Archive(path, manifest, "ab" * 32, {})


@pytest.fixture
def no_device(monkeypatch):
    monkeypatch.setattr(restore, "_context_for", lambda device: None)
    monkeypatch.setattr(restore, "_bind_context", lambda ctx: None)


def test_the_caller_gets_what_the_thread_rebuilt(tmp_path, monkeypatch, no_device):
    made = FakeRebuilding()
    gate = threading.Event()
    seen = []

    def rebuild(archive, **kw):
        seen.append((archive, kw))
        gate.wait(5)
        return made

    monkeypatch.setattr(restore, "rebuild_archive", rebuild)
    archive = _archive(tmp_path)
    prepared = fc.prepare(tmp_path, device=0, archive=archive)
    assert not prepared.done  # the rebuild runs behind the caller's back
    gate.set()
    got_archive, rebuilding, error = prepared.take()
    assert prepared.done and prepared.seconds is not None
    assert got_archive is archive and rebuilding is made and error is None
    # No progress bar from a background thread; ahead of the memory (graphs may be deferred).
    assert [(a, kw["progress"], kw["ahead"]) for a, kw in seen] == [(archive, False, True)]
    with pytest.raises(RuntimeError, match="already taken"):
        prepared.take()
    prepared.discard()  # the caller owns it now: nothing is unloaded behind its back
    assert made.discarded == 0


def test_a_failed_rebuild_is_handed_back_as_an_error_not_raised(tmp_path, monkeypatch, no_device):
    def rebuild(archive, **kw):
        raise fc.GraphError("cuGraphAddMemsetNode: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(restore, "rebuild_archive", rebuild)
    archive, rebuilding, error = fc.prepare(tmp_path, archive=_archive(tmp_path)).take()
    assert rebuilding is None and isinstance(error, fc.GraphError)  # load() rebuilds synchronously


def test_without_an_archive_the_thread_verifies_it_and_a_refusal_is_left_to_load(
    tmp_path, monkeypatch, no_device
):
    import foundry_core.api as api

    calls = []

    def verify(path, **kw):
        calls.append((path, kw))
        raise fc.FingerprintMismatch(
            "archive was saved on an H100, this is an H200", "gpu_name", "H100", "H200"
        )

    monkeypatch.setattr(api, "verify", verify)
    monkeypatch.setattr(restore, "rebuild_archive", lambda *a, **k: pytest.fail("rebuilt a refused archive"))
    prepared = fc.prepare(tmp_path / "a", device=3, expected_digest="cd" * 32, rank=1, world_size=2)
    archive, rebuilding, error = prepared.take()
    # Nothing rebuilt; load() reads and verifies the archive itself, with its own arguments.
    assert archive is None and rebuilding is None and isinstance(error, fc.FingerprintMismatch)
    assert calls == [
        (
            str(tmp_path / "a"),
            {
                "device": 3,
                "fingerprint_model": None,
                "rank": 1,
                "world_size": 2,
                "expected_digest": "cd" * 32,
                "trusted_root": None,
            },
        )
    ]


def test_load_verifies_an_archive_the_thread_could_not_and_raises_its_own_refusal(
    tmp_path, monkeypatch, no_device
):
    import warnings

    import foundry_core.api as api

    def thread_verify(path, **kw):
        raise fc.FingerprintMismatch("rank: saved 0, now 1", "rank", 0, 1)

    opened = []

    def open_archive(path, **kw):
        opened.append(kw)
        raise ArchiveError(f"archive {path}: modules/ab.cubin: checksum mismatch")

    monkeypatch.setattr(api, "verify", thread_verify)
    monkeypatch.setattr(api, "open_archive", open_archive)
    monkeypatch.setattr(api, "current_fingerprint", lambda *a, **k: {"rank": 1})

    class Region:
        device = 0

    prepared = fc.prepare(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "background rebuild failed" warning for this case
        with pytest.raises(ArchiveError, match="checksum mismatch"):
            fc.load(tmp_path, region=Region(), rank=1, world_size=2, prepared=prepared)
    assert opened == [{"expected_fingerprint": {"rank": 1}, "expected_digest": None}]


def test_discard_unloads_what_the_thread_made(tmp_path, monkeypatch, no_device):
    made = FakeRebuilding()
    monkeypatch.setattr(restore, "rebuild_archive", lambda *a, **k: made)
    prepared = fc.prepare(tmp_path, archive=_archive(tmp_path))
    prepared.discard()
    assert made.discarded == 1
    with pytest.raises(RuntimeError, match="already taken or discarded"):
        prepared.take()


def test_an_archive_outside_the_trusted_root_starts_no_thread(tmp_path, monkeypatch):
    import foundry_core.api as api

    monkeypatch.setattr(api, "Prepared", lambda *a, **k: pytest.fail("a thread was started"))
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ArchiveLocationError):
        fc.prepare(tmp_path / "elsewhere", trusted_root=tmp_path / "root")
    with pytest.raises(ArchiveError, match="takes what verify"):
        fc.prepare(tmp_path / "root", archive={"not": "an archive"})


def test_load_refuses_a_prepared_rebuild_of_another_archive_and_unloads_it(tmp_path, monkeypatch, no_device):
    made = FakeRebuilding()
    monkeypatch.setattr(restore, "rebuild_archive", lambda *a, **k: made)
    prepared = fc.prepare(tmp_path / "one", archive=_archive(tmp_path / "one"))
    with pytest.raises(ArchiveError, match="prepared= was started for"):
        fc.load(tmp_path / "two", region=None, prepared=prepared)
    assert made.discarded == 1


def test_load_unloads_the_prepared_rebuild_when_the_archive_is_refused(tmp_path, monkeypatch, no_device):
    """The model fingerprint is compared in load(), after the thread rebuilt: a refusal there must
    not leave the thread's modules and graphs loaded."""
    import foundry_core.api as api

    made = FakeRebuilding()
    monkeypatch.setattr(restore, "rebuild_archive", lambda *a, **k: made)
    monkeypatch.setattr(api, "current_fingerprint", lambda *a, **k: {"model": {"layers": 2}})

    def refuse(archive, path, expected, digest):
        raise fc.FingerprintMismatch("model.layers: saved 4, now 2", "model.layers", 4, 2)

    monkeypatch.setattr(api, "_check_verified", refuse)

    class Region:
        device = 0

    prepared = fc.prepare(tmp_path, archive=_archive(tmp_path))
    with pytest.raises(fc.FingerprintMismatch, match="model.layers"):
        fc.load(tmp_path, region=Region(), prepared=prepared)
    assert made.discarded == 1


# --- the engine layer ---------------------------------------------------------------------------


def _cfg(tmp_path):
    return config_from_dict({"mode": "load", "archive_dir": str(tmp_path / "archive")})


def test_the_engine_layer_passes_the_rank_pin_and_the_archive_root(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(fc, "prepare", lambda path, **kw: seen.update(path=path, **kw) or "prepared")
    archive = _archive(tmp_path)
    got = engine_prepare.start(
        "/a/rank0", cfg=_cfg(tmp_path), rank=0, device=1, archive=archive, log=logging.getLogger("t")
    )
    assert got == "prepared"
    assert seen == {
        "path": "/a/rank0",
        "device": 1,
        "archive": archive,
        "expected_digest": None,
        "trusted_root": _cfg(tmp_path).archive_dir,
    }
    # Something other than a verified archive (a test double) is not passed on: the thread verifies.
    engine_prepare.start(
        "/a/rank0", cfg=_cfg(tmp_path), rank=0, device=1, archive=object(), log=logging.getLogger("t")
    )
    assert seen["archive"] is None


def test_the_engine_layer_can_be_switched_off_and_never_fails_a_start(tmp_path, monkeypatch, caplog):
    log = logging.getLogger("foundry.test")
    monkeypatch.setenv("FOUNDRY_PREPARE", "0")
    monkeypatch.setattr(fc, "prepare", lambda *a, **k: pytest.fail("prepared although switched off"))
    assert engine_prepare.start("/a", cfg=_cfg(tmp_path), rank=0, device=0, archive=None, log=log) is None
    monkeypatch.delenv("FOUNDRY_PREPARE")

    def broken(*a, **k):
        raise ArchiveLocationError("archive /a resolves outside /archive")

    monkeypatch.setattr(fc, "prepare", broken)
    with caplog.at_level(logging.WARNING, logger="foundry.test"):
        assert engine_prepare.start("/a", cfg=_cfg(tmp_path), rank=2, device=0, archive=None, log=log) is None
    assert "Foundry rank 2: graphs are rebuilt at the graph phase (archive /a resolves outside" in caplog.text


def test_the_engine_layer_checks_the_restored_graphs_when_configured(tmp_path, monkeypatch):
    """[load] check_structure: every restored graph is compared with the archive after LOAD; a
    difference fails the start with the graph's name and unloads what was restored. Off by default."""

    class Restored:
        def __init__(self, differences):
            self.differences, self.timings, self.unloaded = differences, {}, False
            self.archive = type(
                "A", (), {"meta": {"graphs": [{"name": "decode/bs=1"}, {"name": "decode/bs=8"}]}}
            )

        def check(self):
            return self.differences

        def unload(self):
            self.unloaded = True

    made = []

    def fake_load(path, **kw):
        made.append(Restored(dict(pending)))
        return made[-1]

    monkeypatch.setattr(fc, "load", fake_load)
    args = dict(rank=0, world_size=1, region=None, fingerprint={}, archive=None, prepared=None)
    pending = {"decode/bs=8": "node 3 (gemm): grid [4, 1, 1] saved, [8, 1, 1] built"}
    assert engine_prepare.load("/a/rank0", cfg=_cfg(tmp_path), **args) is made[-1]  # not checked
    checking = config_from_dict(
        {"mode": "load", "archive_dir": str(tmp_path / "archive"), "load": {"check_structure": True}}
    )
    with pytest.raises(fc.GraphError, match=r"1 of 2 restored graphs differ .* decode/bs=8: node 3 \(gemm\)"):
        engine_prepare.load("/a/rank0", cfg=checking, **args)
    assert made[-1].unloaded
    pending = {}
    restored = engine_prepare.load("/a/rank0", cfg=checking, **args)
    assert not restored.unloaded and restored.timings["structure_differences"] == 0.0
    assert engine_prepare.report(restored.timings) == {
        "prepared": False,
        "structure_check_s": round(restored.timings["structure_check_s"], 4),
    }


def test_the_start_report_says_whether_the_rebuild_was_ready():
    assert engine_prepare.report({"modules_s": 0.1}) == {"prepared": False}
    assert engine_prepare.report(
        {"prepared_s": 0.31234, "prepare_wait_s": 0.0001, "prepared_ready": 1.0, "prepared_ok": 1.0}
    ) == {
        "prepared": True,
        "prepared_ok": True,
        "prepared_ready": True,
        "prepare_wait_s": 0.0001,
        "prepared_s": 0.3123,
        "graphs_retargeted": 0,
        "graphs_deferred": 0,
        "graphs_after_return": 0,
    }
    # handed over while graphs were still being built: the thread's time is not known yet
    running = engine_prepare.report({"tail_graphs": 3.0, "prepared_ready": 0.0, "prepared_ok": 1.0})
    assert running["prepared"] and running["prepared_s"] is None and running["graphs_after_return"] == 3


# --- graphs the driver will not build before their memory is mapped -------------------------------


class _Archive:
    """What the rebuild reads of an archive: meta, and JSON graph descriptions."""

    def __init__(self, names):
        self.names = names
        self.meta = {
            "images": [],
            "kernels": [],
            "graphs": [{"name": n, "file": f"graphs/{i:04d}.json", "nodes": 1} for i, n in enumerate(names)],
        }

    def read_json(self, rel):
        name = self.names[int(rel.removeprefix("graphs/").removesuffix(".json"))]
        return {"name": name, "rng": None, "nodes": [], "edges": []}


class _Built:
    def __init__(self, name):
        self.name, self.destroyed = name, False

    def destroy(self):
        self.destroyed = True


def test_ahead_of_the_memory_a_refused_graph_is_deferred_and_built_once_the_memory_is_there(monkeypatch):
    """A copy node between addresses not mapped yet can make the driver refuse a graph ahead of the
    memory; that graph waits for finish_rebuild, the others are built ahead, and nothing fails."""
    mapped = {"now": False}
    built = []

    def fake_rebuild(desc, modules, kernel_attrs, stream, split):
        if desc["name"] == "decode/bs=8" and not mapped["now"]:
            raise fc.CudaError("cuGraphAddMemcpyNode", 1)
        built.append(desc["name"])
        return _Built(desc["name"])

    monkeypatch.setattr(rebuilding, "builder_choice", lambda: "python")
    monkeypatch.setattr(rebuilding, "rebuild", fake_rebuild)
    archive = _Archive(["decode/bs=1", "decode/bs=8", "decode/bs=16"])
    ahead = rebuilding.rebuild_archive(archive, progress=False, ahead=True)
    assert list(ahead.graphs) == ["decode/bs=1", "decode/bs=16"]
    assert list(ahead.deferred) == ["decode/bs=8"] and isinstance(ahead.deferred["decode/bs=8"], fc.CudaError)
    mapped["now"] = True
    timings = rebuilding.finish_rebuild(archive, ahead, progress=False)
    assert list(ahead.graphs) == ["decode/bs=1", "decode/bs=8", "decode/bs=16"] and not ahead.deferred
    assert timings["deferred_graphs"] == 1.0 and built == ["decode/bs=1", "decode/bs=16", "decode/bs=8"]
    assert "deferred_graphs" not in rebuilding.finish_rebuild(archive, ahead, progress=False)  # nothing left

    # Not ahead of the memory, a refusal is the error it always was, and nothing stays built.
    mapped["now"] = False
    built.clear()
    with pytest.raises(fc.CudaError, match="cuGraphAddMemcpyNode"):
        rebuilding.rebuild_archive(archive, progress=False)


# --- a LOAD that does not wait for the whole rebuild ------------------------------------------------


def _gated_rebuild(monkeypatch, gates, built, fail=None):
    """The Python builder, replaced: a graph named in ``gates`` waits for its event; ``fail`` maps a
    name to the exception its first build raises."""
    fail = dict(fail or {})

    def fake_rebuild(desc, modules, kernel_attrs, stream, split):
        name = desc["name"]
        if name in gates:
            assert gates[name].wait(5)
        if name in fail:
            raise fail.pop(name)
        built.append(name)
        return _Built(name)

    monkeypatch.setattr(rebuilding, "builder_choice", lambda: "python")
    monkeypatch.setattr(rebuilding, "rebuild", fake_rebuild)


def _wait_for(cond):
    for _ in range(500):
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError("timed out")


NAMES = ["decode/bs=1", "decode/bs=8", "decode/bs=16"]


def test_a_load_takes_the_graphs_built_and_waits_at_replay_only_for_the_others(monkeypatch, no_device):
    gate, built = threading.Event(), []
    _gated_rebuild(monkeypatch, {"decode/bs=8": gate}, built)
    archive = _Archive(NAMES)
    prepared = restore.Prepared("/archive", 0, archive, {})
    assert prepared.building() is archive  # modules loaded, graphs still being built
    _wait_for(lambda: built == ["decode/bs=1"])
    timings: dict[str, float] = {}
    tail = prepared.hand_over(NAMES, timings)
    assert tail is not None and tail.rebuilding.handed
    assert tail.pending["decode/bs=1"].done and tail.pending["decode/bs=1"].rebuilt.name == "decode/bs=1"
    assert not tail.pending["decode/bs=8"].done and not tail.pending["decode/bs=16"].done
    gate.set()
    assert tail.pending["decode/bs=16"].take().name == "decode/bs=16"  # waits for that graph
    prepared.wait()
    assert built == NAMES and not tail.rebuilding.graphs  # every graph handed over, none left to discard
    assert timings["tail_s"] > 0 and timings["prepared_s"] == prepared.seconds
    prepared.discard()  # nothing of what was handed over is destroyed
    assert not any(p.rebuilt.destroyed for p in tail.pending.values())
    with pytest.raises(RuntimeError, match="already taken"):
        prepared.take()


def test_a_graph_the_driver_will_not_upload_is_handed_over_all_the_same(monkeypatch, no_device, caplog):
    """load(upload=True) with a hand-over: an upload is optional (the first launch uploads), so a
    refused one is a warning and the graph is published, not lost with the thread."""

    def refuse(self, stream):
        raise fc.CudaError("cuGraphUpload", 2)

    monkeypatch.setattr(_Built, "upload", refuse, raising=False)
    gate, built = threading.Event(), []
    _gated_rebuild(monkeypatch, {"decode/bs=8": gate}, built)
    prepared = restore.Prepared("/archive", 0, _Archive(NAMES), {})
    prepared.building()
    _wait_for(lambda: built == ["decode/bs=1"])
    timings: dict[str, float] = {"prepared_ok": 1.0}
    with caplog.at_level(logging.WARNING, logger="foundry.restore"):
        tail = prepared.hand_over(NAMES, timings, upload_to=7)
        gate.set()
        prepared.wait()
    assert all(p.done and p.rebuilt is not None for p in tail.pending.values())
    assert timings["prepared_ok"] == 1.0 and "not uploaded ahead of its first replay" in caplog.text


def test_a_rebuild_that_ended_before_the_hand_over_is_taken_whole(monkeypatch, no_device):
    built: list[str] = []
    _gated_rebuild(monkeypatch, {}, built)
    prepared = restore.Prepared("/archive", 0, _Archive(NAMES), {})
    prepared.wait()
    assert prepared.building() is None and prepared.hand_over(NAMES, {}) is None
    _archive_, rebuilding, error = prepared.take()
    assert error is None and list(rebuilding.graphs) == NAMES


def test_after_the_hand_over_a_refused_graph_is_built_once_the_memory_is_mapped(monkeypatch, no_device):
    gate, built = threading.Event(), []
    refused = fc.CudaError("cuGraphAddMemcpyNode", 1)
    _gated_rebuild(monkeypatch, {"decode/bs=16": gate}, built, fail={"decode/bs=8": refused})
    prepared = restore.Prepared("/archive", 0, _Archive(NAMES), {})
    prepared.building()
    _wait_for(lambda: built == ["decode/bs=1"])
    timings: dict[str, float] = {}
    tail = prepared.hand_over(NAMES, timings)
    gate.set()
    prepared.wait()
    assert built == ["decode/bs=1", "decode/bs=16", "decode/bs=8"]  # the refused one last, after the mapping
    assert all(p.done and p.error is None for p in tail.pending.values())
    assert timings["deferred_graphs"] == 1.0


def test_a_thread_that_fails_after_the_hand_over_keeps_what_it_handed_over(monkeypatch, no_device):
    gate, built, unloaded = threading.Event(), [], []
    monkeypatch.setattr(rebuilding.LoadedModules, "unload", lambda self: unloaded.append(self))
    _gated_rebuild(monkeypatch, {"decode/bs=8": gate}, built, fail={"decode/bs=8": RuntimeError("lost")})
    prepared = restore.Prepared("/archive", 0, _Archive(NAMES), {})
    prepared.building()
    _wait_for(lambda: built == ["decode/bs=1"])
    timings = {"prepared_ok": 1.0}
    tail = prepared.hand_over(NAMES, timings)
    gate.set()
    prepared.wait()
    assert timings["prepared_ok"] == 0.0  # the start report says the background rebuild failed
    first = tail.pending["decode/bs=1"]
    assert first.rebuilt is not None and not first.rebuilt.destroyed  # handed over before the failure
    failed = tail.pending["decode/bs=8"]
    assert failed.done and isinstance(failed.error, RuntimeError)
    assert failed.take().name == "decode/bs=8"  # built at its first replay instead, memory mapped
    assert not unloaded  # the modules are the LOAD's: not unloaded with the failed rebuild


@pytest.mark.parametrize("upload", [False, True])
def test_load_returns_before_the_thread_ends_and_each_replay_waits_for_its_own_graph(
    tmp_path, monkeypatch, no_device, upload
):
    """fc.load itself, with a rebuild still building graphs when the memory is mapped: it returns
    with the graphs built so far (and the builder that built them), the first replay of another
    waits for it, timings are completed by the thread, with ``upload=True`` each graph is uploaded
    to the LOAD's stream as it is handed over, and unload waits for the thread before tearing down."""
    import types

    import foundry_core.api as api

    gate, built, launched, uploaded = threading.Event(), [], [], []

    class Built:
        def __init__(self, name):
            self.name, self.destroyed = name, False

        def launch(self, stream):
            launched.append(self.name)

        def launcher(self, current_stream, device):
            return lambda: self.launch(current_stream(device))

        def upload(self, stream):
            uploaded.append((self.name, stream))

        def destroy(self):
            self.destroyed = True

    def fake_rebuild(desc, modules, kernel_attrs, stream, split):
        if desc["name"] == "decode/bs=8":
            assert gate.wait(5)
        built.append(desc["name"])
        return Built(desc["name"])

    monkeypatch.setattr(rebuilding, "builder_choice", lambda: "python")
    monkeypatch.setattr(rebuilding, "rebuild", fake_rebuild)
    monkeypatch.setattr(rebuilding, "decode", lambda data, kernels: {"name": data.decode(), "rng": None})
    monkeypatch.setattr(api, "current_fingerprint", lambda *a, **k: {})
    monkeypatch.setattr(api, "_check_verified", lambda *a: None)
    monkeypatch.setattr(api, "_require_graph_archive", lambda *a: None)
    monkeypatch.setattr(restored_module, "_current_stream_getter", lambda: lambda device: 7)
    cuda = types.SimpleNamespace(
        synchronize=lambda *a: None, current_stream=lambda d: types.SimpleNamespace(cuda_stream=7)
    )
    for module in (api, restored_module):  # load's synchronize, unload's
        monkeypatch.setattr(module, "_torch", lambda: types.SimpleNamespace(cuda=cuda))

    class Archive_:
        path = str(tmp_path)
        meta = {
            "images": [],
            "kernels": [],
            "graphs": [
                {"name": n, "file": f"graphs/{n}", "nodes": 1, "encoding": rebuilding.ENCODING} for n in NAMES
            ],
            "device": 0,
            "layout": {"segments": []},
            "snapshots": [],
            "tensors": {},
            "slots": {"pool": 1},
        }

        def read_bytes(self, rel):
            return rel.removeprefix("graphs/").encode()

    class Region:
        device, unmapped = 0, []

        def restore_layout(self, layout):
            return ["segment"]

        def unmap(self, mapped):
            self.unmapped.append(mapped)

    prepared = restore.Prepared(tmp_path, 0, Archive_(), {})
    _wait_for(lambda: built == ["decode/bs=1"])
    restored = fc.load(tmp_path, region=Region(), prepared=prepared, upload=upload)
    assert list(restored.graphs) == NAMES and restored.slots == {"pool": 1}
    assert restored.timings["tail_graphs"] == 2.0 and restored.timings["prepared_ready"] == 0.0
    assert restored.graphs["decode/bs=1"]._rebuilt is not None  # built before: handed over at once
    assert restored.builder == "python"  # reported while the thread still builds
    assert uploaded == ([("decode/bs=1", 7)] if upload else [])
    gate.set()
    restored.graphs["decode/bs=16"].replay()  # waits for that graph, then launches it
    assert launched == ["decode/bs=16"]
    restored.wait_rebuilt()
    assert "tail_s" in restored.timings and restored.timings["prepared_s"] == prepared.seconds
    assert uploaded == ([(name, 7) for name in NAMES] if upload else [])
    assert (restored.timings["background_graph_upload_s"] > 0) == upload
    graphs = [g._rebuilt or g._pending.rebuilt for g in restored.graphs.values()]
    restored.unload()
    assert Region.unmapped == [["segment"]] and all(b.destroyed for b in graphs)
