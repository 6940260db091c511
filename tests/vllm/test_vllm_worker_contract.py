"""What the Foundry worker relies on in the installed vLLM (CPU checks; the GPU path is validated on GPU).

These tests pin the vLLM internals the GPU integration uses, so that a vLLM upgrade that renames or
reshapes them fails here, in CI, instead of at a GPU start.  vLLM's GPU worker and model runners import
CUDA-only operator modules once a CUDA platform is active, so on a CPU machine (where conftest installs
a stand-in platform) the checks that import them run in a fresh interpreter with vLLM's own platform
detection.
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from foundry_vllm_plugin import FoundryUnsupportedError, graphs

pytestmark = pytest.mark.vllm


def _in_fresh_process(body: str, tmp_path, **env: str) -> None:
    """Run ``body`` (asserts) in a fresh interpreter; fail with its traceback."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(body))
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR", **env},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("OK"), out.stdout[-2000:]


def test_vllm_internals_that_the_worker_relies_on(tmp_path):
    _in_fresh_process(
        """
        import inspect
        from vllm.v1.worker.gpu_worker import Worker
        from foundry_vllm_plugin.worker import FoundryWorker

        assert issubclass(FoundryWorker, Worker)
        for name in ("init_device", "load_model", "determine_available_memory",
                     "initialize_from_config", "compile_or_warm_up_model"):
            assert name in Worker.__dict__, f"vLLM's Worker has no {name}()"
            assert name in FoundryWorker.__dict__, name
        # The workspace manager and the model runner are built at the end of init_device, either through
        # _init_workspace_and_model_runner (overridden, recent releases) or right after a call to
        # init_workspace_manager through the module global (hooked, 0.26).  Foundry routes both.
        init_src = inspect.getsource(Worker.init_device)
        if "_init_workspace_and_model_runner" in Worker.__dict__:
            assert "self._init_workspace_and_model_runner()" in init_src
        else:
            import vllm.v1.worker.gpu_worker as gw
            assert callable(gw.init_workspace_manager)
            assert init_src.index("init_workspace_manager(") < init_src.index("self.model_runner")
        # LOAD sets kv_cache_memory_bytes: vLLM then skips the profiling measurement and graph estimate.
        dam = inspect.getsource(Worker.determine_available_memory)
        assert "if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes" in dam
        assert "self.model_runner.capture_model()" in inspect.getsource(Worker._compile_or_warm_up_model)

        import dataclasses
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu import cudagraph_utils as cu
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        from foundry_vllm_plugin import graphs

        init = inspect.getsource(cu.CudaGraphManager.__init__)
        for attr in ("self.graphs", "self._capture_descs", "self._graphs_captured", "self.pool"):
            assert attr in init, attr
        assert "self.hidden_states" in inspect.getsource(cu.ModelCudaGraphManager.__init__)
        assert "self.graphs[desc].replay()" in inspect.getsource(cu.CudaGraphManager.run_fullgraph)
        assert "self.hidden_states[: desc.num_tokens]" in inspect.getsource(cu.ModelCudaGraphManager.run_fullgraph)
        # LOAD mirrors the workspace lock that vLLM's own capture left at SAVE (0.26's V2 capture leaves
        # it unlocked, later ones lock it): the state is read through these.
        from vllm.v1.worker import workspace

        assert callable(workspace.is_workspace_manager_initialized)
        assert "def is_locked" in inspect.getsource(workspace.WorkspaceManager)
        # Foundry places the scratch and the persistent resources (0.33) at SAVE's capture and hands
        # them back at LOAD: the manager keeps them in these two lists.
        wm_init = inspect.getsource(workspace.WorkspaceManager.__init__)
        assert "self._current_workspaces" in wm_init and "self._persistent_resources" in wm_init
        from foundry_vllm_plugin import workspace as foundry_workspace
        assert foundry_workspace.locked() is None  # no manager in this process

        # 0.33: warmup_kernels runs before the capture (SAVE routes from the capture on), the V2
        # capture ends with inner graphs, the KV connector's reset and the lock (LOAD mirrors them),
        # and the graph-memory profiling swaps the global pool (SAVE only; settled in both modes).
        warm = inspect.getsource(Worker._compile_or_warm_up_model)
        assert warm.index("warmup_kernels(") < warm.index("self.model_runner.capture_model()")
        cap = inspect.getsource(GPUModelRunner.capture_model)
        for part in ("capture_inner_cudagraphs(", "reset_capture_state()", "lock_workspace()", "profile_only"):
            assert part in cap, part
        prof = inspect.getsource(cu.profile_cudagraph_memory)
        assert "_global_graph_pool" in prof and "capture_model(profile_only=True)" in prof

        a = cu.BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8, uniform_token_count=1)
        b = dataclasses.replace(a)
        c = dataclasses.replace(a, num_tokens=4, num_reqs=4)
        key = graphs.descriptor_key(a)
        assert key["cg_mode"] == "FULL" and key["num_tokens"] == 8, key
        assert graphs.graph_name(key) == graphs.graph_name(graphs.descriptor_key(b))
        assert graphs.graph_name(key) != graphs.graph_name(graphs.descriptor_key(c))

        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

        src = inspect.getsource(V1Runner.capture_model)
        assert "get_capture_descs()" in src and "set_cudagraph_capturing_enabled(False)" in src
        print("OK")
        """,
        tmp_path,
    )


