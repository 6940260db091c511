"""Collective-communication kernels in a captured graph, told apart by their function names.

A multi-GPU decode graph exchanges data between ranks inside the graph. Which library does it
decides whether the graph can be restored: an NCCL kernel reads its communicator's device state,
which NCCL allocates outside the Foundry region and rebuilds differently in every process, so a
graph holding one is refused at SAVE with that reason (before the pointer audit would refuse it
with a less helpful one). Symmetric-memory and custom all-reduce kernels address peer buffers
directly; they are counted per graph, stored in the archive and shown by ``foundry inspect``, so
that a multi-GPU archive says what its graphs communicate with (an engine plugin's TP contract
checks these counts).

Names are matched on parts of the (mangled) function names, which the libraries keep stable: NCCL's
device kernels are ``ncclDevKernel_*`` (``ncclKernel_*`` in older NCCL releases); torch's
symmetric-memory operations (``torch.ops.symm_mem``, CUDASymmetricMemoryOps.cu) launch
``one_shot_all_reduce_kernel``, ``two_shot_all_reduce_kernel`` (and its ``_inplace`` form, also used
for reduce-scatter), ``multimem_all_reduce_kernel``, ``multimem_one_shot_all_reduce_kernel`` and
``multimem_all_gather_kernel``; the custom all-reduce of vLLM and SGLang launches
``cross_device_reduce_1stage`` / ``_2stage``. The symmetric-memory kernels take device-side tables of
the peers' buffer and signal-pad addresses; restoring them needs those tables, and the peer mappings
they name, at the addresses SAVE saw.
"""

from __future__ import annotations

#: kind -> substrings of the function name that mark it. First match wins, in this order.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nccl", ("ncclDevKernel", "ncclKernel")),
    ("custom_all_reduce", ("cross_device_reduce_1stage", "cross_device_reduce_2stage")),
    (
        "symm_mem",
        (
            "one_shot_all_reduce_kernel",
            "two_shot_all_reduce_kernel",
            "multimem_all_reduce_kernel",
            "multimem_one_shot_all_reduce_kernel",
            "multimem_all_gather_kernel",
        ),
    ),
)


def kind_of(name: str) -> str | None:
    """The collective kind of kernel function ``name`` (its mangled name), or None."""
    for kind, marks in KINDS:
        if any(mark in name for mark in marks):
            return kind
    return None


def refusal(kind: str, name: str) -> str | None:
    """Why a graph holding kernel ``name`` of ``kind`` cannot be saved, or None when it can be."""
    if kind == "nccl":
        return (
            f"kernel {name[:120]} is an NCCL collective captured into the graph: its communicator's "
            "device state lives outside the Foundry region and differs in every process; run the "
            "collectives through torch symmetric memory (SGLang: --enable-torch-symm-mem) or keep "
            "tensor parallelism off"
        )
    return None
