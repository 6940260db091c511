"""CPU-checkable pieces of SAVE/LOAD: output layouts, archive fingerprints, auto mode, pool sizing,
and the decode backend's LOAD path. The GPU path itself (capture, fc.save, fc.load, replay) is not
exercised here: see docs/sglang.md, "What is validated"."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import pickle
import types

import pytest
import torch

from foundry_sglang_plugin import archive, outputs
from foundry_sglang_plugin.session import FoundrySessionError, Session, _shape_name

pytestmark = pytest.mark.sglang

BASE_ARGV = ["--cuda-graph-backend-prefill", "disabled"]


# --- graph outputs ------------------------------------------------------------------------------


def test_logits_output_round_trips_through_its_layout():
    import json

    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    out = LogitsProcessorOutput(next_token_logits=torch.randn(4, 8), hidden_states=None)
    layout, tensors = outputs.flatten(out, "out/decode/size=4")
    assert list(tensors) == ["out/decode/size=4/next_token_logits"]
    layout = json.loads(json.dumps(layout))  # it is stored as JSON
    rebuilt = outputs.unflatten(layout, tensors)
    assert type(rebuilt) is LogitsProcessorOutput
    assert rebuilt.next_token_logits is tensors["out/decode/size=4/next_token_logits"]
    assert rebuilt.hidden_states is None


def test_nested_containers_round_trip():
    value = {"a": (torch.zeros(2), [1, 2.5, "x", None]), "b": [torch.ones(3)]}
    layout, tensors = outputs.flatten(value, "p")
    rebuilt = outputs.unflatten(layout, tensors)
    assert isinstance(rebuilt["a"], tuple) and rebuilt["a"][1] == [1, 2.5, "x", None]
    assert rebuilt["b"][0] is tensors["p/b/0"]


def test_unknown_output_types_are_refused_at_save():
    with pytest.raises(outputs.OutputLayoutError, match="cannot persist a graph output of type object"):
        outputs.flatten({"x": object()}, "p")


def test_missing_tensor_is_refused_at_load():
    layout, _ = outputs.flatten(torch.zeros(1), "p")
    with pytest.raises(outputs.OutputLayoutError, match="no tensor 'p'"):
        outputs.unflatten(layout, {})


def test_shape_names_are_stable():
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    assert _shape_name(ShapeKey(8)) == "decode/size=8"
    assert _shape_name(ShapeKey(8, variant_label="lora")) == "decode/size=8,variant_label=lora"
    assert _shape_name(16) == "decode/size=16"  # releases keyed by batch size


# --- fingerprint and auto mode -------------------------------------------------------------------


@pytest.fixture
def cfg(foundry_toml, tmp_path):
    from foundry_core.config import load_config

    return dataclasses.replace(load_config(foundry_toml), archive_dir=tmp_path / "archive")


def test_fingerprint_is_the_same_in_the_scheduler(parse, cfg):
    sa = parse(*BASE_ARGV)
    getattr(sa, "resolve_once", lambda: None)()  # 0.5.20+ resolves lazily; older records are resolved
    child = pickle.loads(pickle.dumps(sa))  # how the record reaches a scheduler process
    assert archive.fingerprint(child, cfg) == archive.fingerprint(sa, cfg)


def test_fingerprint_ignores_serving_settings_and_sees_graph_settings(parse, cfg):
    base = archive.fingerprint(parse(*BASE_ARGV), cfg)
    assert archive.fingerprint(parse(*BASE_ARGV, "--port", "31000", "--log-level", "debug"), cfg) == base
    assert archive.fingerprint(parse(*BASE_ARGV, "--cuda-graph-max-bs-decode", "16"), cfg) != base
    assert archive.fingerprint(parse(*BASE_ARGV, "--kv-cache-dtype", "fp8_e4m3"), cfg) != base
    other_region = dataclasses.replace(cfg, region_base=cfg.region_base * 2)
    assert archive.fingerprint(parse(*BASE_ARGV), other_region) != base


def test_fingerprint_covers_the_model_config(parse, cfg, model_dir):
    sa = parse(*BASE_ARGV)
    fp = archive.fingerprint(sa, cfg)
    digest = fp["model_config_sha256"]
    assert digest and len(digest) == 64


def _complete(sa, cfg, rank, fingerprint=None):
    fp = fingerprint if fingerprint is not None else archive.fingerprint(sa, cfg)
    archive.write_sidecar(cfg, rank, {"fingerprint": fp, "slots": {}, "outputs": {}})


def test_auto_saves_without_an_archive(parse, cfg):
    assert archive.decide_mode(parse(*BASE_ARGV), cfg) == "save"


def test_auto_loads_a_complete_matching_archive(parse, cfg):
    sa = parse(*BASE_ARGV)
    _complete(sa, cfg, 0)
    assert archive.decide_mode(sa, cfg) == "load"


def test_auto_saves_when_the_configuration_changed(parse, cfg):
    _complete(parse(*BASE_ARGV), cfg, 0)
    assert archive.decide_mode(parse(*BASE_ARGV, "--cuda-graph-max-bs-decode", "4"), cfg) == "save"


def test_auto_saves_when_one_rank_is_missing(parse, cfg):
    argv = [*BASE_ARGV, "--tp-size", "2"]
    sa = parse(*argv)
    _complete(sa, cfg, 0)
    assert archive.decide_mode(sa, cfg) == "save"
    _complete(sa, cfg, 1)
    assert archive.decide_mode(sa, cfg) == "load"


@pytest.mark.parametrize("mode", ["save", "load"])
def test_explicit_modes_are_kept(parse, cfg, mode):
    assert archive.decide_mode(parse(*BASE_ARGV), dataclasses.replace(cfg, mode=mode)) == mode


# --- session: pool sizing and archive presence ---------------------------------------------------


def test_load_without_archive_refuses_before_gpu_work(parse, cfg):
    with pytest.raises(FoundrySessionError, match="no Foundry archive for this configuration"):
        Session(parse(*BASE_ARGV), cfg, "load", rank=0, gpu_id=0)


def test_save_invalidates_the_previous_archive_first(parse, cfg):
    sa = parse(*BASE_ARGV)
    _complete(sa, cfg, 0)
    Session(sa, cfg, "save", rank=0, gpu_id=0)
    assert archive.read_sidecar(cfg, 0) is None


def test_pool_sizing_saved_then_restored_without_profiling(parse, cfg):
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    sa = parse(*BASE_ARGV)
    saver = Session(sa, cfg, "save", rank=0, gpu_id=0)
    profiled = MemoryPoolConfig(max_total_num_tokens=123456, max_running_requests=48, mem_fraction_static=0.3)
    assert saver.pool_config(lambda: profiled, MemoryPoolConfig) is profiled
    _complete(sa, cfg, 0)
    side = archive.read_sidecar(cfg, 0)
    side["slots"] = saver.slots
    archive.write_sidecar(cfg, 0, side)

    loader = Session(sa, cfg, "load", rank=0, gpu_id=0)

    def must_not_profile():
        raise AssertionError("LOAD profiled GPU memory")

    restored = loader.pool_config(must_not_profile, MemoryPoolConfig)
    assert restored == profiled


def test_hybrid_state_pool_sizing_is_recorded_at_save_and_imposed_at_load(parse, cfg, monkeypatch):
    """A hybrid (Mamba / linear-attention) model's state pool: the size SGLang's memory profiling
    resolves into its schedule config at SAVE is recorded, and LOAD puts it back into that config
    without profiling (SGLang's real config bags)."""
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.runtime_context import get_context, get_schedule, publish

    ctx = get_context()
    for attr in ("_server_args", "_config_bags", "_publish_role"):  # published below; put back after
        monkeypatch.setattr(ctx, attr, getattr(ctx, attr, None), raising=False)
    profiled = MemoryPoolConfig(max_total_num_tokens=65536, max_running_requests=48, mem_fraction_static=0.3)

    def profile():  # what SGLang's resolution does for a hybrid model: sizes the state pool too
        get_context().override("test.profiling", max_mamba_cache_size=2048)
        return profiled

    sa = parse(*BASE_ARGV)
    publish(sa, role="test")
    saver = Session(sa, cfg, "save", rank=0, gpu_id=0)
    saver.pool_config(profile, MemoryPoolConfig)
    assert saver.slots["max_mamba_cache_size"] == 2048
    _complete(sa, cfg, 0)
    side = archive.read_sidecar(cfg, 0)
    side["slots"] = saver.slots
    archive.write_sidecar(cfg, 0, side)

    publish(sa, role="test")  # a new process: its schedule holds no resolved size yet
    assert get_schedule().max_mamba_cache_size is None
    loader = Session(sa, cfg, "load", rank=0, gpu_id=0)

    def must_not_profile():
        raise AssertionError("LOAD profiled GPU memory")

    assert loader.pool_config(must_not_profile, MemoryPoolConfig) == profiled
    assert get_schedule().max_mamba_cache_size == 2048


def test_save_without_pool_sizing_refuses(parse, cfg):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError, match="memory-pool sizing was not recorded"):
        session.finish()


