"""The hook functions :func:`foundry_sglang_plugin.register` installs through SGLang's HookRegistry.

Two groups:

* launcher hooks (every process that loads plugins): add the two flags to SGLang's parser, carry
  them onto ``ServerArgs`` (CLI and ``sglang.Engine(...)``), and, just before SGLang's own
  ``check_server_args`` step, refuse unsupported configurations and settle ``auto`` before any
  subprocess or GPU work starts. With the flag off the parser gains the two flags and nothing else
  changes: every hook hands SGLang's own result back.
* worker hooks (only in processes a Foundry-enabled launch spawned, see ``settings.ENV_MARKER``):
  drive the :class:`~foundry_sglang_plugin.session.Session` of a scheduler process.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Any

from foundry_sglang_plugin import settings

# --- launcher hooks ----------------------------------------------------------------------------


def after_add_cli_args(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    settings.add_cli_args(parser)


def after_from_cli_args(server_args: Any, cls: Any, namespace: Any, *args: Any, **kwargs: Any) -> None:
    settings.attach(
        server_args,
        getattr(namespace, "enable_foundry", False),
        getattr(namespace, "foundry_config", None),
    )


def around_engine_init(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """``sglang.Engine(..., enable_foundry=True, foundry_config=PATH)``."""
    enable = kwargs.pop("enable_foundry", False)
    config_path = kwargs.pop("foundry_config", None)
    if not enable and config_path is None:
        return original(self, *args, **kwargs)
    if "server_args" in kwargs:
        settings.attach(kwargs["server_args"], enable, config_path)
        return original(self, *args, **kwargs)
    build = type(self).server_args_class

    def build_with_foundry(**fields: Any) -> Any:
        server_args = build(**fields)
        settings.attach(server_args, enable, config_path)
        return server_args

    # Engine builds its record with ``self.server_args_class(**kwargs)``; an instance attribute
    # shadows the class attribute for exactly this construction.
    self.server_args_class = build_with_foundry
    try:
        return original(self, *args, **kwargs)
    finally:
        self.__dict__.pop("server_args_class", None)


def before_check_server_args(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Runs in the launching process after resolution, ahead of SGLang's own checks and before
    SGLang spawns any subprocess: Foundry's refusal is the first thing a Foundry user sees."""
    settings.clear_env()  # what an earlier launch in this process exported is not this launch's
    req = settings.requested(server_args)
    if not req.enabled and req.config_path is None:
        return
    t0 = time.perf_counter()
    from foundry_core.config import ConfigError
    from foundry_core.engine import decide, exiting, redirect_for_launch
    from foundry_sglang_plugin.session import CACHE_KINDS, FoundrySessionError, settle
    from foundry_sglang_plugin.support import check_cuda_present

    try:
        cfg, mode = settle(server_args)
        check_cuda_present(server_args)
        problem = decide.archive_dir_problem(cfg) if "save" in mode.split(",") else None
        if problem is not None and cfg.mode == "save":
            raise ConfigError(f"Foundry: {problem}; mode = save cannot go on")
    except (ConfigError, FoundrySessionError) as e:  # FoundryUnsupportedError is a ConfigError
        raise exiting(e) from None  # one line at the end of `sglang serve`, not a traceback
    if problem is not None:  # auto: serve as stock SGLang would, and say why (strict = true: refuse)
        what = "auto mode serves without Foundry this time (nothing can be saved)"
        try:
            decide.fall_back(
                cfg, f"Foundry: {problem}", what, ConfigError, logging.getLogger("foundry.sglang")
            )
        except ConfigError as e:
            raise exiting(e) from None
        return
    settings.set_mode(server_args, mode)
    settings.export_env(cfg, mode)
    # Before SGLang spawns its schedulers: they inherit private compile-cache folders, in place
    # before they import FlashInfer or Inductor (which read their folder once).
    redirect_for_launch(cfg, CACHE_KINDS)
    # What Foundry added to the launcher's start, so that a slower start can be placed.
    logging.getLogger("foundry.sglang").info(
        "Foundry: %s settled in the launcher in %.2f s", mode.upper(), time.perf_counter() - t0
    )
    _launcher_floor(cfg, mode, time.perf_counter() - t0)


