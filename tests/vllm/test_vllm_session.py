"""The worker's archive bookkeeping around foundry_core.save/load (no GPU: the core calls are recorded).

Only ``foundry_core.save`` / ``foundry_core.load`` are replaced, by recorders; the session, manifest and
settings code under test is the real one, fed with a real VllmConfig.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import types
from pathlib import Path

import pytest

import foundry_core
from foundry_vllm_plugin import archive, workspace
from foundry_vllm_plugin.graphs import FoundryRestoreError
from foundry_vllm_plugin.session import FoundrySession, route_runner_build

pytestmark = pytest.mark.vllm


class Adapter:
    kind = "v2"

    def __init__(self):
        self.installed = None

    def collect(self):
        return {"decode/g1": "G1", "decode/g2": "G2"}, {"hidden_states": "T"}, [{"name": "decode/g1"}]

    def install(self, restored, listing):
        self.installed = (restored, listing)
        return len(restored.graphs)


def _session(base_vllm_config, mode):
    s = FoundrySession(base_vllm_config)
    s.region, s.mode, s.fingerprint = object(), mode, {"config_hash": "abc"}
    s.kv_cache_memory_bytes, s.num_gpu_blocks = 1 << 30, 4096
    return s


def test_save_writes_the_manifest_only_after_the_core_archive(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "save")
    mpath = archive.manifest_path(s.cfg, 0)
    archive.write_manifest(mpath, {"old": 1}, {}, [])  # a stale manifest from an earlier SAVE
    calls = []

    def fake_save(path, **kw):
        calls.append((path, kw, mpath.exists()))
        return "digest"

    monkeypatch.setattr(foundry_core, "save", fake_save)
    s.save(Adapter())
    # The manifest marks the SAVE finished: it waits for vLLM's warmups and the carried caches.
    assert not mpath.exists()
    s.publish(0)
    ((path, kw, manifest_existed_during_save),) = calls
    assert path == archive.core_archive_dir(s.cfg, 0)
    assert manifest_existed_during_save is False  # removed before the core writes
    assert kw["graphs"] == {"decode/g1": "G1", "decode/g2": "G2"} and kw["tensors"] == {"hidden_states": "T"}
    assert kw["region"] is s.region and kw["fingerprint_model"] == {"config_hash": "abc"}
    assert kw["slots"] == {
        "kv_cache_memory_bytes": 1 << 30,
        "num_gpu_blocks": 4096,
        "kv_layout": None,
        "runner": "v2",
        "setup": None,
        "workspace_locked": None,
        "workspace": None,
    }
    assert (kw["rank"], kw["world_size"]) == (0, 1)
    manifest = archive.read_manifest(mpath)
    assert manifest["fingerprint"] == {"config_hash": "abc"} and manifest["sizing"] == kw["slots"]


def test_failed_core_save_leaves_no_manifest(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "save")
    mpath = archive.manifest_path(s.cfg, 0)
    archive.write_manifest(mpath, {"old": 1}, {}, [])

    def failing_save(path, **kw):
        raise foundry_core.SaveError("graph 'x': pointer outside the region")

    monkeypatch.setattr(foundry_core, "save", failing_save)
    # mode = save: the failure stands.
    s.cfg = dataclasses.replace(s.cfg, mode="save")
    with pytest.raises(foundry_core.SaveError):
        s.save(Adapter())
    assert not mpath.exists()
    assert archive.resolve_mode(s.cfg, 0, {"config_hash": "abc"})[0] == "save"
    # mode = auto: the engine serves on with the graphs it captured; nothing is marked saved.
    s.cfg = dataclasses.replace(s.cfg, mode="auto")
    s.save(Adapter())
    s.publish(0)
    assert not mpath.exists() and s.report["saved"] is False
    assert "pointer outside the region" in s.report["save_error"]

    # A defect in Foundry's own SAVE code (an error nobody foresaw) is a failed SAVE like the rest.
    def broken_save(path, **kw):
        raise TypeError("an integer is required")

    monkeypatch.setattr(foundry_core, "save", broken_save)
    s.save(Adapter())
    s.publish(0)
    assert not mpath.exists() and s.report["saved"] is False
    assert s.report["save_error"] == "TypeError: an integer is required"


def _restored(**slots):
    ns = types.SimpleNamespace(
        graphs={"decode/g1": "R1"}, tensors={}, slots=slots, digest="d" * 64, unloads=0
    )
    ns.unload = lambda: setattr(ns, "unloads", ns.unloads + 1)
    return ns


def test_restore_passes_the_pinned_digest_and_installs(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.manifest = {
        "sizing": {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"},
        "graphs": [],
    }
    seen = {}

    def fake_load(path, **kw):
        seen.update(kw, path=path)
        return _restored(kv_cache_memory_bytes=1 << 30, num_gpu_blocks=4096, runner="v2")

    monkeypatch.setattr(foundry_core, "load", fake_load)
    adapter = Adapter()
    assert s.restore(adapter) == 1
    assert seen["path"] == archive.core_archive_dir(s.cfg, 0)
    assert seen["expected_digest"] == s.cfg.archive_digest and seen["fingerprint_model"] == s.fingerprint
    assert adapter.installed[0].graphs == {"decode/g1": "R1"}
    assert seen["archive"] is None  # nothing verified at startup: fc.load reads the archive itself
    assert s.report["archive_digest"] == "d" * 64  # which archive this start restored
    s.verified = verified = object()
    s.restore(Adapter())
    assert seen["archive"] is verified and s.verified is None  # handed over once, then dropped
    assert seen["prepared"] is None and s.report["prepared"] is False  # none started: rebuilt in load
    s.prepared = "prepared"  # what open() started for a LOAD (below)
    s.restore(Adapter())
    assert seen["prepared"] == "prepared" and s.prepared is None


def test_a_load_rebuilds_ahead_from_open_and_a_save_does_not(base_vllm_config, monkeypatch):
    """open() starts the engine layer's rebuild right after the region is reserved (before weights,
    torch.compile and the KV cache), with this rank's archive; restore() hands it to fc.load."""
    import sys

    from foundry_core.engine import prepare

    started = []
    monkeypatch.setattr(prepare, "start", lambda path, **kw: started.append((path, kw)) or "prepared")
    monkeypatch.setattr(
        foundry_core, "Region", lambda base, size, device: types.SimpleNamespace(graph_pool_id=lambda: 7)
    )
    fake_torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            current_device=lambda: 0,
            get_device_name=lambda i: "NVIDIA H200",
            get_device_capability=lambda i: (9, 0),
        ),
        __version__="2.11.0",
        version=types.SimpleNamespace(cuda="13.0"),
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(archive, "engine_fingerprint", lambda config, dev: {"config_hash": "abc"})
    from vllm.platforms import current_platform

    # open() hands vLLM the region's graph pool through the platform class: undone after the test.
    pool = getattr(type(current_platform), "_global_graph_pool", None)
    monkeypatch.setattr(type(current_platform), "_global_graph_pool", pool, raising=False)
    from foundry_core.engine import prewarm

    events: list = []
    monkeypatch.setattr(prewarm, "start", lambda log=None, archive=None: events.append(("threads", archive)))
    for mode in ("load", "save"):
        s = FoundrySession(base_vllm_config)

        def decide(index, s=s, mode=mode):
            s.mode, s.verified = mode, f"verified-{mode}" if mode == "load" else None
            events.append(("decide", mode))

        monkeypatch.setattr(s, "decide_mode", decide)
        s.open(types.SimpleNamespace(index=2))
        assert s.prepared == ("prepared" if mode == "load" else None)
    # Background threads (Triton's key, the archive's inflate) only once the steps are done: beside
    # them they slowed the steps (prewarm's docstring).
    assert events == [("decide", "load"), ("threads", "verified-load"), ("decide", "save"), ("threads", None)]
    ((path, kw),) = started
    assert path == archive.core_archive_dir(s.cfg, 0) and kw["device"] == 2 and kw["rank"] == 0


