import errno
import logging
import os

import pytest


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU tests run on the lent H200: pytest -m gpu)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "gpu" in item.keywords:
            if not checked:
                reason, checked = _gpu_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def log_records():
    """``log_records(name, level, logger_level=level)``: the records of logger ``name`` at ``level``
    and above, collected by a handler on that logger itself (the engines may reset the root's
    handlers or stop propagation). Handler and level are put back after the test."""
    attached = []

    def watch(name: str, level: int, logger_level: int | None = None) -> list[logging.LogRecord]:
        records: list[logging.LogRecord] = []
        handler = logging.Handler(level)
        handler.emit = records.append
        logger = logging.getLogger(name)
        attached.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(level if logger_level is None else logger_level)
        return records

    yield watch
    for logger, handler, level in reversed(attached):
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def caches_machine(monkeypatch, tmp_path):
    """For carried-caches tests: a fixed machine fingerprint (``caches_machine["gpu"]`` changes it;
    the real one needs a GPU, exercised by the engine runs on the H200), private cache folders under
    tmp_path, no cache variable inherited from the shell, and no launch redirect left behind."""
    from foundry_core.engine import caches, undo_launch_redirect
    from foundry_core.fingerprint import make_fingerprint

    state = {"gpu": "NVIDIA H200"}

    def fingerprint(device, engine, *, rank=0, world_size=1):
        return make_fingerprint(
            gpu_name=state["gpu"],
            compute_capability="9.0",
            sm_count=132,
            driver_version=13000,
            cuda_version="13.0",
            torch_version="2.11.0+cu130",
            rank=rank,
            world_size=world_size,
            model=caches.model_facts(engine),
        )

    monkeypatch.setattr(caches, "fingerprint", fingerprint)
    monkeypatch.setenv(caches.ROOT_ENV, str(tmp_path / "private"))
    for kind in caches.KINDS.values():
        for name in kind.envs:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(caches.DIR_ENV, raising=False)
    for name in caches.PGO_JOB_ENVS:
        monkeypatch.delenv(name, raising=False)
    yield state
    undo_launch_redirect()
    if os.environ.get(caches.PGO_JOB_ENVS[0]) == caches.PGO_JOB_ID:  # set by a redirect() in the test
        del os.environ[caches.PGO_JOB_ENVS[0]]
    caches.sync_pgo_job_id()


@pytest.fixture
def full_disk_at_flush(monkeypatch):
    """Call it to make every ``os.fsync`` of a ``*.tmp`` file fail with ENOSPC from then on: a disk
    that fills up while an atomic write flushes its temporary (some file systems, NFS or quotas,
    report a full disk only when flushing)."""

    def fill() -> None:
        real_fsync = os.fsync

        def fsync(fd):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    return fill


@pytest.fixture
def arch(tmp_path):
    """The sample archive of sample_archive.py, SAVEd as rank0: (path, digest)."""
    # Imported here: every test directory loads this conftest, most need no archive module.
    from sample_archive import save

    path = tmp_path / "rank0"
    digest = save(path)
    return path, digest