def _launcher_floor(cfg: Any, mode: str, settle_s: float) -> None:
    """The launcher's step for the ranks' start reports, the scheduler start method, and, at SAVE,
    what the launcher read (for a LOAD's read-ahead)."""
    from foundry_core.engine import readahead, startsteps
    from foundry_sglang_plugin import sched_start

    startsteps.export_launch({"settle": settle_s})
    sched_start.install()  # schedulers forked where safe (sched_start)
    if "save" in mode.split(","):
        readahead.record_later(cfg.archive_dir, "launcher", log=logging.getLogger("foundry.sglang"))


def after_check_server_args(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """After SGLang's checks (which require a GPU step of at least 1): the test aid
    ``settings.SHARE_GPU_ENV`` puts every scheduler (tensor- and data-parallel ranks) on the first
    GPU. Only for a Foundry launch."""
    req = settings.requested(server_args)
    ranks = int(getattr(server_args, "tp_size", 1) or 1) * int(getattr(server_args, "dp_size", 1) or 1)
    if settings.share_gpu() and (req.enabled or req.config_path is not None) and ranks > 1:
        _declare(server_args, "foundry.share_gpu", gpu_id_step=0)
        logging.getLogger("foundry.sglang").warning(
            "Foundry test aid %s=1: all %d schedulers on GPU %s (they time-slice it: timings mean nothing)",
            settings.SHARE_GPU_ENV,
            ranks,
            getattr(server_args, "base_gpu_id", 0),
        )


def _declare(server_args: Any, source: str, **fields: Any) -> None:
    """Change resolved fields of SGLang's sealed record between its checks and its publication
    (a plain assignment raises there). SGLang 0.5.17 has one mutation point on the record,
    ``ServerArgs.override``, and its launcher reads the record; later releases read the published
    config bags and take decisions declared before publication (``declare_resolution``, projected
    at publish and carried to the schedulers with the record)."""
    override = getattr(type(server_args), "override", None)
    if callable(override):
        server_args.override(source, **fields)
        return
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, source, **fields)


def _share_gpu_env(tp_rank: int) -> None:
    """Under the test aid, two TP ranks on one GPU: torch's symmetric memory refuses a rendezvous of
    ranks on one device unless told, and NCCL refuses two ranks on one GPU of one host, so each rank's
    NCCL is told it runs on a host of its own, over loopback (NCCL only runs eagerly then: every
    collective inside a decode graph goes through torch symmetric memory)."""
    import os

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    os.environ["NCCL_HOSTID"] = f"foundry-share-gpu-rank{tp_rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")


# --- worker hooks ------------------------------------------------------------------------------

_session = None  # this scheduler process's Foundry session
_installing_restored = False  # inside a LOAD's decode-runner capture(), which captures nothing


def _bound(original: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        return inspect.signature(original).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)


