"""Where a server's start spends its time: a sampler of every Python process's main-thread stack.

``cold_start.py --sample-stacks`` puts a ``sitecustomize.py`` (written by :func:`write_shim`) first on
every run's PYTHONPATH. Python imports it at start-up in every process of the run (the API server or
launcher, forked engine processes through ``os.register_at_fork``, spawned ones through the path);
with ``FOUNDRY_BENCH_STACKS`` set, it starts a daemon thread that records the main thread's stack
every :data:`INTERVAL_S` seconds into ``<dir>/stacks-<pid>.jsonl``. For the frames of an import in
progress it records the module's name, so that a cold start's import time can be named module by
module. The samples cost a few percent of one core; a run sampled this way is a diagnosis, not a
timing.

``python benchmarks/startup_stacks.py DIR`` prints a timeline of each process (what its main thread
was doing, second by second) and the modules whose imports held the most samples.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

ENV = "FOUNDRY_BENCH_STACKS"
INTERVAL_S = 0.05

# The sampler as it runs in the engine's processes: self-contained, standard library only.
SHIM = r"""
import os as _os

def _foundry_bench_stacks():
    import json, sys, threading, time

    out_dir = _os.environ.get("FOUNDRY_BENCH_STACKS")
    if not out_dir:
        return

    def start():
        main = threading.main_thread().ident
        path = _os.path.join(out_dir, "stacks-%d.jsonl" % _os.getpid())

        def sample():
            with open(path, "a", buffering=1) as f:
                head = {"pid": _os.getpid(), "ppid": _os.getppid(), "argv": sys.argv[:6], "t0": time.time()}
                f.write(json.dumps(head) + "\n")
                while True:
                    time.sleep(INTERVAL_S)
                    frame = sys._current_frames().get(main)
                    stack = []
                    while frame is not None and len(stack) < 60:
                        code = frame.f_code
                        entry = "%s:%s:%d" % (code.co_filename, code.co_name, frame.f_lineno)
                        if code.co_name == "_find_and_load":
                            entry += " import " + str(frame.f_locals.get("name"))
                        stack.append(entry)
                        frame = frame.f_back
                    f.write(json.dumps({"t": round(time.time(), 3), "s": stack}) + "\n")

        threading.Thread(target=sample, name="foundry-bench-stacks", daemon=True).start()

    _os.makedirs(out_dir, exist_ok=True)
    start()
    _os.register_at_fork(after_in_child=start)


INTERVAL_S = %(interval)r
_foundry_bench_stacks()

# A sitecustomize further down the path (the distribution's) still runs.
import sys as _sys
_here = _os.path.dirname(_os.path.abspath(__file__))
for _p in _sys.path:
    _f = _os.path.join(_p or ".", "sitecustomize.py")
    if _os.path.abspath(_p or ".") != _here and _os.path.isfile(_f):
        exec(compile(open(_f).read(), _f, "exec"), {"__name__": "sitecustomize", "__file__": _f})
        break
"""


def write_shim(root: Path) -> Path:
    """The folder to put first on PYTHONPATH."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sitecustomize.py").write_text(SHIM.replace("%(interval)r", repr(INTERVAL_S)))
    return root


def _imports(stack: list[str]) -> list[str]:
    """The modules being imported in one sample, innermost first."""
    return [e.split(" import ", 1)[1] for e in stack if " import " in e]


def _where(stack: list[str]) -> str:
    """One sample in a few words: the imports in progress (outermost and innermost), else the
    innermost frame of the engine's, torch's or Foundry's code, else the innermost frame."""
    imports = _imports(stack)
    if imports:
        return "import " + (imports[-1] if len(imports) == 1 else f"{imports[-1]} > {imports[0]}")
    for entry in stack:
        if any(k in entry for k in ("/vllm/", "/sglang/", "/foundry_", "/torch/")):
            path, func, line = entry.rsplit(":", 2)
            return f"{'/'.join(path.split('/')[-3:])}:{func}:{line}"
    return stack[0] if stack else "(idle)"


def summarize(folder: Path, top: int = 25) -> str:
    lines = []
    for path in sorted(folder.glob("stacks-*.jsonl")):
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if len(rows) < 2:
            continue
        head, samples = rows[0], rows[1:]
        t0 = head["t0"]
        lines.append(f"== pid {head['pid']} (parent {head['ppid']}) {' '.join(head['argv'])[:120]}")
        per_second: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        totals: collections.Counter = collections.Counter()
        for s in samples:
            where = _where(s["s"])
            per_second[int(s["t"] - t0)][where] += 1
            # Imports count inclusively (a module's own import and those it triggers).
            for name in dict.fromkeys(_imports(s["s"])) or [where]:
                totals[name if name == where else "import " + name] += 1
        for second in sorted(per_second):
            where, n = per_second[second].most_common(1)[0]
            lines.append(f"  {second:4d} s  {where}  ({n}/{sum(per_second[second].values())})")
        lines.append("  most samples:")
        for where, n in totals.most_common(top):
            lines.append(f"    {n * INTERVAL_S:6.2f} s  {where}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--top", type=int, default=25)
    opts = p.parse_args()
    print(summarize(opts.folder, opts.top))


if __name__ == "__main__":
    main()