def test_session_end_detaches_cupti_even_when_it_fails(parse, cfg, monkeypatch, logged):
    """finish() and abort() stop module recording whatever happened; a failing stop is logged only."""
    import foundry_core as fc

    calls = []
    monkeypatch.setattr(fc, "stop_recording", lambda: calls.append("stop"))
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError):
        session.finish()
    session.abort(RuntimeError("x"))
    assert calls == ["stop", "stop"]

    def broken():
        raise fc.ModuleError("cuptiFinalize failed")

    monkeypatch.setattr(fc, "stop_recording", broken)
    session.abort(RuntimeError("y"))  # does not raise
    seen = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert any("cannot stop CUDA module recording: cuptiFinalize failed" in m for m in seen), seen


# --- the decode backend --------------------------------------------------------------------------


class _FakeSession:
    mode = "load"

    def __init__(self, graphs):
        self._graphs = graphs
        self.restores = 0

    def graph_pool(self):
        return (7, 7)

    def restore(self):
        self.restores += 1

    def restored_graph(self, key):
        return self._graphs[key]


def _bare_full_backend():
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    backend = object.__new__(FullCudaGraphBackend)  # __init__ needs a TP group (GPU); state by hand
    backend._graphs, backend._outputs, backend._pool = {}, {}, None
    return backend


