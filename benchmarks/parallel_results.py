"""One result file for a multi-GPU run (issues 16 and 17: ``tp2-h200x2.json``, ``tp4-h200x4.json``),
built here on the CPU from the results the device calls wrote; it measures nothing.

    python benchmarks/parallel_results.py --out benchmarks/results/tp2-h200x2.json \\
        --core benchmarks/results/tp-h200x2.json \\
        --engine sglang_tp=benchmarks/results/tp2-sglang-h200x2.json \\
        --engine sglang_dp=benchmarks/results/dp2-sglang-h200x2.json \\
        --engine vllm_tp=benchmarks/results/tp2-vllm-h200x2.json

``--core`` is ``foundry tp --reproduce --out`` (the embedded decoder, ``benchmarks/run_h200_core.sh``
with ``CORE_PARTS=tp``); each ``--engine LABEL=FILE`` is a result of the former ``benchmarks/cold_start.py``
(SAVE, then LOAD in fresh processes; ``ranks`` holds every rank's start report). A part is ``ok``
when every rank restored with no decode capture, no NCCL kernel in its graphs, and outputs equal
to SAVE's (logits for the core; greedy tokens and top-5 logprobs for an engine, which answers as
one server); an engine part whose SAVE was refused at startup is ``refused`` with the engine's line.

The core part on ``nvidia-h200-x2`` (and ``nvidia-h200-x4`` with 4 ranks; ``FOUNDRY_COMMIT`` as
usual):

    CORE_PARTS=tp bash benchmarks/run_h200_core.sh                     # -> tp-h200x2.json

The engine parts have no script in the tree now: ``benchmarks/sxs.py``, which replaced
``cold_start.py`` and ``run_cold_h200.sh`` (removed in a660f93; read them with ``git show
a660f93^:benchmarks/cold_start.py``), starts one-GPU servers only and has no TP or DP option. An
engine part is a JSON in that script's format, the fields :func:`engine_part` reads: ``runs.save``
(``ok``, ``log_tail``), ``tokens_identical_to_save``, ``logprobs_identical_to_save``, the ready times
and per rank its start report in ``ranks`` (docs/sglang.md, "Tensor parallelism", has
the server flags: SGLang ``--tp-size 2 --enable-torch-symm-mem --disable-custom-all-reduce
--cuda-graph-bs-decode 8`` or ``--dp-size 2``; vLLM ``--tensor-parallel-size 2
--disable-custom-all-reduce``, refused at startup).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The start of every refusal's one line (foundry_core.engine.refusal.FoundryUnsupportedError)
REFUSAL = "Foundry cannot run this "
RANK_FIELDS = (
    "graphs",
    "load_decode_captures",
    "symm_mem_collectives",
    "nccl_kernels",
    "capture_s",
    "restore_s",
)


def _source(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    return {"file": str(path), **{k: data.get(k) for k in ("date", "commit", "machine", "command")}}


def core_part(data: dict[str, Any]) -> dict[str, Any]:
    """The embedded decoder's ranks as ``foundry tp`` wrote them (logits compared per rank)."""
    ranks = [
        {
            "rank": r.get("rank"),
            **{k: r.get(k) for k in RANK_FIELDS},
            "outputs_identical": r.get("outputs_identical"),
            "ready_s_save": r.get("ready_s_save"),
            "ready_s_load": r.get("ready_s_load"),
        }
        for r in data.get("ranks") or []
    ]
    reproduce = data.get("reproduce") or {}
    return {
        "world_size": data.get("world_size"),
        "share_gpus": data.get("share_gpus"),
        "ranks": ranks,
        "reproduce": {k: reproduce.get(k) for k in ("fingerprints_equal", "offsets_equal")}
        if reproduce
        else None,
        "failed": data.get("failed"),
        "ok": bool(data.get("ok")) and bool(ranks),
    }


def engine_part(data: dict[str, Any]) -> dict[str, Any]:
    """An engine's SAVE and cold LOAD: the server's outputs, every rank's restore."""
    save = (data.get("runs") or {}).get("save") or {}
    identical = [data.get("tokens_identical_to_save"), data.get("logprobs_identical_to_save")]
    outputs = None if None in identical else all(identical)
    ranks = [{**r, "outputs_identical": outputs} for r in data.get("ranks") or []]
    part: dict[str, Any] = {
        "engine": data.get("engine"),
        "engine_version": data.get("engine_version"),
        "ready_s_save": data.get("ready_s_save"),
        "ready_s_load": data.get("ready_s_load_cold"),
        "outputs_identical": outputs,
        "outputs_differ_between_prompts": data.get("outputs_differ_between_prompts"),
        "ranks": ranks,
    }
    if not save.get("ok") and not ranks:
        # A refusal at startup is a finding, not a failure: the plugin's one line says why.
        lines = (save.get("log_tail") or "").splitlines()
        refusal = next((ln.strip() for ln in lines if REFUSAL in ln), None)
        part.update(outcome="refused" if refusal else "failed", reason=refusal or save.get("error"))
        part["ok"] = refusal is not None
        return part
    part["outcome"] = "restored"
    part["ok"] = (
        outputs is True
        and len(ranks) >= 2
        and all(r.get("load_decode_captures") == 0 and r.get("nccl_kernels") == 0 for r in ranks)
    )
    return part


def build(core: Path | None, engines: dict[str, Path], command: str) -> dict[str, Any]:
    sources, parts = [], {}
    if core is not None:
        data = json.loads(core.read_text())
        sources.append(_source(core, data))
        parts["core_tp"] = core_part(data)
    for label, path in engines.items():
        data = json.loads(path.read_text())
        sources.append(_source(path, data))
        parts[label] = engine_part(data)

    def one(key: str) -> Any:
        values = sorted({str(s[key]) for s in sources if s[key] is not None})
        return values[0] if len(values) == 1 else values

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {
        "date": one("date"),
        "commit": one("commit"),
        "machine": one("machine"),
        "command": command,
        "about": "date, commit, machine: of the GPU runs in sources; command and built: this file's "
        "build from them, which measures nothing",
        "built": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit.strip()},
        "sources": sources,
        "parts": parts,
        "all_ok": bool(parts) and all(p.get("ok") for p in parts.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--core", type=Path, help="foundry tp --out result")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="LABEL=FILE",
        help="a result of the former cold_start.py",
    )
    args = p.parse_args(argv)
    engines = {}
    for item in args.engine:
        label, sep, file = item.partition("=")
        if not sep or not label or not file:
            p.error(f"--engine takes LABEL=FILE, not {item!r}")
        engines[label] = Path(file)
    if args.core is None and not engines:
        p.error("give --core and/or --engine")
    argv = sys.argv[1:] if argv is None else argv
    result = build(args.core, engines, " ".join(["python benchmarks/parallel_results.py", *argv]))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for label, part in result["parts"].items():
        ranks = ", ".join(
            f"rank {r['rank']}: captures {r['load_decode_captures']}, symm-mem {r['symm_mem_collectives']}, "
            f"NCCL {r['nccl_kernels']}"
            for r in part.get("ranks") or []
        )
        print(f"{label}: {'ok' if part['ok'] else 'NOT ok'} ({part.get('outcome', 'restored')}) {ranks}")
    print(f"all ok: {result['all_ok']}; written to {args.out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
