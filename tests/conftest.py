import logging

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
