"""Tensor parallelism in the SGLang plugin (real SGLang, no GPU): SGLang's symmetric-memory
all-reduce communicator and its logits all-gather set up on Foundry's placed buffers, recorded for
SAVE and LOAD, and the hooks that pass everything through when Foundry runs no TP. Torch symmetric
memory and the one-shot kernel need GPUs: the allocation is stood in for (its placement and the
kernel: tests/test_symmetric_tp.py, tests/gpu/test_tensor_parallel.py)."""

from __future__ import annotations

import dataclasses
import pickle
import types

import pytest
import torch

import foundry_core
from foundry_core.engine import prepare
from foundry_sglang_plugin import hooks
from foundry_sglang_plugin.session import TP_ALL_REDUCE, TP_LOGITS, FoundrySessionError, Session

pytestmark = pytest.mark.sglang

TP_ARGV = [
    "--cuda-graph-backend-prefill",
    "disabled",
    "--tp-size",
    "2",
    "--enable-torch-symm-mem",
    "--disable-custom-all-reduce",
    "--cuda-graph-bs-decode",
    "8",
]


@pytest.fixture
def cfg(foundry_toml, tmp_path):
    from foundry_core.config import load_config

    return dataclasses.replace(load_config(foundry_toml), archive_dir=tmp_path / "archive")


class _TP:
    """Stands in for SymmetricTP: what was allocated, in order, and the gather it was asked for."""

    def __init__(self, rank=1, world_size=2):
        self.rank, self.world_size = rank, world_size
        self.allocated, self.gathers, self.buffers = [], {}, ["record"]

    def allocate(self, name, numel, dtype, device, group_name):
        self.allocated.append((name, numel, dtype, str(device), group_name))
        return torch.zeros(4, dtype=dtype)

    def allocate_gather(self, name, rows, width, dtype, device, group_name):
        self.gathers[name] = (rows, width, dtype, group_name)

    def has_gather(self, name):
        return name in self.gathers

    def gather_last_dim(self, name, x):
        return None if x.shape[0] > self.gathers[name][0] else torch.cat([x, x], dim=-1)

    @staticmethod
    def all_reduce(buffer, x, group_name, out=None):
        return ("summed", group_name, out)


@pytest.fixture
def session(parse, cfg, monkeypatch):
    sa = parse(*TP_ARGV)
    sa.resolve_once()
    s = Session(sa, cfg, "save", rank=1, gpu_id=0)
    s.tp_rank, s.tp_size, s.tp = 1, 2, _TP()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    return s


def _group(name="3"):
    return types.SimpleNamespace(group_name=name)


