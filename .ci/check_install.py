"""Checks one plugin installed alone from its wheel (.ci/packaging.sh): python check_install.py ENGINE WHEELS.

The venv holds foundry-graphs and foundry-graphs-ENGINE installed with --no-deps (no torch, no engine:
this step must be fast), so the declared dependencies are read from the wheels' metadata instead and
compared with the tested range the release gate enforces. Prints one line per check; exit 1 on the first
that fails.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

GROUPS = {"sglang": "sglang.srt.plugins", "vllm": "vllm.general_plugins"}
OLDER = {"sglang": "0.5.17", "vllm": "0.26.0"}  # releases validated before the tested range


def wheel_metadata(wheels: Path, dist: str):
    (wheel,) = wheels.glob(dist.replace("-", "_") + "-*.whl")
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(z.read(name).decode())


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        sys.exit(1)


def main(engine: str, wheels: Path) -> None:
    other = ({"sglang", "vllm"} - {engine}).pop()
    from foundry_core.engine.release import TESTED

    core = metadata.version("foundry-graphs")
    requires = sorted(wheel_metadata(wheels, f"foundry-graphs-{engine}").get_all("Requires-Dist") or [])
    engine_req = next((r for r in requires if r.split("<")[0].split(">")[0].strip() == engine), "")
    check(f"foundry-graphs=={core}" in requires, f"foundry-graphs-{engine} requires foundry-graphs=={core}")
    wanted = sorted(TESTED[engine].split(","))
    check(sorted(engine_req[len(engine) :].split(",")) == wanted, f"{engine_req!r} is the tested range")
    core_requires = wheel_metadata(wheels, "foundry-graphs").get_all("Requires-Dist") or []
    check(not any(r.startswith((engine, other)) for r in core_requires), "foundry-graphs needs no engine")

    eps = [(ep.name, ep.value, ep.dist.name) for ep in metadata.entry_points(group=GROUPS[engine])]
    check(
        eps == [("foundry_graphs", f"foundry_core.plugin_entry:{engine}", f"foundry-graphs-{engine}")],
        f"{GROUPS[engine]} holds exactly our entry point: {eps}",
    )
    check(not list(metadata.entry_points(group=GROUPS[other])), f"nothing registered in {GROUPS[other]}")
    commands = sorted(ep.name for ep in metadata.entry_points(group="foundry_graphs.commands"))
    check(commands == ["bench", "demo", "soak", "tp"], f"foundry_graphs.commands: {commands}")
    check(importlib.util.find_spec(f"foundry_{other}_plugin") is None, f"the {other} plugin is not installed")
    spec = importlib.util.find_spec(f"foundry_{engine}_plugin")
    check(spec is not None and sys.prefix in spec.origin, f"foundry_{engine}_plugin from the venv")

    # pip's own reading of the range: an engine release outside it (a stand-in record of the older
    # release) is named as a broken requirement of ours.
    old = OLDER[engine]
    record = Path(sysconfig.get_paths()["purelib"]) / f"{engine}-{old}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {engine}\nVersion: {old}\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    shutil.rmtree(record)
    check(
        f"foundry-graphs-{engine} {core} has requirement {engine}" in pip.stdout
        and f"but you have {engine} {old}" in pip.stdout,
        f"pip check refuses {engine} {old} for foundry-graphs-{engine}",
    )

    # The engine is missing here: its entry point must log one line and return, never raise.
    (ep,) = metadata.entry_points(group=GROUPS[engine])
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlib.metadata import entry_points as e\n"
            f"(p,) = e(group={GROUPS[engine]!r})\n"
            "p.load()()",
        ],
        capture_output=True,
        text=True,
    )
    check(
        run.returncode == 0 and "Traceback" not in run.stderr,
        f"entry point runs without raising: {run.stderr.strip()!r}",
    )
    help_text = subprocess.run(["foundry", "--help"], capture_output=True, text=True, check=True).stdout
    check("demo" in help_text, "foundry --help lists demo")
    demo = subprocess.run(["foundry", "demo", "--help"], capture_output=True, text=True)
    check(demo.returncode == 0 and demo.stdout.startswith("usage: foundry demo"), "foundry demo --help")

    # The site hook (setup.py): at the top of site-packages, where Python runs it at start; it
    # imports nothing of Foundry's without --foundry-config, and with one (here, a file that is not
    # there) the interpreter starts without an error line either way.
    hook = Path(sysconfig.get_paths()["purelib"]) / "foundry_graphs_early.pth"
    check(hook.is_file(), f"{hook.name} installed into site-packages")
    probe = "import sys; print(any(m.startswith('foundry_core') for m in sys.modules))"
    for args, imported in (([], "False"), (["--foundry-config", "/nonexistent/foundry.toml"], "True")):
        run = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
        check(
            run.stdout.strip() == imported and not run.stderr,
            f"site hook with {args or 'no arguments'}: foundry_core imported {run.stdout.strip()}, "
            f"stderr {run.stderr.strip()!r}",
        )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