def test_load_installs_restored_graphs_without_running_the_forward():
    from foundry_sglang_plugin.backend import install

    graph, out = object(), object()
    session = _FakeSession({8: (graph, out)})
    backend = install(_bare_full_backend(), session)

    def forward():
        raise AssertionError("LOAD ran a warmup or capture forward")

    backend.capture_one(8, forward, None, post_warmup_hook=forward)
    assert backend._graphs[8] is graph and backend._outputs[8] is out
    assert backend.can_run(None, 8) and not backend.can_run(None, 4)


class _CountingGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_replay_is_sglangs_and_untimed_by_default(monkeypatch):
    from foundry_sglang_plugin import replay_timing
    from foundry_sglang_plugin.backend import install

    monkeypatch.delenv(replay_timing.ENV, raising=False)
    graph, out = _CountingGraph(), object()
    backend = install(_bare_full_backend(), _FakeSession({8: (graph, out)}))
    backend.capture_one(8, None)
    assert backend._foundry_timer is None
    # No Foundry frame on the replay path: the class does not override replay, nor does the instance.
    assert "replay" not in vars(type(backend)) and "replay" not in vars(backend)
    assert backend.replay(8, None) is out and graph.replays == 1


class _TwoReplayTimer:
    """ReplayTimer's interface without CUDA events: active for two replays."""

    def __init__(self, limit, on_summary):
        self.names = []

    @property
    def active(self):
        return len(self.names) < 2

    @contextlib.contextmanager
    def measure(self, name):
        self.names.append(name)
        yield


