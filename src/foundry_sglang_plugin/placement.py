"""Where a scheduler process sits: its tensor-parallel rank, data-parallel replica and GPU.

SGLang 0.5.17 passed placement to ``Scheduler.__init__`` as arguments (``gpu_id``, ``tp_rank``,
``dp_rank``); from 0.5.2x on ``Scheduler(server_args, port_args)`` takes none, and the process entry
(``run_scheduler_process``) publishes them in the runtime context first (``publish(..., ranks=
SpawnRanks(...))``): ``get_parallel().tp_rank`` / ``.dp_rank`` and ``get_device().gpu_id``.

A rank picks the archive a scheduler saves or loads, so it is never guessed: where neither the
arguments nor the runtime context say it, the start stops with one line (a rank-1 scheduler that took
rank 0 would overwrite or restore rank 0's graphs).
"""

from __future__ import annotations

from typing import Any


class PlacementError(RuntimeError):
    """This scheduler's placement cannot be read; the message is one line."""


def placement(hint: dict[str, Any]) -> tuple[int, int | None, int]:
    """(tp_rank, dp_rank or None without data parallelism, gpu_id) of this scheduler process.

    ``hint``: what ``Scheduler.__init__`` was called with (0.5.17), None where it has no such argument.
    """
    tp_rank, dp_rank, gpu_id = hint.get("tp_rank"), hint.get("dp_rank"), hint.get("gpu_id")
    if tp_rank is None or gpu_id is None:
        tp_rank, dp_rank, gpu_id = _from_runtime_context(tp_rank, dp_rank, gpu_id)
    if tp_rank is None or gpu_id is None:
        raise PlacementError(
            "Foundry: SGLang published no tensor-parallel rank or GPU for this scheduler "
            f"(tp_rank={tp_rank}, gpu_id={gpu_id}); cannot pick its archive"
        )
    return int(tp_rank), (None if dp_rank is None else int(dp_rank)), int(gpu_id)


def _from_runtime_context(tp_rank: Any, dp_rank: Any, gpu_id: Any) -> tuple[Any, Any, Any]:
    try:
        from sglang.srt.runtime_context import get_device, get_parallel
    except ImportError:
        return tp_rank, dp_rank, gpu_id  # a release that passes placement as arguments only
    parallel = get_parallel()
    try:
        if tp_rank is None:
            tp_rank = parallel.tp_rank
        if dp_rank is None:
            dp_rank = parallel.dp_rank  # None: no data-parallel controller
        if gpu_id is None:
            gpu_id = get_device().gpu_id
    except (AttributeError, RuntimeError, ValueError) as e:  # nothing published for this process
        first = str(e).split(". ")[0].strip()
        raise PlacementError(
            f"Foundry: this scheduler's placement is not in SGLang's runtime context ({first}); "
            "cannot pick its archive"
        ) from None
    return tp_rank, dp_rank, gpu_id