def around_scheduler_init(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    global _session
    from foundry_sglang_plugin.session import Session

    bound = _bound(original, self, *args, **kwargs)
    server_args = bound.get("server_args")
    if server_args is not None and _session is None:
        hint = {name: bound.get(name) for name in ("gpu_id", "tp_rank", "dp_rank")}
        if settings.share_gpu() and int(getattr(server_args, "tp_size", 1) or 1) > 1:
            from foundry_sglang_plugin.placement import placement

            _share_gpu_env(placement(hint)[0])
        _session = Session.begin(server_args, hint)
    try:
        if _session is None:
            return original(self, *args, **kwargs)
        from foundry_core.engine.profiling import profiled

        # The scheduler's whole start (model runner, weights, KV pool, the decode-graph phase with
        # SGLang's per-shape preparation), when FOUNDRY_PROFILE_DIR asks for a profile.
        phase = f"sglang-scheduler-start-{_session.mode}"
        with (
            _share_gpu_turn(server_args),
            profiled(phase, _session.rank, logging.getLogger("foundry.sglang")),
        ):
            return original(self, *args, **kwargs)
    except BaseException as e:
        if _session is not None and _session.report.get("ok") is None:
            _session.abort(e)  # anything that ends the scheduler's start-up ends up in the report
        raise


def around_model_runner_init(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    bound = _bound(original, self, *args, **kwargs)
    if _session is None or bound.get("is_draft_worker", False):
        return original(self, *args, **kwargs)
    try:
        _session.enter_region(bound.get("gpu_id"))
        return original(self, *args, **kwargs)
    except BaseException as e:
        _session.abort(e)
        raise


def _share_gpu_turn(server_args: Any) -> contextlib.AbstractContextManager:
    """Under the test aid, data-parallel replicas start their schedulers one at a time. SGLang
    sizes a replica's KV pool from the free memory it measures before and after loading its
    weights; on one shared GPU the other replica's pool, allocated in between, counts as this one's
    weights and leaves it nothing (both DP=2 SAVEs on one H200 died so, at any memory fraction).
    The whole scheduler start is the turn, not the model runner's: SGLang 0.5.17 allocates the KV
    pool after the model runner is built, and one H200 run (6640e28) saw replica 1 measure in that
    gap. Tensor-parallel ranks must start together (they meet in collectives) and are left alone."""
    if (
        server_args is None
        or not settings.share_gpu()
        or int(getattr(server_args, "dp_size", 1) or 1) < 2
        or int(getattr(server_args, "tp_size", 1) or 1) > 1
    ):
        return contextlib.nullcontext()
    import tempfile
    from pathlib import Path

    return _file_lock(Path(tempfile.gettempdir()) / f"foundry-share-gpu-{server_args.port}.lock")


@contextlib.contextmanager
def _file_lock(path: Any):
    """An exclusive lock that the kernel drops with the process, so a replica that dies holding it
    never blocks the other."""
    import fcntl

    with open(path, "a") as f:
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.perf_counter() - t0
        if waited > 0.5:
            logging.getLogger("foundry.sglang").info(
                "Foundry test aid: waited %.1f s for the other replica's model runner", waited
            )
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def around_resolve_memory_pool_config(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    if _session is None or getattr(self, "is_draft_worker", False):
        return original(self, *args, **kwargs)
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    return _session.pool_config(lambda: original(self, *args, **kwargs), MemoryPoolConfig)


def around_resolve_decode_backend(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    backend = original(runner, *args, **kwargs)
    model_runner = getattr(runner, "model_runner", None)
    if _session is None or getattr(model_runner, "is_draft_worker", False):
        return backend
    from foundry_sglang_plugin.backend import install

    return install(backend, _session)


def _target_runner(runner: Any) -> bool:
    return _session is not None and not getattr(
        getattr(runner, "model_runner", None), "is_draft_worker", False
    )


def around_decode_capture(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """``DecodeCudaGraphRunner.capture``: the setup a LOAD repeats ends here (SAVE marks it, LOAD
    restores the archive), before the runner's warmup and its per-shape capture loop."""
    global _installing_restored
    if not _target_runner(self):
        return original(self, *args, **kwargs)
    # Part of the setup SAVE and LOAD share: allocated before SAVE ends it and before LOAD restores.
    _session.allocate_logits_gather(self.model_runner)
    _session.capture_begins()
    _installing_restored = _session.mode == "load"
    try:
        result = original(self, *args, **kwargs)
    finally:
        _installing_restored = False
    _session.capture_done()
    return result


def around_freeze_gc(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``freeze_gc``, the context SGLang wraps its capture loop in: a full ``gc.collect()`` on entry
    and another on exit (about 1.1 s for a 28-layer model's process), so that no collection frees a
    tensor while a graph is being captured. A LOAD's decode runner captures nothing inside it (the
    loop installs restored graphs), so there the two collections are skipped; every other use of
    the context (SAVE, stock, prefill runners) is SGLang's own."""
    if _installing_restored:
        return contextlib.nullcontext()
    return original(*args, **kwargs)


def around_runner_warmup(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """``BaseRunner.warmup``. SGLang warms up once per process, normally in ``EagerRunner.__init__``,
    which runs *before* the decode capture: that warmup is part of the setup and runs at LOAD too (its
    allocations must retrace SAVE's). A warmup that would run after the capture began is skipped at
    LOAD: what it created lazily at SAVE came back with the archive."""
    if not _target_runner(self):
        return original(self, *args, **kwargs)
    if _session.mode == "load" and _session.capture_started:
        return None
    from foundry_sglang_plugin import deep_gemm_budget

    # The warmup's first DeepGEMM MoE call sizes SGLang's layout budget from free memory.
    return deep_gemm_budget.around_step(_session, "warmup", lambda: original(self, *args, **kwargs))


def around_refresh_deep_gemm_budget(original: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """``refresh_deep_gemm_layout_memory_budget``: the pre-capture refresh is pinned to SAVE's value
    (:mod:`.deep_gemm_budget`); the one after the start (``only_if_initialized``) is SGLang's own."""
    if (
        _session is None
        or getattr(model_runner, "is_draft_worker", False)
        or kwargs.get("only_if_initialized")
        or _session.capture_started
    ):
        return original(model_runner, *args, **kwargs)
    from foundry_sglang_plugin import deep_gemm_budget

    return deep_gemm_budget.around_step(_session, "capture", lambda: original(model_runner, *args, **kwargs))


def around_init_cuda_graphs(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    if _session is None or getattr(self, "is_draft_worker", False):
        return original(self, *args, **kwargs)
    try:
        result = original(self, *args, **kwargs)
    except BaseException as e:
        _session.abort(e)
        raise
    _session.finish()
    return result


def _tp_session() -> Any:
    return _session if _session is not None and _session.tp is not None else None


def around_symm_communicator_init(
    original: Any, self: Any, group: Any, device: Any, *args: Any, **kwargs: Any
) -> Any:
    """``TorchSymmMemCommunicator.__init__`` under tensor parallelism: Foundry's placed buffer."""
    session = _tp_session()
    if session is None:
        return original(self, group, device, *args, **kwargs)
    session.init_symm_communicator(self, group, device)
    return None


def around_symm_all_reduce(original: Any, self: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
    """``TorchSymmMemCommunicator.all_reduce`` under tensor parallelism: the one-shot kernel, which
    needs no NVLink multicast, on Foundry's buffer."""
    session = _tp_session()
    if session is None or args:
        return original(self, inp, *args, **kwargs)
    return session.symm_all_reduce(self, inp, out=kwargs.get("out"))


def around_logits_gather(original: Any, self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``MultimemAllGatherer.__call__`` (the logits all-gather) under tensor parallelism: through
    Foundry's buffer where ``x`` fits it; otherwise SGLang's NCCL gather, as SGLang falls back to
    without multicast, never its own lazily allocated symmetric buffer."""
    session = _tp_session()
    if session is None:
        return original(self, x, *args, **kwargs)
    gathered = session.gather_logits(x)
    if gathered is not None:
        return gathered
    from sglang.srt.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x, dim=-1)


def after_process_batch_result(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """``Scheduler.process_batch_result``: SAVE keeps saving the kernels SGLang builds at its first
    requests (the server warmup runs the first prefill) into the carried caches; LOAD says what its
    first batch built although the caches were handed over."""
    if _session is not None and _session.mode in ("save", "load"):
        _session.caches.served(_session.device)


LAUNCHER_HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", after_add_cli_args, "AFTER"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", after_from_cli_args, "AFTER"),
    ("sglang.srt.server_args.ServerArgs.check_server_args", before_check_server_args, "BEFORE"),
    ("sglang.srt.server_args.ServerArgs.check_server_args", after_check_server_args, "AFTER"),
)
ENGINE_HOOK = ("sglang.srt.entrypoints.engine.Engine.__init__", around_engine_init, "AROUND")
WORKER_HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.__init__", around_scheduler_init, "AROUND"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.__init__", around_model_runner_init, "AROUND"),
    (
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config",
        around_resolve_memory_pool_config,
        "AROUND",
    ),
    (
        "sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend",
        around_resolve_decode_backend,
        "AROUND",
    ),
    (
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture",
        around_decode_capture,
        "AROUND",
    ),
    ("sglang.srt.model_executor.runner.base_runner.BaseRunner.warmup", around_runner_warmup, "AROUND"),
    (
        "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.refresh_deep_gemm_layout_memory_budget",
        around_refresh_deep_gemm_budget,
        "AROUND",
    ),
    (
        "sglang.srt.model_executor.runner.base_cuda_graph_runner.freeze_gc",
        around_freeze_gc,
        "AROUND",
    ),
    (
        "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",
        around_init_cuda_graphs,
        "AROUND",
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
        after_process_batch_result,
        "AFTER",
    ),
    (
        "sglang.srt.distributed.device_communicators.torch_symm_mem.TorchSymmMemCommunicator.__init__",
        around_symm_communicator_init,
        "AROUND",
    ),
    (
        "sglang.srt.distributed.device_communicators.torch_symm_mem.TorchSymmMemCommunicator.all_reduce",
        around_symm_all_reduce,
        "AROUND",
    ),
    (
        "sglang.srt.distributed.device_communicators.triton_symm_mem_ag.MultimemAllGatherer.__call__",
        around_logits_gather,
        "AROUND",
    ),
)