def test_timed_replays_unwrap_after_the_last_one(monkeypatch):
    from foundry_sglang_plugin import replay_timing
    from foundry_sglang_plugin.backend import install

    monkeypatch.setenv(replay_timing.ENV, "2")
    monkeypatch.setattr(replay_timing, "ReplayTimer", _TwoReplayTimer)
    graph, out = _CountingGraph(), object()
    session = _FakeSession({8: (graph, out)})
    session.replay_timing_done = lambda summary: None
    backend = install(_bare_full_backend(), session)
    backend.capture_one(8, None)
    timer = backend._foundry_timer
    assert "replay" in vars(backend)
    assert backend.replay(8, None) is out and "replay" in vars(backend)
    assert backend.replay(8, None) is out
    assert timer.names == ["8", "8"] and graph.replays == 2
    assert "replay" not in vars(backend) and backend._foundry_timer is None
    assert backend.replay(8, None) is out and graph.replays == 3 and timer.names == ["8", "8"]


@pytest.mark.parametrize("value,expected", [("", 0), ("0", 0), ("-3", 0), ("x", 0), ("200", 200)])
def test_replay_timing_switch(monkeypatch, value, expected):
    from foundry_sglang_plugin import replay_timing

    monkeypatch.setenv(replay_timing.ENV, value)
    assert replay_timing.replays_to_time() == expected


def test_replay_timer_reports_once_after_its_last_replay():
    """Past its limit the timer records nothing and hands its summary over exactly once (no GPU:
    with limit 0 no CUDA event is ever created)."""
    from foundry_sglang_plugin.replay_timing import ReplayTimer

    summaries = []
    timer = ReplayTimer(0, summaries.append)
    for _ in range(3):
        with timer.measure("bs8"):
            pass
    assert summaries == [{}] and not timer.active


def test_backend_refuses_other_decode_backends():
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import (
        BreakableCudaGraphBackend,
    )

    from foundry_sglang_plugin.backend import install

    with pytest.raises(RuntimeError, match="full decode-graph backend"):
        install(object.__new__(BreakableCudaGraphBackend), _FakeSession({}))


class _PybindGraph:
    """Shaped like torch's ``_CUDAGraph``: a generic ``__new__`` that ignores its arguments (pybind's)
    and an ``__init__(keep_graph=False)`` that builds the C++ object."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, keep_graph=False):
        self.cpp_keep_graph = keep_graph


class _TorchGraph(_PybindGraph):
    """Shaped like ``torch.cuda.CUDAGraph`` (2.9-2.14): ``keep_graph`` goes to ``__new__`` only."""

    def __new__(cls, keep_graph=False):
        instance = super().__new__(cls, keep_graph)
        instance.py_keep_graph = keep_graph
        return instance


def test_save_graphs_keep_their_topology(monkeypatch):
    from foundry_core.engine.capture import keep_captured_graphs

    # The shape check first: a plain subclass overriding __new__ alone would leave the C++ graph at
    # keep_graph=False, because Python calls __init__ with the caller's (empty) arguments.
    assert _TorchGraph(keep_graph=True).cpp_keep_graph is True
    assert _TorchGraph().cpp_keep_graph is False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _TorchGraph)
    with keep_captured_graphs():
        kept = torch.cuda.CUDAGraph()  # as FullCudaGraphBackend.capture_one builds it
        assert isinstance(kept, _TorchGraph)
    assert kept.cpp_keep_graph is True and kept.py_keep_graph is True
    assert torch.cuda.CUDAGraph is _TorchGraph and _TorchGraph().cpp_keep_graph is False


def test_sglang_backend_still_has_the_shape_the_plugin_relies_on():
    """Canary for SGLang changes: the SAVE path re-uses FullCudaGraphBackend.capture_one, which must
    build its graph with torch.cuda.CUDAGraph() and keep graphs/outputs per shape key."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    source = inspect.getsource(FullCudaGraphBackend.capture_one)
    assert "torch.cuda.CUDAGraph()" in source
    assert "self._graphs[shape_key] = graph" in source and "self._outputs[shape_key] = out" in source
    assert "self._pool is None" in inspect.getsource(FullCudaGraphBackend.capture_session)
    runner = inspect.getsource(DecodeCudaGraphRunner)
    assert "resolve_decode_backend(self)" in runner
    # capture() warms up, then captures (0.5.2x moved the body into _capture(), called by capture()).
    body = getattr(DecodeCudaGraphRunner, "_capture", DecodeCudaGraphRunner.capture)
    assert "self.warmup()" in inspect.getsource(body)
    if body is not DecodeCudaGraphRunner.capture:
        assert "self._capture()" in inspect.getsource(DecodeCudaGraphRunner.capture)