def test_restore_refuses_sizing_that_disagrees_with_the_manifest(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.manifest = {
        "sizing": {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"},
        "graphs": [],
    }
    restored = _restored(num_gpu_blocks=2048)
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: restored)
    with pytest.raises(FoundryRestoreError, match="num_gpu_blocks=2048 disagrees"):
        s.restore(Adapter())
    assert restored.unloads == 1  # its memory given back before the error


def test_restore_refuses_an_archive_from_the_other_model_runner(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.manifest = {"sizing": {"kv_cache_memory_bytes": 1, "num_gpu_blocks": 1, "runner": "v1"}, "graphs": []}
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: _restored())
    with pytest.raises(FoundryRestoreError, match="saved from model runner v1, this engine uses v2"):
        s.restore(Adapter())


class Region:
    def __init__(self, segments, cursor):
        self._segments, self.cursor, self.marked = segments, cursor, False

    def segments(self):
        return [object()] * self._segments

    def end_setup(self):
        self.marked = True


def test_setup_boundary_is_marked_and_recorded_only_when_saving(base_vllm_config):
    save = _session(base_vllm_config, "save")
    save.region = Region(5, 0x4000000)
    save.end_setup()
    assert save.region.marked and save.setup == {"segments": 5, "cursor": 0x4000000}
    load = _session(base_vllm_config, "load")
    load.manifest = {"sizing": {"setup": save.setup}}
    load.region = Region(5, 0x4000000)
    load.end_setup()  # same layout: fine
    assert not load.region.marked


def test_load_reports_a_diverged_setup_before_warmup(base_vllm_config):
    load = _session(base_vllm_config, "load")
    load.manifest = {"sizing": {"setup": {"segments": 5, "cursor": 0x4000000}}}
    load.region = Region(6, 0x4200000)
    with pytest.raises(FoundryRestoreError, match="region setup diverged from the SAVE: 6 allocations"):
        load.end_setup()


@pytest.mark.parametrize("recorded, locks", [(True, 1), (False, 0), (None, 0), ("missing", 1)])
def test_restore_leaves_the_workspace_as_the_save_left_it(base_vllm_config, monkeypatch, recorded, locks):
    # vLLM 0.26's V2 capture does not lock the workspace, V1 and later V2 captures do: LOAD mirrors SAVE.
    s = _session(base_vllm_config, "load")
    sizing = {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"}
    if recorded != "missing":
        sizing["workspace_locked"] = recorded
    s.manifest = {"sizing": sizing, "graphs": []}
    calls = []
    monkeypatch.setattr(workspace, "lock", lambda: calls.append(1))
    restored = _restored(kv_cache_memory_bytes=1 << 30, num_gpu_blocks=4096, runner="v2")
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: restored)
    s.restore(Adapter())
    assert len(calls) == locks
    assert s.restored is restored  # kept alive: it owns the modules and memory the graphs use
    assert s.report["graphs"] == 1 and s.report["runner"] == "v2" and "restore_s" in s.report


def test_save_records_the_workspace_lock_and_listing_and_carries_its_tensors(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "save")
    s.workspace_locked = False
    s.workspace = {"slots": [{"scratch_bytes": 1024, "persistent": []}]}
    s.workspace_tensors = {"vllm.workspace/0": "W"}
    seen = {}
    monkeypatch.setattr(foundry_core, "save", lambda path, **kw: seen.update(kw) or "digest")
    s.save(Adapter())
    s.publish(0)
    assert seen["slots"]["workspace_locked"] is False
    assert seen["tensors"] == {"hidden_states": "T", "vllm.workspace/0": "W"}
    sizing = archive.read_manifest(archive.manifest_path(s.cfg, 0))["sizing"]
    assert sizing["workspace_locked"] is False and sizing["workspace"] == s.workspace
    assert s.report["graphs"] == 2 and "save_s" in s.report


def _vllm_moe_permute_module():
    """vLLM's ``moe_permute_unpermute`` module, loaded from its file: the ``fused_moe`` package around
    it imports CUDA-only kernels under the CPU stand-in platform; the module itself needs none."""
    import importlib.util
    import sys
    from pathlib import Path

    import vllm

    name = "foundry_test_vllm_moe_permute_unpermute"
    if name not in sys.modules:
        path = Path(vllm.__file__).parent / "model_executor/layers/fused_moe/moe_permute_unpermute.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _grow_like_vllm(manager, scratch_bytes=1000):
    """What vLLM's profiling and warmups leave in the manager: a scratch buffer, Marlin-style zeroed
    locks and the MoE permute scratch (vLLM's own MoEPermuteScratch)."""
    import torch

    get_moe_permute_scratch = _vllm_moe_permute_module().get_moe_permute_scratch
    manager.get_simultaneous(((scratch_bytes,), torch.uint8))
    locks = manager.get_persistent(("marlin_locks", "stream"), (8,), torch.int32, zero_init=True)
    moe = get_moe_permute_scratch(num_experts=4, num_local_experts=4, device=torch.device("cpu"))
    moe.expert_first_token_offset.copy_(torch.arange(5))
    return locks, moe


def test_save_places_scratch_and_persistent_resources_anew_with_their_contents(cpu_workspace_manager):
    """At SAVE's capture every tensor vLLM's workspace holds is allocated anew where allocations are
    routed (the region): the persistent resources as well as the scratch (the plugin once moved the
    scratch only, and MoE decode graphs then pointed outside the region)."""
    import torch

    locks, moe = _grow_like_vllm(cpu_workspace_manager)
    old = {t.data_ptr() for t in (locks, moe.expert_first_token_offset)}
    old.add(cpu_workspace_manager._current_workspaces[0].data_ptr())
    tensors, listing = workspace.place()
    assert sorted(tensors) == [
        "vllm.persistent/0/0/",
        "vllm.persistent/0/1/expert_first_token_offset",
        "vllm.workspace/0",
    ]
    assert not {t.data_ptr() for t in tensors.values()} & old
    # The manager holds the new tensors, with the old contents; the MoE scratch object is the same.
    again = cpu_workspace_manager.get_persistent(("marlin_locks", "stream"), (8,), torch.int32)
    assert again.data_ptr() == tensors["vllm.persistent/0/0/"].data_ptr() and not again.any()
    assert (
        moe.expert_first_token_offset.data_ptr()
        == tensors["vllm.persistent/0/1/expert_first_token_offset"].data_ptr()
    )
    assert moe.expert_first_token_offset.tolist() == [0, 1, 2, 3, 4]
    (slot,) = listing["slots"]
    assert slot["scratch_bytes"] == 1024  # vLLM rounds each part up to 256 bytes
    assert [p["key"] for p in slot["persistent"]][0] == "(torch.Tensor,('marlin_locks','stream'))"
    assert slot["persistent"][1]["fields"] == {"expert_first_token_offset": [[5], "int64"]}


def test_a_capture_that_grows_the_workspace_is_seen_after_it(cpu_workspace_manager):
    """What vLLM's capture adds to its workspace after place() (a larger scratch, a resource whose key
    names no stream) is memory a LOAD's locked manager would not hold: SAVE sees it and says what.
    A resource keyed by the capture's own stream is asked for by the capture alone."""
    import torch

    class FakeStream:  # describe_key names any *Stream* object "stream", as a CUDA stream
        pass

    _grow_like_vllm(cpu_workspace_manager)
    _, listing = workspace.place()
    assert workspace.grown_since(listing) is None
    cpu_workspace_manager.get_persistent(("marlin_locks", FakeStream()), (8,), torch.int32)
    assert workspace.grown_since(listing) is None
    cpu_workspace_manager.get_persistent(("scratch_for_eager", 0), (8,), torch.int32)
    assert workspace.grown_since(listing) == (
        "vLLM's capture added the persistent workspace resource "
        "(torch.Tensor,('scratch_for_eager',0)) (slot 0)"
    )
    cpu_workspace_manager.get_simultaneous(((4096,), torch.uint8))
    assert workspace.grown_since(listing) == (
        "vLLM's workspace slot 0 grew from 1024 to 4096 bytes during its capture"
    )


def test_a_save_whose_capture_grew_the_workspace_writes_nothing(base_vllm_config, monkeypatch, caplog):
    s = _session(base_vllm_config, "save")
    archive.manifest_path(s.cfg, 0).unlink(missing_ok=True)  # no other SAVE published meanwhile
    s.workspace = {"slots": [{"scratch_bytes": 1024, "persistent": []}]}
    monkeypatch.setattr(workspace, "grown_since", lambda placed: "vLLM's workspace slot 0 grew (test)")
    saved = []
    monkeypatch.setattr(foundry_core, "save", lambda path, **kw: saved.append(path) or "digest")
    with caplog.at_level(logging.WARNING):
        s.save(Adapter())
    assert saved == [] and s.report["saved"] is False
    assert "a LOAD could not hand that memory back to vLLM" in s.report["save_error"]
    assert not archive.manifest_path(s.cfg, 0).exists()


def test_load_hands_the_restored_workspace_to_vllm_and_it_stays_locked(cpu_workspace_manager):
    import torch
    from vllm.v1.worker import workspace as vllm_workspace

    _grow_like_vllm(cpu_workspace_manager)
    saved_tensors, listing = workspace.place()  # what foundry_core.load hands back at LOAD
    vllm_workspace.init_workspace_manager(torch.device("cpu"), 1)  # a LOAD process after its warmups
    manager = vllm_workspace.current_workspace_manager()
    locks, moe = _grow_like_vllm(manager)
    workspace.check_restorable(listing, saved_tensors)
    assert workspace.install(listing, saved_tensors) == 3
    workspace.lock()
    assert manager._current_workspaces[0].data_ptr() == saved_tensors["vllm.workspace/0"].data_ptr()
    again = manager.get_persistent(("marlin_locks", "stream"), (8,), torch.int32)
    assert again.data_ptr() == saved_tensors["vllm.persistent/0/0/"].data_ptr()
    assert (
        moe.expert_first_token_offset.data_ptr()
        == saved_tensors["vllm.persistent/0/1/expert_first_token_offset"].data_ptr()
    )
    with pytest.raises(AssertionError, match="Workspace is locked"):
        manager.get_persistent(("marlin_locks", "other"), (8,), torch.int32)


def test_load_whose_workspace_differs_from_the_save_is_refused(cpu_workspace_manager):
    import torch
    from vllm.v1.worker import workspace as vllm_workspace

    _grow_like_vllm(cpu_workspace_manager)
    saved_tensors, listing = workspace.place()
    vllm_workspace.init_workspace_manager(torch.device("cpu"), 1)
    manager = vllm_workspace.current_workspace_manager()
    _grow_like_vllm(manager, scratch_bytes=8192)
    with pytest.raises(workspace.WorkspaceMismatch, match="slot 0 grew to 8192 bytes before the graphs"):
        workspace.check_restorable(listing, saved_tensors)
    vllm_workspace.init_workspace_manager(torch.device("cpu"), 1)
    _grow_like_vllm(vllm_workspace.current_workspace_manager())
    partial = {k: v for k, v in saved_tensors.items() if not k.startswith("vllm.persistent/0/1/")}
    with pytest.raises(workspace.WorkspaceMismatch, match="archive lacks vLLM's persistent workspace"):
        workspace.check_restorable(listing, partial)
    vllm_workspace.init_workspace_manager(torch.device("cpu"), 1)
    vllm_workspace.current_workspace_manager().get_simultaneous(((100,), torch.uint8))
    with pytest.raises(workspace.WorkspaceMismatch, match="resource .*marlin_locks.* differs .*missing"):
        workspace.check_restorable(listing, saved_tensors)


def test_a_workspace_mismatch_unloads_the_restore_before_anything_is_installed(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    sizing = {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"}
    sizing["workspace"] = {"slots": [{"scratch_bytes": 1024, "persistent": []}]}
    s.manifest = {"sizing": sizing, "graphs": []}
    restored = _restored(kv_cache_memory_bytes=1 << 30, num_gpu_blocks=4096, runner="v2")
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: restored)
    adapter = Adapter()
    with pytest.raises(FoundryRestoreError, match="has no workspace manager"):
        s.restore(adapter)
    assert restored.unloads == 1 and adapter.installed is None


def test_start_report_is_written_next_to_the_archive(base_vllm_config, caplog, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.mode = "load"
    s.report.update(mode="load", graphs=4, restore_s=0.5, foundry_steps_s={"session": 0.01, "decide": 0.02})
    caplog.set_level(logging.INFO, logger="vllm.foundry")
    s.write_report()
    # and in the log, on one line, where the side-by-side harness reads Foundry's steps from
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import sxs_server

    lines = [(0.0, r.getMessage()) for r in caplog.records]
    facts = sxs_server.foundry_facts(lines)
    assert facts["report"]["foundry_steps_s"] == {"session": 0.01, "decide": 0.02}
    data = json.loads(archive.start_report_path(s.cfg, 0).read_text())
    assert data["kind"] == archive.START_REPORT_KIND and data["schema"] == archive.START_REPORT_SCHEMA
    assert (data["mode"], data["graphs"], data["rank"], data["num_gpu_blocks"]) == ("load", 4, 0, 4096)
    # The manifest decides auto mode; the report next to it changes nothing there.
    assert archive.resolve_mode(s.cfg, 0, {"config_hash": "abc"})[0] == "save"


@pytest.mark.parametrize(
    "error, level",
    [
        (OSError(errno.EROFS, "Read-only file system"), logging.INFO),  # a read-only archive mount
        (PermissionError(errno.EACCES, "Permission denied"), logging.INFO),
        (OSError(errno.ENOSPC, "No space left on device"), logging.WARNING),
    ],
)
def test_an_unwritable_start_report_does_not_stop_the_engine(
    base_vllm_config, monkeypatch, caplog, error, level
):
    """A read-only archive directory (LOADs only) is said once at most, not warned at every start."""
    s = _session(base_vllm_config, "load")

    def refuse(path, data):
        raise error

    monkeypatch.setattr(archive, "write_json_atomic", refuse)
    caplog.set_level(logging.INFO, logger="vllm.foundry")
    assert s.write_report()["rank"] == 0
    said = [r for r in caplog.records if "start report not written" in r.getMessage()]
    assert [r.levelno for r in said] == [level]


class RoutingRegion:
    """Records routing and label contexts the way Region nests them."""

    def __init__(self):
        self.events = []

    @contextlib.contextmanager
    def routing(self):
        self.events.append("route+")
        try:
            yield self
        finally:
            self.events.append("route-")

    @contextlib.contextmanager
    def label(self, name):
        self.events.append(f"label+{name}")
        try:
            yield
        finally:
            self.events.append(f"label-{name}")


def test_capture_routing_ends_before_the_save_and_only_once(base_vllm_config):
    s = _session(base_vllm_config, "save")
    s.region = RoutingRegion()
    s.begin_capture_routing()
    s.begin_capture_routing()  # already routing: no second context
    # vLLM's workspace is placed first, inside the routing (workspace.place: none in this process).
    begun = ["route+", "label+vllm.capture", "label+vllm.workspace", "label-vllm.workspace"]
    assert s.region.events == begun and s.workspace == {"slots": []}
    s.end_capture_routing()
    s.end_capture_routing()
    assert s.region.events == [*begun, "label-vllm.capture", "route-"]


def test_runner_build_is_routed_from_init_workspace_manager_to_the_end_of_init_device():
    # vLLM 0.26's Worker.init_device: set device, ..., init_workspace_manager(), build the runner.
    events = []

    @contextlib.contextmanager
    def routed():
        events.append("route+")
        yield
        events.append("route-")

    def open_and_route():
        events.append("open")
        return routed()

    module = types.SimpleNamespace(init_workspace_manager=lambda device, n: events.append(("ws", device, n)))
    original = module.init_workspace_manager

    def init_device():  # the shape of vLLM's init_device, calling through the module global
        events.append("set_device")
        module.init_workspace_manager("cuda:0", 1)
        events.append("runner")

    with route_runner_build(module, open_and_route) as fired:
        init_device()
        events.append("usage_stats")
    assert fired == [True] and module.init_workspace_manager is original
    assert events == ["set_device", "open", "route+", ("ws", "cuda:0", 1), "runner", "usage_stats", "route-"]


def test_runner_build_hook_reports_when_vllm_has_no_such_call():
    module = types.SimpleNamespace()
    with route_runner_build(module, lambda: pytest.fail("must not open")) as fired:
        pass
    assert fired == [False] and not hasattr(module, "init_workspace_manager")


def test_runner_build_routing_ends_when_init_device_fails():
    events = []

    @contextlib.contextmanager
    def routed():
        events.append("route+")
        try:
            yield
        finally:
            events.append("route-")

    module = types.SimpleNamespace(init_workspace_manager=lambda *a: None)
    with pytest.raises(RuntimeError), route_runner_build(module, routed):
        module.init_workspace_manager("cuda:0")
        raise RuntimeError("runner build failed")
    assert events == ["route+", "route-"]


def test_a_read_only_archive_dir_at_save_serves_on_in_auto(base_vllm_config, monkeypatch):
    import pathlib

    s = _session(base_vllm_config, "save")
    s.cfg = dataclasses.replace(s.cfg, mode="auto")
    mpath = archive.manifest_path(s.cfg, 0)
    mpath.unlink(missing_ok=True)  # the session-wide archive dir may hold another test's manifest
    real_unlink = pathlib.Path.unlink

    def read_only(self, *a, **kw):
        if self == mpath:
            raise PermissionError(30, "Read-only file system", str(self))
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    monkeypatch.setattr(foundry_core, "save", lambda *a, **k: pytest.fail("nothing may be written"))
    s.save(Adapter())  # does not raise: the engine serves with the graphs it captured
    s.publish(0)
    assert s.report["saved"] is False and "Read-only file system" in s.report["save_error"]


def _failing_load(path, **kw):
    raise foundry_core.PlacementError("allocation #3 diverged: LOAD placed 4096 bytes at 0x600000200000")


@pytest.mark.parametrize("mode, world_size", [("auto", 1), ("load", 1), ("auto", 2)])
def test_a_restore_failing_at_the_graph_phase_captures_instead_only_in_auto_on_one_rank(
    base_vllm_config, monkeypatch, mode, world_size
):
    s = _session(base_vllm_config, "load")
    s.cfg, s.world_size = dataclasses.replace(s.cfg, mode=mode), world_size
    s.manifest = {"sizing": {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"}}
    monkeypatch.setattr(foundry_core, "load", _failing_load)
    mpath = archive.manifest_path(s.cfg, 0)
    archive.write_manifest(mpath, {"config_hash": "abc"}, {}, [])
    adapter = Adapter()
    if (mode, world_size) != ("auto", 1):
        with pytest.raises(
            FoundryRestoreError, match="failed at the graph phase .*allocation #3 diverged"
        ) as e:
            s.restore_or_capture(adapter)
        assert e.value.__context__ is None  # one line, not chained to the core's traceback
        assert s.mode == "load"
        return
    assert s.restore_or_capture(adapter) is False
    assert s.mode == "capture" and adapter.installed is None
    assert "capturing the graphs as stock would" in s.report["fallback"] and s.report["mode"] == "capture"
    assert mpath.exists()  # the archive is left as it is: another replica may load it


def test_a_restore_that_does_not_fit_is_unloaded_before_capturing_instead(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.cfg = dataclasses.replace(s.cfg, mode="auto")
    s.manifest = {"sizing": {"kv_cache_memory_bytes": 1, "num_gpu_blocks": 1, "runner": "v1"}}
    restored = _restored()
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: restored)
    assert s.restore_or_capture(Adapter()) is False
    assert restored.unloads == 1 and s.restored is None and s.mode == "capture"
    ok = _session(base_vllm_config, "load")
    ok.manifest = {"sizing": {"kv_cache_memory_bytes": 1, "num_gpu_blocks": 1, "runner": "v2"}, "graphs": []}
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: _restored())
    assert ok.restore_or_capture(Adapter()) is True and ok.mode == "load"