def test_worker_refuses_unsupported_configs_before_touching_the_device(base_vllm_config, tmp_path):
    from vllm.config import LoRAConfig

    config = copy.deepcopy(base_vllm_config)
    config.lora_config = LoRAConfig()
    (tmp_path / "lora.pkl").write_bytes(pickle.dumps(config))
    (tmp_path / "ok.pkl").write_bytes(pickle.dumps(base_vllm_config))
    _in_fresh_process(
        """
        import pickle
        from foundry_vllm_plugin import FoundryUnsupportedError
        from foundry_vllm_plugin.worker import FoundrySession, FoundryWorker

        kwargs = dict(local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")
        try:
            FoundryWorker(vllm_config=pickle.load(open("lora.pkl", "rb")), **kwargs)
        except FoundryUnsupportedError as e:
            assert "configuration: LoRA" in str(e), e
        else:
            raise AssertionError("LoRA was not refused")
        session = FoundrySession(pickle.load(open("ok.pkl", "rb")))
        assert (session.rank, session.world_size, session.mode, session.region) == (0, 1, None, None)
        assert session.cfg.mode == "auto"
        print("OK")
        """,
        tmp_path,
        VLLM_USE_V2_MODEL_RUNNER="0",
    )


def test_the_worker_sets_the_import_heap_aside_before_vllm_s_worker_starts(base_vllm_config, tmp_path):
    """Before vLLM's worker (and so before CUDA): the heap of torch and vLLM, which each of the start's
    full gc.collect() passes would walk again, is set aside (foundry_core.engine.gcheap)."""
    (tmp_path / "ok.pkl").write_bytes(pickle.dumps(base_vllm_config))
    _in_fresh_process(
        """
        import gc, pickle
        from foundry_vllm_plugin import worker

        seen = {}

        def vllm_worker_init(self, *args, **kwargs):  # vLLM's own worker, here only looked at
            seen["frozen"] = gc.get_freeze_count()

        worker._VllmGpuWorker.__init__ = vllm_worker_init
        kwargs = dict(local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")
        w = worker.FoundryWorker(vllm_config=pickle.load(open("ok.pkl", "rb")), **kwargs)
        frozen = w._foundry.report["gc_frozen"]
        assert frozen is True and seen["frozen"] > 100_000, (frozen, seen)  # torch and vLLM
        print("OK")
        """,
        tmp_path,
    )


def test_runtime_helpers_exist():
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.workspace import lock_workspace

    assert callable(lock_workspace) and callable(set_cudagraph_capturing_enabled)
    assert "_global_graph_pool" in vars(Platform)


def test_keep_captured_graphs_is_scoped():
    import torch

    base = torch.cuda.CUDAGraph
    with graphs.keep_captured_graphs():
        assert torch.cuda.CUDAGraph is not base and issubclass(torch.cuda.CUDAGraph, base)
    assert torch.cuda.CUDAGraph is base


