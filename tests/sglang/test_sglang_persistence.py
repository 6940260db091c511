"""CPU-checkable pieces of SAVE/LOAD: output layouts, archive fingerprints, auto mode, pool sizing,
and the decode backend's LOAD path. The GPU path itself (capture, fc.save, fc.load, replay) is not
exercised here: see docs/sglang.md, "What is validated"."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

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
    sa.resolve_once()
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


def test_save_without_pool_sizing_refuses(parse, cfg):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError, match="memory-pool sizing was not recorded"):
        session.finish()


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


def test_backend_refuses_other_decode_backends():
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import (
        BreakableCudaGraphBackend,
    )

    from foundry_sglang_plugin.backend import install

    with pytest.raises(RuntimeError, match="full decode-graph backend"):
        install(object.__new__(BreakableCudaGraphBackend), _FakeSession({}))


def test_save_graphs_keep_their_topology(monkeypatch):
    from foundry_sglang_plugin.backend import _graphs_keep_topology

    class FakeGraph:
        def __new__(cls, keep_graph=False):
            obj = object.__new__(cls)
            obj.keep_graph = keep_graph
            return obj

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    with _graphs_keep_topology():
        kept = torch.cuda.CUDAGraph()
        assert isinstance(kept, FakeGraph)
    assert kept.keep_graph is True
    assert torch.cuda.CUDAGraph is FakeGraph and FakeGraph().keep_graph is False


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
    assert "self.warmup()" in inspect.getsource(DecodeCudaGraphRunner._capture)


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
