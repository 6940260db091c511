"""Tensor parallelism through torch symmetric memory, for an engine's decode graphs: one rank's share.

The TP contract (docs/sglang.md, "Tensor parallelism"): inside a decode graph, ranks talk only
through torch symmetric memory, allocated at fixed addresses before capture, so that a LOAD in fresh
processes maps it where SAVE did and the graphs' pointers hold (``foundry_core.symmetric``). NCCL
kernels in a graph are refused at SAVE. Two collectives are used, both with torch's one-shot
all-reduce kernel, which reads every rank's buffer through ordinary peer mappings and needs no
NVLink multicast (off on the lent H200 machines; ``foundry tp`` restored it bit-exact there):

* :meth:`SymmetricTP.all_reduce`: the row-parallel sums (attention output, MLP, embedding);
* :meth:`SymmetricTP.gather_last_dim`: the vocabulary-parallel logits gathered along their last
  dimension, as a sum: each rank writes its shard into its own columns of a buffer whose other
  columns stay zero, so the sum of the ranks' buffers is the gathered tensor, exactly (adding zeros
  changes no value; a -0.0 logit becomes +0.0).

An engine adapter allocates its buffers through :meth:`SymmetricTP.allocate` at the same point of
its setup in SAVE and LOAD, and hands :attr:`SymmetricTP.buffers` to ``foundry_core.save`` and
``load`` (``symmetric=``).
"""

from __future__ import annotations

from typing import Any

from foundry_core.symmetric import SymmetricBuffer, SymmetricPlacementError, placed


def one_shot_sum(staged: Any, group_name: str) -> Any:
    """Torch's one-shot all-reduce (sum) of ``staged``, a view at the front of a rendezvoused
    symmetric tensor: every rank's buffer at the same offset, read through the peer mappings, between
    an entry and an exit barrier (so a rank may write its buffer again once it returns)."""
    import torch

    return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group_name)


class SymmetricTP:
    """One rank's symmetric buffers and the collectives its decode graphs run through them."""

    def __init__(self, region: Any, rank: int, world_size: int):
        self.region, self.rank, self.world_size = region, rank, world_size
        self.buffers: list[SymmetricBuffer] = []  # what save/load get as symmetric=
        self._gather: dict[str, Any] = {}  # buffer name -> (tensor, group name, rows, width)

    def allocate(self, name: str, numel: int, dtype: Any, device: Any, group_name: str) -> Any:
        """A symmetric tensor of ``numel`` elements, rendezvoused on ``group_name`` (every rank calls
        this at the same point of its setup), mapped at fixed addresses and recorded as ``name``."""
        import torch.distributed._symmetric_memory as symm_mem

        with placed(self.region) as mapped:
            tensor = symm_mem.empty(numel, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(tensor, group_name)
        if not mapped:  # torch reserved it through another path than the one Foundry steers
            raise SymmetricPlacementError(
                f"torch mapped symmetric memory {name!r} without Foundry placing it (its driver table "
                "is not the one this torch build uses)"
            )
        self.buffers.append(SymmetricBuffer.of(handle, name))
        return tensor

    @staticmethod
    def all_reduce(buffer: Any, x: Any, group_name: str, out: Any = None) -> Any:
        """The sum of ``x`` over the ranks: ``x`` staged into the front of ``buffer``, then torch's
        one-shot kernel. Returns ``out`` (filled) or a new tensor shaped as ``x``."""
        staged = buffer[: x.numel()]
        staged.view_as(x).copy_(x)
        summed = one_shot_sum(staged, group_name).view_as(x)
        if out is None:
            return summed
        out.copy_(summed)
        return out

    def allocate_gather(
        self, name: str, rows: int, width: int, dtype: Any, device: Any, group_name: str
    ) -> None:
        """The buffer :meth:`gather_last_dim` uses for up to ``rows`` rows gathered to ``width``
        columns, zeroed (each rank writes only its own columns from then on)."""
        if width % self.world_size:
            raise ValueError(f"gathered width {width} is not a multiple of {self.world_size} ranks")
        tensor = self.allocate(name, rows * width, dtype, device, group_name)
        tensor.zero_()
        self._gather[name] = (tensor, group_name, rows, width)

    def has_gather(self, name: str) -> bool:
        return name in self._gather

    def gather_last_dim(self, name: str, x: Any) -> Any | None:
        """``x`` ([rows, width / world_size], this rank's shard) gathered along its last dimension
        over the ranks, rank order, through buffer ``name``; None where ``x`` does not fit it (the
        caller then gathers as it would without Foundry)."""
        tensor, group_name, rows, width = self._gather[name]
        if (
            x.dim() != 2
            or x.dtype != tensor.dtype
            or not 0 < x.shape[0] <= rows
            or x.shape[1] * self.world_size != width
        ):
            return None
        n, shard = x.shape
        staged = tensor[: n * width]
        staged.view(n, self.world_size, shard)[:, self.rank].copy_(x)
        return one_shot_sum(staged, group_name).view(n, width)