def test_captured_graphs_are_built_with_keep_graph():
    # foundry_core.save calls raw_cuda_graph(), which torch allows only for keep_graph=True graphs
    # (enable_debug_mode() keeps the cudaGraph_t too but is refused there).  The flag is an argument of
    # CUDAGraph.__new__; constructing a real one needs a GPU, so a stand-in base with that signature is used.
    import inspect

    import torch

    assert "keep_graph" in inspect.signature(torch.cuda.CUDAGraph.__new__).parameters

    # Like torch: __new__ takes the flag, but the C++ object (and so the flag that counts) is built by
    # pybind's __init__(self, keep_graph=False), which Python calls with the caller's own arguments.
    class Base:
        def __new__(cls, keep_graph=False):
            return super().__new__(cls)

        def __init__(self, keep_graph=False):
            self.keep_graph = keep_graph

    kept = graphs.kept_graph_class(Base)
    assert issubclass(kept, Base)
    assert kept().keep_graph is True and kept(keep_graph=False).keep_graph is True

    class NewOnly(Base):  # what the plugin did first: overriding __new__ alone loses the flag
        def __new__(cls, *args, **kwargs):
            return super().__new__(cls, keep_graph=True)

    assert NewOnly().keep_graph is False


def test_unknown_runner_is_refused():
    with pytest.raises(FoundryUnsupportedError, match="no known CUDA graph layout"):
        graphs.adapter_for(object())


def test_v2_adapter_installs_exactly_the_planned_graphs(tmp_path):
    # Real V2 descriptors and vLLM's own workspace lock; the manager holds only what the adapter touches.
    _in_fresh_process(
        """
        import types
        import torch
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
        from vllm.v1.worker.workspace import init_workspace_manager
        from foundry_vllm_plugin import FoundryUnsupportedError, graphs

        init_workspace_manager(torch.device("cpu"))
        d8 = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8, uniform_token_count=1)
        d4 = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=4, uniform_token_count=1)

        def runner(mode=CUDAGraphMode.FULL_DECODE_ONLY, descs=None):
            mgr = types.SimpleNamespace(cudagraph_mode=mode, _capture_descs=descs or {CUDAGraphMode.FULL: [d8, d4]},
                                        graphs={}, hidden_states=None, ubatch_runner=None, _graphs_captured=False,
                                        use_aux_hidden_state_outputs=False)
            return types.SimpleNamespace(cudagraph_manager=mgr, attn_groups=[], use_aux_hidden_state_outputs=False,
                                         speculator=None, model_state=types.SimpleNamespace(supports_mm_inputs=False))

        r = runner()
        adapter = graphs.adapter_for(r)
        assert adapter.kind == "v2"
        adapter.check()
        names = {graphs.graph_name(graphs.descriptor_key(d)): d for d in (d8, d4)}
        restored = types.SimpleNamespace(graphs={n: f"G{d.num_tokens}" for n, d in names.items()},
                                         tensors={"hidden_states": "H"})
        assert adapter.install(restored, []) == 2
        mgr = r.cudagraph_manager
        assert mgr.graphs == {d8: "G8", d4: "G4"} and mgr.hidden_states == "H" and mgr._graphs_captured

        partial = types.SimpleNamespace(graphs={graphs.graph_name(graphs.descriptor_key(d8)): "G8"},
                                        tensors={"hidden_states": "H"})
        try:
            graphs.adapter_for(runner()).install(partial, [])
        except graphs.FoundryRestoreError as e:
            assert "missing" in str(e), e
        else:
            raise AssertionError("a partial archive was installed")

        # vLLM 0.33's V2 capture also captures a model state's inner graphs and runs adaptive
        # verification's profiling: neither is persisted, so a runner with either is refused.
        from vllm.v1.worker.gpu.model_states.interface import ModelState

        class InnerGraphs(ModelState):
            def capture_inner_cudagraphs(self, *args):
                pass

        InnerGraphs.__abstractmethods__ = frozenset()
        inner = runner()
        inner.model_state = object.__new__(InnerGraphs)
        adaptive = runner()
        adaptive.adaptive_verification = object()
        plain_state = type("PlainState", (ModelState,), {})
        plain_state.__abstractmethods__ = frozenset()
        plain = runner()
        plain.model_state = object.__new__(plain_state)
        graphs.adapter_for(plain).check()  # the interface's own no-op hook: accepted
        for bad, text in (
            (runner(mode=CUDAGraphMode.FULL_AND_PIECEWISE), "effective cudagraph_mode=FULL_AND_PIECEWISE"),
            (runner(descs={CUDAGraphMode.FULL: [d8], CUDAGraphMode.PIECEWISE: [d4]}), "PIECEWISE graphs"),
            (inner, "inner CUDA graphs of InnerGraphs"),
            (adaptive, "adaptive verification"),
        ):
            try:
                graphs.adapter_for(bad).check()
            except FoundryUnsupportedError as e:
                assert text in str(e), e
            else:
                raise AssertionError(text)
        print("OK")
        """,
        tmp_path,
    )