def test_eager_runner_warms_up_before_the_decode_capture():
    """Why the warmup gate keys on the capture having begun: SGLang's one warmup per process runs in
    EagerRunner.__init__, which capture_cuda_graphs builds before the decode runner."""
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    assert "self.warmup()" in inspect.getsource(EagerRunner.__init__)
    source = inspect.getsource(cuda_graph_setup.capture_cuda_graphs)
    assert source.index("EagerRunner(") < source.index("capture_decode_graph(")


class _FakeRegion:
    def __init__(self):
        self.setup_marks = 0

    def end_setup(self):
        self.setup_marks += 1


def test_save_marks_the_end_of_setup_once_and_refuses_a_recapture(parse, cfg):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.region = _FakeRegion()
    session.capture_begins()
    assert session.region.setup_marks == 1
    with pytest.raises(FoundrySessionError, match="captured a second time"):
        session.capture_begins()


def test_save_records_graph_outputs_under_shape_names(parse, cfg):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    graph = object()
    session.record(ShapeKey(4), graph, LogitsProcessorOutput(next_token_logits=torch.zeros(4, 2)))
    assert session.graphs == {"decode/size=4": graph}
    assert list(session.tensors) == ["out/decode/size=4/next_token_logits"]
    assert session.layouts["decode/size=4"]["k"] == "dataclass"


def test_load_refuses_when_an_archived_shape_was_not_installed(parse, cfg):
    sa = parse(*BASE_ARGV)
    archive.write_sidecar(
        cfg,
        0,
        {"fingerprint": archive.fingerprint(sa, cfg), "slots": {}, "outputs": {"decode/size=8": {}}},
    )
    session = Session(sa, cfg, "load", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError, match=r"\['decode/size=8'\] were archived but not installed"):
        session.finish()


def test_plugin_record_lives_beside_the_core_archive_not_inside(cfg):
    # The core archive path is a symlink swapped on SAVE and may hold only files its manifest lists.
    assert archive.sidecar_path(cfg, 3) == cfg.archive_dir / "rank3.sglang.json"
    assert archive.sidecar_path(cfg, 3).parent == cfg.rank_archive_dir(3).parent


def test_enum_members_keep_their_type():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    layout, tensors = outputs.flatten({"mode": CaptureHiddenMode.LAST}, "p")
    assert outputs.unflatten(layout, tensors)["mode"] is CaptureHiddenMode.LAST


# --- worker hooks around the decode capture -------------------------------------------------------


class _Runner:
    def __init__(self, draft=False):
        self.model_runner = type("MR", (), {"is_draft_worker": draft})()