def test_the_all_reduce_communicator_keeps_its_buffer_without_multicast(session):
    from sglang.srt.distributed.device_communicators.torch_symm_mem import TorchSymmMemCommunicator

    comm = object.__new__(TorchSymmMemCommunicator)
    session.init_symm_communicator(comm, _group(), 0)
    # Sized as SGLang sizes it for capability 9 and two ranks (64 MiB of bfloat16), on Foundry's buffer.
    assert session.tp.allocated == [(f"{TP_ALL_REDUCE}/3", (64 << 20) // 2, torch.bfloat16, "cuda:0", "3")]
    assert comm.disabled is False and comm.max_size == 64 << 20 and comm.world_size == 2
    assert comm.device == torch.device("cuda:0") and comm.dtype == torch.bfloat16
    # SGLang's own eligibility test then picks it for a decode-sized bfloat16 payload on its device
    # (a stand-in tensor: no GPU here), and the sum runs on Foundry's buffer; other payloads are left
    # to SGLang.
    payload = types.SimpleNamespace(
        device=torch.device("cuda:0"), dtype=torch.bfloat16, numel=lambda: 8 * 2048, element_size=lambda: 2
    )
    assert comm.should_torch_symm_mem_allreduce(payload)
    assert session.symm_all_reduce(comm, payload) == ("summed", "3", None)
    assert (
        session.symm_all_reduce(comm, types.SimpleNamespace(**{**vars(payload), "dtype": torch.float32}))
        is None
    )


def test_an_all_reduce_sglang_does_not_size_is_refused(session, monkeypatch):
    from sglang.srt.distributed.device_communicators.torch_symm_mem import TorchSymmMemCommunicator

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    with pytest.raises(
        FoundrySessionError, match="no symmetric-memory all-reduce for compute capability 9 and 3 ranks"
    ):
        session.init_symm_communicator(object.__new__(TorchSymmMemCommunicator), _group(), 0)
    assert session.tp.allocated == []


def test_the_logits_gather_is_sized_by_the_decode_shape_and_the_vocabulary_shard(session, monkeypatch):
    import sglang.srt.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tp_group", lambda: types.SimpleNamespace(cpu_group=_group("5")))
    runner = types.SimpleNamespace(
        model=types.SimpleNamespace(lm_head=types.SimpleNamespace(num_embeddings_per_partition=75968))
    )
    session.allocate_logits_gather(runner)
    session.allocate_logits_gather(runner)  # once
    assert session.tp.gathers == {TP_LOGITS: (8, 151936, torch.bfloat16, "5")}
    x = torch.ones(8, 3, dtype=torch.bfloat16)
    assert session.gather_logits(x).shape == (8, 6)
    assert session.gather_logits(torch.ones(9, 3, dtype=torch.bfloat16)) is None  # a larger eager batch


def test_a_model_without_a_vocabulary_shard_is_refused(session, monkeypatch):
    import sglang.srt.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tp_group", lambda: types.SimpleNamespace(cpu_group=_group()))
    with pytest.raises(FoundrySessionError, match="cannot size the logits gather"):
        session.allocate_logits_gather(types.SimpleNamespace(model=types.SimpleNamespace()))


def test_save_and_load_carry_the_symmetric_records(session, monkeypatch):
    seen = {}
    monkeypatch.setattr(foundry_core, "save", lambda path, **kw: seen.setdefault("save", kw) and "digest")
    session.slots, session.graphs = {"memory_pool_config": {}}, {"decode/size=8": object()}
    session.region = object()
    session._persist()
    assert seen["save"]["symmetric"] == ["record"]

    def load(path, **kw):
        seen["load"] = kw
        raise RuntimeError("stop here")

    monkeypatch.setattr(prepare, "load", load)
    with pytest.raises(RuntimeError, match="stop here"):
        session.restore()
    assert seen["load"]["symmetric"] == ["record"]


def test_the_hooks_pass_everything_through_without_foundry_tp(monkeypatch):
    monkeypatch.setattr(hooks, "_session", None)
    calls = []
    original = lambda self, *a, **kw: calls.append((a, kw)) or "sglang's"  # noqa: E731
    assert hooks.around_symm_communicator_init(original, object(), "g", 0) == "sglang's"
    assert hooks.around_symm_all_reduce(original, object(), "x", out="o") == "sglang's"
    assert hooks.around_logits_gather(original, object(), "x") == "sglang's"
    assert calls == [(("g", 0), {}), (("x",), {"out": "o"}), (("x",), {})]
    monkeypatch.setattr(hooks, "_session", types.SimpleNamespace(tp=None))  # Foundry on, TP=1
    assert hooks.around_logits_gather(original, object(), "x") == "sglang's"


def test_the_hooks_route_through_foundry_under_tp(session, monkeypatch):
    monkeypatch.setattr(hooks, "_session", session)
    session.tp.gathers[TP_LOGITS] = (8, 6, torch.bfloat16, "5")
    never = lambda *a, **kw: pytest.fail("SGLang's own path was taken")  # noqa: E731
    x = torch.ones(8, 3, dtype=torch.bfloat16)
    assert hooks.around_logits_gather(never, object(), x).shape == (8, 6)
    # Too many rows for the graphs' buffer: SGLang's NCCL gather (eager), never its own lazily
    # allocated symmetric buffer.
    import sglang.srt.distributed as dist

    monkeypatch.setattr(dist, "tensor_model_parallel_all_gather", lambda t, dim=-1: ("nccl", t.shape, dim))
    assert hooks.around_logits_gather(never, object(), torch.ones(9, 3, dtype=torch.bfloat16)) == (
        "nccl",
        (9, 3),
        -1,
    )
    comm = types.SimpleNamespace(
        should_torch_symm_mem_allreduce=lambda t: True, buffer="buf", group=_group("7")
    )
    assert hooks.around_symm_all_reduce(never, comm, x, out="o") == ("summed", "7", "o")
    from sglang.srt.distributed.device_communicators.torch_symm_mem import TorchSymmMemCommunicator

    comm = object.__new__(TorchSymmMemCommunicator)
    hooks.around_symm_communicator_init(never, comm, _group(), 0)
    assert comm.disabled is False and session.tp.allocated


def _launcher_gpu_id_step(sa) -> int:
    """The GPU step SGLang's launcher places schedulers with: as the launcher does, resolve, check
    (the hook runs after the check), publish, then read the published device config."""
    from sglang.srt.runtime_context import get_device, publish, restore_context, snapshot_context

    before = snapshot_context()
    try:
        publish(sa, role="tokenizer")
        return get_device().gpu_id_step
    finally:
        restore_context(before)


def _checked(parse, *argv, **kw):
    sa = parse(*argv, **kw)
    sa.resolve_once()
    hooks.after_check_server_args(None, sa)
    return sa


def test_the_share_gpu_test_aid_puts_every_rank_on_one_gpu(parse, monkeypatch):
    from foundry_sglang_plugin import settings

    sa = _checked(parse, *TP_ARGV)
    assert _launcher_gpu_id_step(sa) == 1, "off unless asked for"
    with pytest.raises(AttributeError, match="read-only|after resolution"):
        sa.gpu_id_step = 0  # why the hook declares instead: SGLang seals the checked record
    monkeypatch.setenv(settings.SHARE_GPU_ENV, "1")
    sa = _checked(parse, *TP_ARGV)
    assert _launcher_gpu_id_step(sa) == 0
    stock = _checked(parse, *TP_ARGV, foundry=False)
    assert _launcher_gpu_id_step(stock) == 1, "never for a launch without Foundry"
    dp = _checked(parse, "--cuda-graph-backend-prefill", "disabled", "--dp-size", "2")
    assert _launcher_gpu_id_step(dp) == 0, "data-parallel replicas too"
    assert pickle.loads(pickle.dumps(dp))._resolved_overrides[-1] == (
        "foundry.share_gpu",
        {"gpu_id_step": 0},
    ), "the schedulers, which publish the record they are handed, get the decision too"
    one = _checked(parse, "--cuda-graph-backend-prefill", "disabled")
    assert _launcher_gpu_id_step(one) == 1, "nothing to share with one scheduler"
    for key in (
        "NCCL_HOSTID",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_DISABLE",
        "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES",
    ):
        monkeypatch.delenv(key, raising=False)
    hooks._share_gpu_env(1)
    import os

    assert os.environ["NCCL_HOSTID"] == "foundry-share-gpu-rank1" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1"


def test_the_share_gpu_test_aid_sets_data_parallel_replicas_up_one_at_a_time(parse, monkeypatch, tmp_path):
    import contextlib
    import threading
    import time

    from foundry_sglang_plugin import settings

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    dp = parse("--cuda-graph-backend-prefill", "disabled", "--dp-size", "2")
    assert isinstance(hooks._share_gpu_turn(dp), contextlib.nullcontext), "off unless asked for"
    monkeypatch.setenv(settings.SHARE_GPU_ENV, "1")
    assert isinstance(hooks._share_gpu_turn(parse(*TP_ARGV)), contextlib.nullcontext), (
        "tensor-parallel ranks meet in collectives: never one at a time"
    )
    one = parse("--cuda-graph-backend-prefill", "disabled")
    assert isinstance(hooks._share_gpu_turn(one), contextlib.nullcontext)

    events = []

    def replica(name: str) -> None:
        with hooks._share_gpu_turn(dp):
            events.append(f"{name} in")
            time.sleep(0.3)
            events.append(f"{name} out")

    threads = [threading.Thread(target=replica, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert events == ["a in", "a out", "b in", "b out"], "the second replica waited for the first"
    assert (tmp_path / f"foundry-share-gpu-{dp.port}.lock").exists()


def test_the_share_gpu_turn_covers_the_whole_scheduler_start(parse, monkeypatch, tmp_path):
    """SGLang 0.5.17 allocates a replica's KV pool after its model runner is built: the turn must
    cover the scheduler's whole start, or the other replica measures its free memory in between."""
    import fcntl

    from foundry_sglang_plugin import settings

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setenv(settings.SHARE_GPU_ENV, "1")
    monkeypatch.setattr(hooks, "_session", None)
    session = types.SimpleNamespace(mode="save", rank=0, report={"ok": True})
    monkeypatch.setattr(Session, "begin", staticmethod(lambda server_args, hint: session))
    dp = parse("--cuda-graph-backend-prefill", "disabled", "--dp-size", "2")
    lock = tmp_path / f"foundry-share-gpu-{dp.port}.lock"
    held = []

    def scheduler_init(self, server_args, gpu_id, tp_rank, dp_rank):
        with open(lock, "a") as f:  # another replica's attempt, without waiting
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(True)
            else:
                held.append(False)
                fcntl.flock(f, fcntl.LOCK_UN)

    hooks.around_scheduler_init(scheduler_init, object(), dp, 0, 0, 1)
    assert held == [True], "the other replica could start while this one set up"