def test_worker_routes_the_runner_build_of_the_0_26_layout(tmp_path):
    # vLLM 0.26's Worker has no _init_workspace_and_model_runner: init_device calls the module-level
    # init_workspace_manager and then builds the runner.  Reshape the installed Worker that way and check
    # that FoundryWorker opens the region at that call and routes until init_device returns.
    _in_fresh_process(
        """
        import contextlib
        import vllm.v1.worker.gpu_worker as gw
        from foundry_vllm_plugin.worker import FoundryWorker

        events = []

        def init_device_026(self):
            self.device = "cuda:0"
            events.append("set_device")
            gw.init_workspace_manager(self.device, 1)
            self.model_runner = "runner"
            events.append("runner")

        del gw.Worker._init_workspace_and_model_runner
        gw.Worker.init_device = init_device_026
        gw.init_workspace_manager = lambda device, n: events.append(("workspace", device, n))
        original = gw.init_workspace_manager

        class Session:
            report = {"phases_s": {}}

            def open(self, device):
                events.append(("open", device))

            @contextlib.contextmanager
            def routing(self, label):
                events.append(f"route+{label}")
                yield
                events.append(f"route-{label}")

        import foundry_vllm_plugin.worker as fw
        fw.start_module_recording = lambda: events.append("recording")
        w = FoundryWorker.__new__(FoundryWorker)
        w._foundry = Session()
        w.init_device()
        assert events == ["recording", "set_device", ("open", "cuda:0"), "route+vllm.runner",
                          ("workspace", "cuda:0", 1), "runner", "route-vllm.runner"], events
        assert gw.init_workspace_manager is original and w.model_runner == "runner"
        assert "init_device" in w._foundry.report["phases_s"]
        print("OK")
        """,
        tmp_path,
    )