@pytest.fixture
def hooks_with(monkeypatch):
    from foundry_sglang_plugin import hooks

    def install(session):
        monkeypatch.setattr(hooks, "_session", session)
        return hooks

    return install


@pytest.mark.parametrize("mode", ["save", "load"])
def test_warmup_before_the_capture_is_setup_and_runs_in_both_modes(parse, cfg, hooks_with, mode):
    sa = parse(*BASE_ARGV)
    if mode == "load":
        _complete(sa, cfg, 0)
    hooks = hooks_with(Session(sa, cfg, mode, rank=0, gpu_id=0))
    ran = []
    hooks.around_runner_warmup(lambda self: ran.append(self), _Runner())
    assert len(ran) == 1


def test_warmup_after_the_capture_began_is_skipped_only_at_load(parse, cfg, hooks_with):
    sa = parse(*BASE_ARGV)
    for mode, expected in (("save", 1), ("load", 0)):
        _complete(sa, cfg, 0)  # (a SAVE session drops it)
        session = Session(sa, cfg, mode, rank=0, gpu_id=0)
        session.capture_started = True
        hooks = hooks_with(session)
        ran = []
        hooks.around_runner_warmup(lambda self, ran=ran: ran.append(self), _Runner())
        assert len(ran) == expected, mode


def test_decode_capture_hook_marks_setup_then_times_the_capture(parse, cfg, hooks_with):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.region = _FakeRegion()
    hooks = hooks_with(session)
    seen = []

    def capture(runner):
        seen.append(session.region.setup_marks)  # setup was marked before the runner's capture ran
        return "captured"

    assert hooks.around_decode_capture(capture, _Runner()) == "captured"
    assert seen == [1] and session.capture_started
    assert session.report["capture_s"] >= 0


@pytest.mark.parametrize("mode", ["save", "load"])
def test_capture_loop_collects_garbage_only_where_it_captures(parse, cfg, hooks_with, monkeypatch, mode):
    """SGLang's freeze_gc runs gc.collect() around its capture loop; a LOAD's loop captures nothing,
    so there (and only there) the collections are skipped. Outside the decode capture the context
    is SGLang's own in both modes."""
    import gc

    from sglang.srt.model_executor.runner.base_cuda_graph_runner import freeze_gc

    sa = parse(*BASE_ARGV)
    if mode == "load":
        _complete(sa, cfg, 0)
    session = Session(sa, cfg, mode, rank=0, gpu_id=0)
    session.region = _FakeRegion()
    session.restored = object()  # LOAD: the archive counts as restored (no fc.load on CPU)
    hooks = hooks_with(session)
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)

    def capture(runner):
        with hooks.around_freeze_gc(freeze_gc, False):
            pass

    hooks.around_decode_capture(capture, _Runner())
    assert len(collected) == (0 if mode == "load" else 2)
    collected.clear()
    with hooks.around_freeze_gc(freeze_gc, False):  # e.g. a prefill runner's capture
        pass
    assert len(collected) == 2


def test_draft_runners_are_left_alone(parse, cfg, hooks_with):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.region = _FakeRegion()
    hooks = hooks_with(session)
    hooks.around_decode_capture(lambda runner: None, _Runner(draft=True))
    assert session.region.setup_marks == 0 and not session.capture_started


# --- fingerprint: launch-to-launch stability -------------------------------------------------------


def test_fingerprint_ignores_the_random_seed(parse, cfg):
    # SGLang before 0.5.20 resolves an unset seed to a new random number at every launch.
    base = archive.fingerprint(parse(*BASE_ARGV, "--random-seed", "1"), cfg)
    assert archive.fingerprint(parse(*BASE_ARGV, "--random-seed", "2"), cfg) == base
    assert "random_seed" not in base["server_args"]


# --- the session report (read by benchmarks from outside the scheduler process) --------------------


