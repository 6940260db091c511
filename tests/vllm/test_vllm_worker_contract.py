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
        # The model runner is built at the end of init_device through this method (routed by Foundry).
        assert "_init_workspace_and_model_runner" in Worker.__dict__
        assert "self._init_workspace_and_model_runner()" in inspect.getsource(Worker.init_device)
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
        assert "profile_only" in inspect.signature(GPUModelRunner.capture_model).parameters
        assert "lock_workspace()" in inspect.getsource(GPUModelRunner.capture_model)

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
            assert "with LoRA" in str(e), e
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

        for bad, text in (
            (runner(mode=CUDAGraphMode.FULL_AND_PIECEWISE), "effective cudagraph_mode=FULL_AND_PIECEWISE"),
            (runner(descs={CUDAGraphMode.FULL: [d8], CUDAGraphMode.PIECEWISE: [d4]}), "PIECEWISE graphs"),
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
