"""A restored graph's replay on the host: the launch alone, on the current stream (no GPU: the driver
call is replaced by a recorder; the objects around it are the real ones)."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.driver")

from cuda.bindings import driver  # noqa: E402

from foundry_core import api, graph_build, restored  # noqa: E402
from foundry_core.driver import CudaError  # noqa: E402


class _Launches:
    def __init__(self):
        self.calls = []
        self.result = driver.CUresult.CUDA_SUCCESS

    def __call__(self, exec_, stream):
        self.calls.append((exec_, int(stream)))
        return (self.result,)


def _restored(streams):
    rebuilt = graph_build.Rebuilt(graph=None, exec_="exec-handle", events=[], keepalive=[])
    rebuilt._launch = launches = _Launches()
    graph = api.RestoredGraph("decode_bs8", rebuilt, 0, None, 3)
    graph._current_stream = lambda device: streams[-1]
    return graph, rebuilt, launches


def test_replay_launches_on_the_current_stream_and_becomes_the_launch_alone():
    streams = [11]
    graph, rebuilt, launches = _restored(streams)
    assert "replay" not in vars(graph)
    graph.replay()
    assert launches.calls == [("exec-handle", 11)]
    fast = vars(graph)["replay"]  # later replays skip the method's checks
    graph.replay()
    streams.append(12)  # the engine switched streams: the launch follows
    graph.replay()
    assert launches.calls == [("exec-handle", 11), ("exec-handle", 11), ("exec-handle", 12)]
    assert vars(graph)["replay"] is fast


def test_a_failed_launch_raises_with_the_drivers_error_name():
    graph, _, launches = _restored([11])
    graph.replay()
    launches.result = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        graph.replay()


def test_destroy_takes_the_launch_back():
    graph, rebuilt, launches = _restored([11])
    graph.replay()
    rebuilt.exec = None  # as destroy() leaves it (and so that it calls no driver here)
    graph._destroy()
    assert "replay" not in vars(graph)
    graph.replay()  # the method again, with the destroyed executable: the driver is asked with None
    assert launches.calls[-1][0] is None


def test_a_graph_with_random_state_keeps_its_bookkeeping_on_every_replay(monkeypatch):
    rebuilt = graph_build.Rebuilt(graph=None, exec_="exec-handle", events=[], keepalive=[])
    rebuilt._launch = launches = _Launches()
    graph = api.RestoredGraph.__new__(api.RestoredGraph)
    graph.name, graph.device, graph.nodes = "sampled", 0, 3
    graph._rebuilt, graph._pending, graph.waited_s = rebuilt, None, 0.0
    graph._rng = {"increment": 4}
    graph._current_stream = lambda device: 11
    published = []

    class _Gen:
        offset = 8

        def get_offset(self):
            return self.offset

        def set_offset(self, value):
            self.offset = value

        def initial_seed(self):
            return 1234

    gen = _Gen()

    class _Cell:
        def __init__(self, what):
            self.what = what

        def fill_(self, value):
            published.append((self.what, value))

    graph._seed, graph._offset = _Cell("seed"), _Cell("offset")

    class _Torch:
        class cuda:
            default_generators = [gen]

    monkeypatch.setattr(restored, "_torch", lambda: _Torch)
    graph.replay()
    graph.replay()
    assert "replay" not in vars(graph)
    assert published == [("seed", 1234), ("offset", 8), ("seed", 1234), ("offset", 12)]
    assert gen.offset == 16 and len(launches.calls) == 2