def test_report_is_written_where_the_environment_says(parse, cfg, monkeypatch, tmp_path):
    import json

    from foundry_sglang_plugin.session import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "report"))
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError):
        session.finish()  # nothing recorded: refused, and the report says why
    report = json.loads((tmp_path / "report" / "rank0.json").read_text())
    assert report["mode"] == "save" and report["ok"] is False
    assert "memory-pool sizing was not recorded" in report["error"]


def test_abort_reports_the_error(parse, cfg, monkeypatch, tmp_path):
    import json

    from foundry_sglang_plugin.session import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path))
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.abort(RuntimeError("placement diverged"))
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report == {**report, "ok": False, "error": "RuntimeError: placement diverged"}


def test_no_report_file_without_the_environment(parse, cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["auto", "save"])
def test_a_save_that_cannot_be_written(parse, cfg, monkeypatch, logged, mode):
    """Disk full or read-only at SAVE: auto serves on with the captured graphs (a warning, nothing
    marked saved); mode = save stops the scheduler's start with the error."""
    import foundry_core as fc

    def disk_full(path, **kw):
        raise fc.ArchiveError(f"cannot write {path}: [Errno 28] No space left on device")

    monkeypatch.setattr(fc, "save", disk_full)
    monkeypatch.setattr(fc, "stop_recording", lambda: None)
    cfg = dataclasses.replace(cfg, mode=mode)
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.slots, session.graphs = {"memory_pool_config": {}}, {"decode/size=1": object()}
    if mode == "save":
        with pytest.raises(fc.ArchiveError, match="No space left"):
            session.finish()
        return
    session.finish()
    assert session.report["ok"] is True and session.report["saved"] is False
    assert "No space left" in session.report["save_error"]
    assert archive.read_sidecar(cfg, 0) is None  # nothing marks a finished SAVE
    warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert any("SAVE failed" in m and "serving with the graphs just captured" in m for m in warnings)


def test_load_rebuilds_ahead_from_the_region_on_and_hands_it_to_fc_load(parse, cfg, monkeypatch):
    """A LOAD starts the engine layer's rebuild as soon as its region is reserved (before weights
    and KV pools) and passes it to fc.load at the decode capture; a SAVE starts none."""
    import contextlib

    import foundry_core as fc
    from foundry_core.engine import prepare

    class Region:
        def __init__(self, base, size, device):
            self.device = device

        def routing(self):
            return contextlib.nullcontext()

    started, loaded = [], {}
    monkeypatch.setattr(fc, "Region", Region)
    monkeypatch.setattr(prepare, "start", lambda path, **kw: started.append((path, kw)) or "prepared")

    class Restored:
        digest = "ab" * 32
        slots: dict = {}
        timings = {"prepared_s": 0.3, "prepare_wait_s": 0.0, "prepared_ready": 1.0}
        archive = types.SimpleNamespace(meta={"collectives": {"symm_mem": 3}})

    monkeypatch.setattr(fc, "load", lambda path, **kw: loaded.update(kw, path=path) or Restored())
    sa = parse(*BASE_ARGV)
    archive.write_sidecar(cfg, 0, {"fingerprint": archive.fingerprint(sa, cfg), "slots": {}, "outputs": {}})
    session = Session(sa, cfg, "load", rank=0, gpu_id=1)
    session.enter_region(1)
    ((path, kw),) = started
    assert path == str(session.path) and kw["device"] == 1 and kw["rank"] == 0 and kw["cfg"] is cfg
    session.restore()
    assert loaded["prepared"] == "prepared" and loaded["path"] == str(session.path)
    assert session.report["prepared"] is True and session.report["prepared_ready"] is True
    assert session.report["collectives"] == {"symm_mem": 3}

    save = Session(sa, cfg, "save", rank=0, gpu_id=1)
    save.enter_region(1)
    assert len(started) == 1  # a SAVE has nothing to rebuild


