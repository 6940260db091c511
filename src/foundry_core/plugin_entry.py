"""The engines' door to Foundry: the targets of the ``foundry_graphs`` entry points.

``foundry-graphs-sglang`` registers ``foundry_graphs = foundry_core.plugin_entry:sglang`` in
``sglang.srt.plugins`` and ``foundry-graphs-vllm`` registers ``foundry_graphs =
foundry_core.plugin_entry:vllm`` in ``vllm.general_plugins``. The targets live here, in a module only
Foundry's own distributions ship, and not in the plugin packages themselves, because another
distribution may ship a module of the plugin's name: upstream Foundry (``foundry-core`` on the
registry) installs a top-level ``foundry_sglang_plugin`` too. With both installed, which one
``import foundry_sglang_plugin`` finds depends on the path order, and either engine plugin would fail
on the other's code. So before importing the plugin, :func:`foreign_owner` asks the distribution
metadata who else provides its module; if anyone does, the start goes on without Foundry's plugin and
says so in one line naming both distributions.

Nothing here raises into the engine's plugin loader (vLLM's does not catch exceptions; SGLang's logs
a traceback): any failure becomes one logged line. The plugin is imported by name from
:data:`PLUGINS`, only in the engine that loads it (an SGLang process never imports the vLLM plugin).
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from typing import NamedTuple

logger = logging.getLogger("foundry.plugin")


class Plugin(NamedTuple):
    group: str  # the engine's entry-point group
    module: str  # the top-level module holding register()
    distribution: str  # the distribution of ours that ships it


PLUGINS = {
    "sglang": Plugin("sglang.srt.plugins", "foundry_sglang_plugin", "foundry-graphs-sglang"),
    "vllm": Plugin("vllm.general_plugins", "foundry_vllm_plugin", "foundry-graphs-vllm"),
}
#: Distributions that may ship our plugin modules: the plugin packages, and the single-project
#: development install (``pip install -e .`` of a checkout from before the split).
OURS = frozenset({"foundry-graphs", "foundry-graphs-sglang", "foundry-graphs-vllm"})

_reported: set[str] = set()


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _provides(dist: metadata.Distribution, module: str) -> bool:
    """Whether ``dist`` installs the top-level module or package ``module`` (its metadata says so)."""
    top_level = dist.read_text("top_level.txt")
    if top_level is not None and module in top_level.split():
        return True
    for path in dist.files or ():
        if path.parts and path.parts[0] in (module, f"{module}.py"):
            return True
    return False


def foreign_owner(engine: str) -> str | None:
    """``"<name> <version>"`` of a distribution other than ours that ships the plugin's module and
    plugs it into the engine (an entry point of the engine's group into that module), or None.

    Reads the entry points of the one group (what the engine's loader reads anyway), then only the
    metadata of the distributions they name: cheap enough for every engine process."""
    plugin = PLUGINS[engine]
    for ep in metadata.entry_points(group=plugin.group):
        if ep.value.split(":")[0].split(".")[0] != plugin.module:
            continue
        dist = getattr(ep, "dist", None)
        if dist is None or _normalized(dist.metadata["Name"] or "") in OURS:
            continue
        if _provides(dist, plugin.module):
            return f"{dist.metadata['Name']} {dist.version}"
    return None


def clash_line(engine: str, owner: str) -> str:
    plugin = PLUGINS[engine]
    return (
        f"Foundry: {owner} also installs the module {plugin.module} (and an {engine} plugin); "
        f"{plugin.distribution} cannot run beside it and is not loaded: uninstall one of the two "
        f"(pip uninstall {owner.split()[0]} or pip uninstall {plugin.distribution})"
    )


def report_clash(engine: str) -> bool:
    """Whether another distribution owns the plugin's module; logs the one line once per process."""
    owner = foreign_owner(engine)
    if owner is None:
        return False
    if engine not in _reported:
        _reported.add(engine)
        logger.error("%s", clash_line(engine, owner))
    return True


def _enter(engine: str) -> None:
    try:
        if report_clash(engine):
            return
        importlib.import_module(PLUGINS[engine].module).register()
    except Exception as e:  # never into the engine's plugin loader
        logger.error(
            "Foundry: the %s plugin was not registered (%s: %s); %s starts without Foundry",
            engine,
            type(e).__name__,
            " ".join(str(e).split()),
            engine,
        )


def sglang() -> None:
    """``sglang.srt.plugins`` entry point of ``foundry-graphs-sglang``."""
    _enter("sglang")


def vllm() -> None:
    """``vllm.general_plugins`` entry point of ``foundry-graphs-vllm``."""
    _enter("vllm")