def test_compile_or_warm_up_model_saves_unrouted_and_loads_without_capturing(tmp_path):
    # vLLM's warmup sequence is replaced by a stand-in that calls capture_model the way vLLM does; the
    # session records the order of routing, capture, save and restore.
    _in_fresh_process(
        """
        import types
        import torch
        import vllm.v1.worker.gpu_worker as gw
        from foundry_vllm_plugin.worker import FoundryWorker

        events = []

        def compile_or_warm_up_model(self):
            events.append("warmup")
            size = self.model_runner.capture_model()
            events.append(("after_capture", size))
            return "times"

        gw.Worker.compile_or_warm_up_model = compile_or_warm_up_model
        import foundry_core

        foundry_core.stop_recording = lambda: events.append("stop")  # CUPTI detach, after the counts

        class Runner:
            def __init__(self):
                self.cudagraph_manager = types.SimpleNamespace(graphs={}, _capture_descs={})
                # vLLM 0.33's capture ends with the KV connector's reset: LOAD does it in its place.
                self.kv_connector = types.SimpleNamespace(reset_capture_state=lambda: events.append("kv_reset"))

            def capture_model(self):
                kept = torch.cuda.CUDAGraph is not BASE
                events.append(("vllm_capture", kept))
                return 123

        BASE = torch.cuda.CUDAGraph

        class Session:
            rank = 0

            def __init__(self, mode):
                self.mode, self.report, self.workspace_locked = mode, {"phases_s": {}}, "unset"

            def begin_capture_routing(self):
                events.append("route+")

            def end_capture_routing(self):
                events.append("route-")

            def save(self, adapter):
                events.append(("save", adapter.kind))

            def restore_or_capture(self, adapter):
                events.append(("restore", adapter.kind))
                if self.fails:  # the restore failed in auto mode: the session says capture instead
                    self.mode = "capture"
                return not self.fails

            def publish(self, device_index):
                events.append(("publish", device_index))

            def write_report(self):
                events.append("report")

        for mode in ("save", "load", "load-fails"):
            events.clear()
            w = FoundryWorker.__new__(FoundryWorker)
            w._foundry, w.model_runner = Session(mode.removesuffix("-fails")), Runner()
            w._foundry.fails = mode == "load-fails"
            w.device = torch.device("cuda", 0)
            assert w.compile_or_warm_up_model() == "times"
            assert "capture_model" not in vars(w.model_runner)  # vLLM's own method again
            assert torch.cuda.CUDAGraph is BASE
            if mode == "save":
                # Routed from vLLM's capture on: its warmups before it (kernel_warmup, and 0.33's
                # warmup_kernels) run outside the region, as at LOAD.
                i = events.index(("vllm_capture", True))
                assert events[:2] == ["warmup", "route+"] and events[i - 1] == "route+", events
                assert events[i + 1] == "route-", events
                assert events.index(("save", "v2")) > i + 1 and ("after_capture", 123) in events
                # The manifest (and the carried caches) only after vLLM's last warmup.
                assert events.index(("publish", 0)) > events.index(("save", "v2")), events
                assert w._foundry.workspace_locked is None  # no workspace manager in this process
                assert "capture_s" in w._foundry.report
            elif mode == "load":
                assert "route+" not in events and not any(e[0] == "vllm_capture" for e in events if isinstance(e, tuple))
                assert ("restore", "v2") in events and ("after_capture", 0) in events
                assert events.index("kv_reset") == events.index(("restore", "v2")) + 1, events
            else:  # vLLM captures as it would alone: no kept graphs, no save, its own size returned
                assert events.index(("restore", "v2")) < events.index(("vllm_capture", False)), events
                assert ("after_capture", 123) in events and not any(e[0] == "save" for e in events if isinstance(e, tuple))
                assert "route+" not in events and "capture_s" in w._foundry.report
                assert "kv_reset" not in events  # vLLM's own capture resets it
            assert events[-2:] == ["stop", "report"], events
            phases = w._foundry.report["phases_s"]
            assert {"compile_or_warm_up_model", "warmup_before_graphs", "graphs", "warmup_after_graphs"} <= set(phases)
        print("OK")
        """,
        tmp_path,
    )


def _kv_config(block_size, tensor_size):
    import types

    spec = types.SimpleNamespace(block_size=block_size, page_size_bytes=block_size * 2048)
    group = types.SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.self_attn.attn"])
    tensor = types.SimpleNamespace(size=tensor_size, shared_by=["model.layers.0.self_attn.attn"])
    return types.SimpleNamespace(num_blocks=64, kv_cache_groups=[group], kv_cache_tensors=[tensor])


def test_kv_layout_records_the_aligned_block_size_groups_and_tensors():
    import types

    from foundry_vllm_plugin import archive

    cache = types.SimpleNamespace(block_size=544, mamba_page_size_padded=1114112)
    layout = archive.kv_layout(cache, _kv_config(544, 1 << 20))
    assert layout == {
        "block_size": 544,
        "mamba_page_size_padded": 1114112,
        "groups": [
            {
                "spec": "SimpleNamespace",
                "block_size": 544,
                "page_size_bytes": 544 * 2048,
                "layers": ["model.layers.0.self_attn.attn"],
            }
        ],
        "tensors": [{"size": 1 << 20, "shared_by": ["model.layers.0.self_attn.attn"]}],
    }


