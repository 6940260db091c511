"""The LOAD thread knobs without a GPU: FOUNDRY_LOAD_THREADS parsing, and the pool helper's order
and failure semantics (results in order; a failure is raised only after every other call is back)."""

import concurrent.futures
import threading
import time

import pytest

from foundry_core import api


def test_load_threads_default_and_env(monkeypatch):
    monkeypatch.delenv("FOUNDRY_LOAD_THREADS", raising=False)
    assert 1 <= api.load_threads() <= 8
    monkeypatch.setenv("FOUNDRY_LOAD_THREADS", "3")
    assert api.load_threads() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("FOUNDRY_LOAD_THREADS", bad)
        with pytest.raises(ValueError, match="FOUNDRY_LOAD_THREADS"):
            api.load_threads()


def test_one_thread_means_no_pool():
    assert api._driver_pool(1) is None
    assert list(api._map(None, lambda x: x * 2, [1, 2, 3])) == [2, 4, 6]


def test_map_keeps_order_on_a_pool():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:

        def slow_for_small(x):
            time.sleep(0.02 * (5 - x))
            return x

        assert list(api._map(pool, slow_for_small, range(5))) == [0, 1, 2, 3, 4]


def test_map_failure_waits_for_every_call():
    started, finished = set(), set()
    lock = threading.Lock()

    def work(x):
        with lock:
            started.add(x)
        if x == 1:
            raise RuntimeError("image 1 refused")
        time.sleep(0.2 if x > 1 else 0)
        with lock:
            finished.add(x)
        return x

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        it = api._map(pool, work, range(6))
        assert next(it) == 0
        with pytest.raises(RuntimeError, match="image 1 refused"):
            next(it)
        # calls not yet started were cancelled; every call that started has returned by now
        with lock:
            assert finished == started - {1}
