"""The SGLang plugin's decode backend on the CPU: graph outputs flattened for the archive and
rebuilt, LOAD installing restored graphs without a forward, replay timing, the backend shape the
plugin relies on, and what SAVE records per shape. The GPU path itself (capture, fc.save, fc.load,
replay) is not exercised here: see docs/sglang.md, "What is validated"."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from foundry_sglang_testutil import BASE_ARGV, FakeRegion

from foundry_sglang_plugin import archive, outputs
from foundry_sglang_plugin.session import FoundrySessionError, Session, _shape_name

pytestmark = pytest.mark.sglang


# --- graph outputs --------------------------------------------------------------------------------


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


def test_enum_members_keep_their_type():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    layout, tensors = outputs.flatten({"mode": CaptureHiddenMode.LAST}, "p")
    assert outputs.unflatten(layout, tensors)["mode"] is CaptureHiddenMode.LAST


# --- the decode backend ---------------------------------------------------------------------------


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


def test_save_marks_the_end_of_setup_once_and_refuses_a_recapture(parse, cfg):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.region = FakeRegion()
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