def test_load_refuses_a_kv_cache_laid_out_otherwise_than_at_save(tmp_path):
    """A LOAD whose KV cache vLLM sized to the same number of blocks but laid out otherwise (another
    aligned block size, other groups or tensors) is refused before the cache is allocated."""
    _in_fresh_process(
        """
        import contextlib
        import types

        from foundry_vllm_plugin import archive, graphs
        from foundry_vllm_plugin.worker import FoundryWorker

        def kv_config(block_size):
            spec = types.SimpleNamespace(block_size=block_size, page_size_bytes=block_size * 2048)
            group = types.SimpleNamespace(kv_cache_spec=spec, layer_names=["layers.0.attn"])
            tensor = types.SimpleNamespace(size=1 << 20, shared_by=["layers.0.attn"])
            return types.SimpleNamespace(num_blocks=64, kv_cache_groups=[group], kv_cache_tensors=[tensor])

        saved = archive.kv_layout(types.SimpleNamespace(block_size=544), kv_config(544))
        allocated = []

        class Session:
            mode, report = "load", {"phases_s": {}}
            manifest = {"sizing": {"num_gpu_blocks": 64, "kv_layout": saved}}

            def write_report(self):
                pass

            @contextlib.contextmanager
            def routing(self, label):
                allocated.append(label)
                yield

        w = FoundryWorker.__new__(FoundryWorker)
        w._foundry = Session()
        w.cache_config = types.SimpleNamespace(block_size=16, mamba_page_size_padded=None)
        try:
            w.initialize_from_config(kv_config(16))
        except graphs.FoundryRestoreError as e:
            assert "KV cache layout differs from the archive's (block_size: archive has 544, engine has 16" in str(e), e
        else:
            raise AssertionError("not refused")
        assert allocated == []  # refused before vLLM allocated anything
        assert "KV cache layout differs" in w._foundry.report["error"]
        print("OK")
        """,
        tmp_path,
    )


def test_a_hybrid_runner_may_use_the_gated_delta_net_backend_and_no_other_model_may():
    import types

    def runner(hybrid, names):
        backends = [
            types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda n=n: n)) for n in names
        ]
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(is_hybrid=hybrid), attn_groups=[backends]
        )

    graphs._check_common(runner(True, ["FLASH_ATTN", "GDN_ATTN"]))  # no exception
    with pytest.raises(FoundryUnsupportedError, match="attention backend GDN_ATTN"):
        graphs._check_common(runner(False, ["FLASH_ATTN", "GDN_ATTN"]))
    with pytest.raises(FoundryUnsupportedError, match="attention backend FLASHINFER"):
        graphs._check_common(runner(True, ["FLASHINFER", "GDN_ATTN"]))


def test_only_batches_after_the_start_count_as_served(tmp_path):
    """vLLM 0.33's kernel warmups call the worker's execute_model inside compile_or_warm_up_model:
    those steps are no served batches (a LOAD reports what its first request built, a SAVE saves
    its caches again after its first requests)."""
    _in_fresh_process(
        """
        import contextlib, types
        from vllm.v1.worker.gpu_worker import Worker
        from foundry_vllm_plugin import worker as worker_mod
        from foundry_vllm_plugin.worker import FoundryWorker

        served = []
        def warm_up(self):
            self.execute_model("warmup step")  # as vLLM 0.33's warmup_kernels does
            return "warm"
        Worker.compile_or_warm_up_model = warm_up
        Worker.execute_model = lambda self, *a, **k: "output"
        worker_mod.profiled = lambda *a, **k: contextlib.nullcontext()
        worker_mod.stop_module_recording = lambda: None
        worker_mod.stream_captures = lambda: 0
        worker_mod.graphs.adapter_for = lambda runner: None
        w = object.__new__(FoundryWorker)
        w._serving = False
        w.device = types.SimpleNamespace(index=0)
        w.model_runner = types.SimpleNamespace(capture_model=None)
        w._foundry = types.SimpleNamespace(
            report={"phases_s": {}}, mode="load", rank=0,
            caches=types.SimpleNamespace(served=lambda device: served.append(device)),
            publish=lambda device: None, end_capture_routing=lambda: None, write_report=lambda: None,
        )
        assert w.compile_or_warm_up_model() == "warm"
        assert served == [], served
        assert w.execute_model("first request") == "output" and served == [0]
        print("OK")
        """,
        tmp_path,
    )
