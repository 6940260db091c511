"""The Foundry flags on vLLM's own argument parser, and the step from flags to engine configuration.

Three methods of ``vllm.engine.arg_utils.EngineArgs`` are wrapped (once per process, by
:func:`foundry_vllm_plugin.register`); with Foundry off each wrapper calls straight through:

* ``add_cli_args``: appends a ``Foundry`` argument group (``--enable-foundry``, ``--foundry-config``).
  ``vllm serve`` builds its parser through ``AsyncEngineArgs.add_cli_args``, which loads the general
  plugins first for exactly this purpose, so the flags are on the parser it uses.
* ``from_cli_args``: turns the two flags into the ``additional_config`` entry (see ``settings``).
* ``create_engine_config``: when the entry is present, asks vLLM for ``FULL_DECODE_ONLY`` graphs
  and for the Inductor settings a bit-exact LOAD needs (``foundry_core.engine.inductor``), points
  the compile caches at private folders (:func:`launch_caches`), builds the config as usual,
  refuses unsupported configurations (``check_supported``) before any GPU work, and points vLLM at
  the Foundry worker class.
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any

from foundry_vllm_plugin import settings
from foundry_vllm_plugin.support import (
    FOUNDRY_CUDAGRAPH_MODE,
    FOUNDRY_WORKER,
    VLLM_GPU_WORKER,
    FoundryUnsupportedError,
    check_supported,
)

logger = logging.getLogger("vllm.foundry")  # under vLLM's logger: same handlers and level

_MARK = "__foundry_wrapped__"
GROUP_TITLE = "Foundry"


def add_foundry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Foundry flags to a parser (a no-op when they are already there)."""
    if "--enable-foundry" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Persist full decode CUDA graphs once (SAVE) and restore them at later starts (LOAD).",
    )
    group.add_argument(
        "--enable-foundry",
        action="store_true",
        default=False,
        help="Save or restore CUDA graphs with Foundry (mode save|load|auto from the Foundry config).",
    )
    group.add_argument(
        "--foundry-config",
        type=str,
        default=None,
        metavar="PATH",
        help="Foundry TOML file (mode, archive_dir, [region]); defaults to $FOUNDRY_CONFIG.",
    )
    return parser


def prepare_engine_args(engine_args: Any) -> None:
    """Before vLLM builds the config: refuse a vLLM release outside the tested range unless the
    configuration allows it (``foundry_core.engine.release``); request FULL_DECODE_ONLY graphs
    unless the user chose a mode, and compile with the Inductor settings under which a LOAD's
    compiled code computes what the SAVE's did (``foundry_core.engine.inductor``; they enter vLLM's
    compile-cache key, SAVE and LOAD alike). A user setting that contradicts them is kept, and
    refused by ``check_supported``."""
    from foundry_core.engine import inductor, release

    release.gate("vllm", settings.foundry_config(engine_args.additional_config), logger)

    cc = engine_args.compilation_config
    if isinstance(cc, dict):
        cc.setdefault("cudagraph_mode", FOUNDRY_CUDAGRAPH_MODE)
        inductor_config = cc.setdefault("inductor_compile_config", {})
    else:
        if getattr(cc, "cudagraph_mode", None) is None:
            from vllm.config.compilation import CUDAGraphMode

            cc.cudagraph_mode = CUDAGraphMode[FOUNDRY_CUDAGRAPH_MODE]
        inductor_config = cc.inductor_compile_config
    inductor.pin(inductor_config)  # a user's contrary setting stays: check_supported refuses it