@pytest.mark.parametrize("mode", ["auto", "load"])
def test_a_restore_failing_at_the_capture_captures_instead_in_auto_mode(parse, cfg, monkeypatch, mode):
    """fc.load accepted the archive at startup but fails when the decode capture begins: auto on one
    rank captures as SGLang would alone (no graph installed, nothing saved, the archive left for the
    next start); load mode stops with one line."""
    import foundry_core as fc

    def failing_load(path, **kw):
        raise fc.PlacementError("allocation #3 diverged: LOAD placed 4096 bytes at 0x600000200000")

    monkeypatch.setattr(fc, "load", failing_load)
    monkeypatch.setattr(fc, "stop_recording", lambda: None)
    cfg = dataclasses.replace(cfg, mode=mode)
    sa = parse(*BASE_ARGV)
    archive.write_sidecar(cfg, 0, {"fingerprint": archive.fingerprint(sa, cfg), "slots": {}, "outputs": {}})
    session = Session(sa, cfg, "load", rank=0, gpu_id=0)
    session.sidecar = archive.read_sidecar(cfg, 0)
    if mode == "load":
        with pytest.raises(FoundrySessionError, match="failed at the graph phase .*allocation #3 diverged"):
            session.capture_begins()
        return
    session.capture_begins()
    assert session.mode == "capture" and "capturing the graphs as stock would" in session.report["fallback"]
    session.capture_done()
    assert "capture_s" in session.report and "restore_s" not in session.report
    session.finish()  # nothing installed and nothing persisted: no complaint about missing graphs
    assert session.report["ok"] is True and session.report["saved"] is False
    assert archive.read_sidecar(cfg, 0) is not None  # another replica may load it


def test_auto_decides_each_data_parallel_replica_on_its_own_archives(parse, cfg):
    """One replica's archive lost (or never finished) does not make the others SAVE again: each
    replica restores alone from its own archives; tensor-parallel ranks of a replica go together."""
    sa = parse(*BASE_ARGV, "--dp-size", "2", "--tp-size", "2")
    assert archive.decide_mode(sa, cfg) == "save"
    _complete(sa, cfg, 0)
    assert archive.decide_mode(sa, cfg) == "save", "replica 0 lacks its second rank"
    _complete(sa, cfg, 1)
    assert archive.decide_mode(sa, cfg) == "load,save"
    _complete(sa, cfg, 3)
    assert archive.decide_mode(sa, cfg) == "load,save", "replica 1 lacks its first rank"
    _complete(sa, cfg, 2)
    assert archive.decide_mode(sa, cfg) == "load"
    archive.drop_sidecar(cfg, 0)
    assert archive.decide_mode(sa, cfg) == "save,load"
    assert [archive.replica_mode("save,load", r) for r in (0, 1)] == ["save", "load"]
    assert archive.replica_mode("load", 1) == archive.replica_mode("load", None) == "load"
    with pytest.raises(ValueError, match="no mode for data-parallel replica 2"):
        archive.replica_mode("save,load", 2)
    assert archive.is_mode("load,save") and archive.is_mode("save") and not archive.is_mode("auto,load")


def test_an_archive_of_another_parallel_layout_is_not_loaded(parse, cfg):
    """Two ranks saved under TP=2 are not two DP=2 replicas (nor the reverse): the layout is in the
    fingerprint, so auto SAVEs and mode=load is refused (``settle``)."""
    tp2, dp2 = parse(*BASE_ARGV, "--tp-size", "2"), parse(*BASE_ARGV, "--dp-size", "2")
    for rank in (0, 1):
        _complete(tp2, cfg, rank)
    assert archive.decide_mode(tp2, cfg) == "load"
    assert archive.decide_mode(dp2, cfg) == "save" and not archive.complete(dp2, cfg)
    saved, now = archive.fingerprint(tp2, cfg)["server_args"], archive.fingerprint(dp2, cfg)["server_args"]
    assert {"tp_size", "dp_size"} <= {k for k in saved if saved[k] != now.get(k)}