def refuse_without_cuda() -> None:
    """Up front, before vLLM builds its config for a Foundry start: a machine where vLLM found no
    CUDA device (its platform is the CPU one, or none) is refused in one line, rather than going on
    to a worker that fails in its first CUDA call."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return
    kind = getattr(current_platform, "device_type", "") or "unspecified"
    raise FoundryUnsupportedError(
        "no CUDA device", f"vLLM runs on its {kind!r} platform here, and Foundry persists CUDA graphs only"
    )


def finalize_engine_config(vllm_config: Any) -> Any:
    """After vLLM built the config: refuse what Foundry cannot persist, then install the Foundry worker."""
    cfg = settings.foundry_config(vllm_config.additional_config)
    check_supported(vllm_config)
    if cfg.mode == "save":  # auto decides per rank in the worker; a failed SAVE there serves on
        from foundry_core.engine import decide

        problem = decide.archive_dir_problem(cfg)
        if problem is not None:
            raise settings.ConfigError(f"Foundry: {problem}; mode = save cannot go on")
    pc = vllm_config.parallel_config
    if pc.worker_cls in ("auto", VLLM_GPU_WORKER):
        pc.worker_cls = FOUNDRY_WORKER
    elif pc.worker_cls != FOUNDRY_WORKER:  # pragma: no cover - check_supported refuses it first
        raise FoundryUnsupportedError(f"worker_cls={pc.worker_cls}", "a custom worker cannot be hooked")
    logger.info(
        "Foundry enabled: config %s, mode %s, archive %s (auto is resolved per rank in the worker)",
        cfg.source,
        cfg.mode,
        cfg.archive_dir,
    )
    if cfg.mode == "save":
        # What this process (the API server, done with its imports) read to start, for a LOAD to
        # read ahead beside the workers' lists (they record their own once the archive is written).
        from foundry_core.engine import readahead

        readahead.record_later(cfg.archive_dir, "api-server", log=logger)
    return vllm_config


def launch_caches(additional_config: Any) -> None:
    """Before vLLM builds the config, in the process that will start the engine core: private
    compile-cache folders that the engine-core process inherits (in place before it imports
    FlashInfer or Inductor, which read their folder once), and, for a LOAD, vLLM's model-inspection
    records from the carried caches: without them vLLM inspects the model class in a subprocess that
    imports the engine (about 20 s of a cold start on an H200 machine). With them, the settings of
    ``session.launch_settings`` where the user set nothing."""
    from foundry_core.engine import redirect_for_launch
    from foundry_vllm_plugin.session import CACHE_KINDS, LAUNCHER_RECORDS, engine_facts, launch_settings

    cfg = settings.foundry_config(additional_config)
    redirect_for_launch(
        cfg,
        CACHE_KINDS,
        engine=engine_facts(),
        launcher_records=LAUNCHER_RECORDS,
        settings=launch_settings(),
        log=logger,
    )


def _wrap_add_cli_args(orig):
    @functools.wraps(orig)
    def add_cli_args(parser, *args, **kwargs):
        parser = orig(parser, *args, **kwargs)
        return add_foundry_args(parser)

    setattr(add_cli_args, _MARK, True)
    return add_cli_args


def _wrap_from_cli_args(orig):
    @functools.wraps(orig)
    def from_cli_args(cls, args: argparse.Namespace):
        engine_args = orig(cls, args)
        try:
            entry = settings.entry_from_flags(
                bool(getattr(args, "enable_foundry", False)), getattr(args, "foundry_config", None)
            )
            if entry is not None:
                extra = engine_args.additional_config
                if extra is None:
                    extra = {}
                if not isinstance(extra, dict):
                    raise settings.ConfigError("--enable-foundry needs additional_config to be a JSON object")
                engine_args.additional_config = {**extra, settings.ADDITIONAL_CONFIG_KEY: entry}
        except settings.ConfigError as e:  # a bad flag pair or TOML: one line at `vllm serve`'s end
            from foundry_core.engine import exiting

            raise exiting(e) from None
        return engine_args

    setattr(from_cli_args, _MARK, True)
    return from_cli_args


def _wrap_create_engine_config(orig):
    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        entry = settings.foundry_entry(self.additional_config)
        if entry is None:
            # An engine built after a Foundry one in this process compiles where it would alone.
            from foundry_core.engine import undo_launch_redirect

            undo_launch_redirect()
            return orig(self, *args, **kwargs)
        from foundry_core.engine import exiting

        try:
            # Validate the TOML before any work and pin its absolute path (stable across SAVE and LOAD).
            self.additional_config = {
                **self.additional_config,
                settings.ADDITIONAL_CONFIG_KEY: settings.make_entry(entry["config"]),
            }
            refuse_without_cuda()
            prepare_engine_args(self)
            launch_caches(self.additional_config)
            config = orig(self, *args, **kwargs)
            return finalize_engine_config(config)
        except settings.ConfigError as e:  # FoundryUnsupportedError too: one line at `vllm serve`'s end
            raise exiting(e) from None

    setattr(create_engine_config, _MARK, True)
    return create_engine_config


def _plain_function(cls: type, name: str, kind: type) -> Any:
    """The function behind ``cls.<name>`` when vLLM defines it there as ``kind`` (staticmethod,
    classmethod or a plain function: ``None``); raises ``TypeError`` for any other layout."""
    attr = cls.__dict__.get(name)
    if kind is type(None):
        if not callable(attr) or isinstance(attr, (staticmethod, classmethod)):
            raise TypeError(f"{cls.__name__}.{name} is no longer a method")
        return attr
    if not isinstance(attr, kind):
        raise TypeError(f"{cls.__name__}.{name} is no longer a {kind.__name__}")
    return attr.__func__


def install(arg_utils: Any) -> bool:
    """Wrap ``EngineArgs`` in an imported ``vllm.engine.arg_utils``; returns False if already done or
    when this vLLM's ``EngineArgs`` does not have the layout the wrappers expect. Never raises: vLLM's
    plugin loader does not catch, and a failure here would stop every vLLM process, Foundry on or off.
    All three methods are wrapped, or none (the flags without the config step would be ignored)."""
    try:
        cls = arg_utils.EngineArgs
        if getattr(cls.__dict__.get("create_engine_config"), _MARK, False):
            return False
        add_fn = _plain_function(cls, "add_cli_args", staticmethod)
        from_cli_fn = _plain_function(cls, "from_cli_args", classmethod)
        create_fn = _plain_function(cls, "create_engine_config", type(None))
        wrapped = (
            staticmethod(_wrap_add_cli_args(add_fn)),
            classmethod(_wrap_from_cli_args(from_cli_fn)),
            _wrap_create_engine_config(create_fn),
        )
    except Exception as e:
        logger.warning(
            "Foundry: not installed in this vLLM (%s: %s); --enable-foundry is not available",
            type(e).__name__,
            e,
        )
        return False
    cls.add_cli_args, cls.from_cli_args, cls.create_engine_config = wrapped
    return True


def installed(arg_utils: Any) -> bool:
    cls = getattr(arg_utils, "EngineArgs", None)
    return bool(getattr(getattr(cls, "__dict__", {}).get("create_engine_config"), _MARK, False))
