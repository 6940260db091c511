"""SGLang's schedulers forked from the launcher where that is safe, spawned (as SGLang does) elsewhere.

The launch goes through SGLang's real ``Engine._launch_scheduler_processes`` with its real
``ServerArgs``, ``PortArgs`` and published context; only the scheduler function is a stand-in that
reports, from inside the started process, how it started and what it found imported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

from foundry_core import forkserver
from foundry_core.engine import start_method
from foundry_sglang_plugin import sched_start, settings

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def report_start(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer, *rest):
    """A scheduler stand-in: what this process found at its start, sent as SGLang's ready message."""
    import foundry_sglang_plugin

    pipe_writer.send(
        {
            "status": "ready",
            "start_method": mp.current_process()._config.get("start_method")
            or mp.get_start_method(allow_none=True),
            "scheduler_imported": SCHEDULER_MODULE in sys.modules,
            "worker_hooks": (f"{SCHEDULER_MODULE}.Scheduler.__init__", "AROUND")
            in foundry_sglang_plugin._registered,
            "chosen": start_method.chosen(),
            "parent": os.getppid(),
            "preloaded": "colorsys" in sys.modules,  # what the fork server test below preloads
            "set_after_server": os.environ.get("FOUNDRY_TEST_SET_AFTER_SERVER"),
        }
    )


@pytest.fixture
def launch(parse, monkeypatch):
    """``launch(*argv) -> the stand-in schedulers' reports`` for a Foundry launch."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs

    assert sched_start.install() or sched_start._installed
    monkeypatch.setenv(settings.ENV_MARKER, "1")
    monkeypatch.setenv("SGLANG_NUMA_BIND_V2", "0")
    monkeypatch.delenv(start_method.CHOSEN_ENV, raising=False)

    def _launch(*argv: str):
        sa = parse(*argv)
        publish(sa, role="tokenizer")
        # As SGLang's launcher leaves it before this call (engine.py's _set_envs_and_config): the
        # suite's other tests may have left this process's default start method elsewhere.
        mp.set_start_method("spawn", force=True)
        result, procs = Engine._launch_scheduler_processes(sa, PortArgs.init_new(sa), report_start)
        try:
            return result_infos(result)
        finally:
            for p in procs:
                p.join(60)

    def result_infos(result):
        result.wait_for_ready()
        return result.scheduler_infos

    before = mp.get_start_method(allow_none=True)
    yield _launch
    mp.set_start_method(before, force=True)


def test_a_clean_launcher_forks_its_scheduler_with_sglang_imported_and_foundry_hooked(launch, monkeypatch):
    # A launcher runs no other thread here; this test process may still hold threads other tests
    # left (the rule itself is test_start_method's).
    monkeypatch.setattr(start_method, "foreign_threads", lambda threads=None: [])
    (info,) = launch()
    assert info["start_method"] == "fork"
    assert info["scheduler_imported"] is True  # no second import of SGLang
    assert info["worker_hooks"] is True  # registered in the child: SGLang loads plugins once per process
    assert info["chosen"]["method"] == "fork"
    assert mp.get_start_method() == "spawn"  # SGLang's method again for what the launcher starts next


def test_spawn_when_asked_and_the_reason_reaches_the_scheduler(launch, monkeypatch):
    monkeypatch.setenv(start_method.ENV, "spawn")
    (info,) = launch()
    assert info["start_method"] == "spawn"
    assert info["scheduler_imported"] is False  # a fresh interpreter: SGLang's own start
    assert info["chosen"] == {"method": "spawn", "reason": f"{start_method.ENV}=spawn"}


def test_spawn_where_the_launcher_initialised_cuda(launch, monkeypatch):
    monkeypatch.setattr(start_method, "cuda_initialized", lambda: True)
    (info,) = launch()
    assert info["start_method"] == "spawn" and "CUDA is initialised" in info["chosen"]["reason"]


@pytest.fixture
def colorsys_server(monkeypatch):
    """A fork server that preloaded colorsys, for this test only (later tests see none). The
    first test to ask starts it; ``multiprocessing`` keeps one server per process."""
    monkeypatch.setattr(forkserver, "_started", None)
    if forkserver._server_pid() is None:
        assert forkserver.start(["colorsys"])
    else:
        monkeypatch.setattr(forkserver, "_started", ("colorsys",))
    assert forkserver.unusable() is None


def test_a_launcher_with_cuda_forks_its_scheduler_from_the_fork_server(launch, monkeypatch, colorsys_server):
    monkeypatch.setattr(start_method, "cuda_initialized", lambda: True)
    # As SGLang's launcher sets NCCL_* and the like after the plugin registered.
    monkeypatch.setenv("FOUNDRY_TEST_SET_AFTER_SERVER", "1")
    (info,) = launch()
    assert info["start_method"] == "forkserver"
    assert info["chosen"]["method"] == "forkserver" and "CUDA is initialised" in info["chosen"]["reason"]
    assert info["parent"] != os.getpid()  # forked from the server, not from this launcher
    assert info["preloaded"] is True
    assert info["set_after_server"] == "1"  # the launcher's environment at the scheduler's start
    # No plugin state from the launcher: SGLang's run_scheduler_process loads the plugins itself,
    # as in a spawned scheduler (this stand-in does not).
    assert info["worker_hooks"] is False
    assert mp.get_start_method() == "spawn"


def test_a_fork_server_whose_preload_initialised_cuda_is_passed_over_for_spawn(launch, monkeypatch):
    monkeypatch.setattr(start_method, "cuda_initialized", lambda: True)
    monkeypatch.setattr(forkserver, "running", lambda: ("colorsys",))
    monkeypatch.setattr(forkserver, "unusable", lambda: "it initialised CUDA while importing colorsys")
    (info,) = launch()
    assert info["start_method"] == "spawn"
    reason = info["chosen"]["reason"]
    assert "CUDA is initialised in the launching process" in reason
    assert "Foundry's fork server: it initialised CUDA while importing colorsys" in reason


def test_sglang_reasons_to_spawn(parse):
    assert sched_start.blockers(parse()) == [] or all("NUMA" in b for b in sched_start.blockers(parse()))
    assert "the data-parallel controller starts the schedulers itself" in sched_start.blockers(
        parse("--dp-size", "2")
    )
    assert "the memory saver LD_PRELOADs its library into each scheduler" in sched_start.blockers(
        parse("--enable-memory-saver")
    )
    assert "Ray places the schedulers" in sched_start.blockers(parse(), placement_group=object())


def test_foundry_off_leaves_sglangs_start_alone(launch, monkeypatch):
    monkeypatch.delenv(settings.ENV_MARKER)
    (info,) = launch()
    assert info["start_method"] == "spawn" and info["chosen"] is None


def report_detokenizer(server_args, port_args):
    """A detokenizer stand-in: how this process started, written where the test reads it."""
    import json

    with open(os.environ["FOUNDRY_TEST_DETOKENIZER_OUT"], "w") as f:
        json.dump(
            {
                "start_method": mp.current_process()._config.get("start_method")
                or mp.get_start_method(allow_none=True),
                "parent": os.getppid(),
                "scheduler_imported": SCHEDULER_MODULE in sys.modules,
                "preloaded": "colorsys" in sys.modules,
            },
            f,
        )


@pytest.fixture
def launch_detokenizer(parse, monkeypatch, tmp_path):
    """``launch_detokenizer(*argv) -> what the stand-in detokenizer found``, through SGLang's real
    ``Engine._launch_detokenizer_subprocesses``."""
    import json

    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs

    assert sched_start.install() or sched_start._installed
    monkeypatch.setenv(settings.ENV_MARKER, "1")
    monkeypatch.setenv("FOUNDRY_TEST_DETOKENIZER_OUT", str(tmp_path / "detokenizer.json"))
    before = mp.get_start_method(allow_none=True)

    def _launch(*argv: str):
        sa = parse(*argv)
        publish(sa, role="tokenizer")
        mp.set_start_method("spawn", force=True)  # as SGLang's launcher leaves it
        procs, names = Engine._launch_detokenizer_subprocesses(
            server_args=sa, port_args=PortArgs.init_new(sa), run_detokenizer_process_func=report_detokenizer
        )
        for p in procs:
            p.join(120)
        assert names == ["detokenizer"] and [p.exitcode for p in procs] == [0]
        assert mp.get_start_method() == "spawn"  # SGLang's method again
        return json.loads((tmp_path / "detokenizer.json").read_text())

    yield _launch
    mp.set_start_method(before, force=True)


def test_the_detokenizer_starts_as_the_schedulers_do(launch_detokenizer, monkeypatch, colorsys_server):
    monkeypatch.setattr(start_method, "foreign_threads", lambda threads=None: [])
    info = launch_detokenizer()
    assert info["start_method"] == "fork" and info["scheduler_imported"] is True
    monkeypatch.setattr(start_method, "cuda_initialized", lambda: True)
    info = launch_detokenizer()
    assert info["start_method"] == "forkserver" and info["preloaded"] is True
    assert info["parent"] != os.getpid()
    monkeypatch.setenv(start_method.ENV, "spawn")
    assert launch_detokenizer()["start_method"] == "spawn"


def test_the_detokenizer_of_a_launch_without_foundry_or_with_several_workers_is_sglangs(monkeypatch, parse):
    calls = []

    def original(cls, *args, **kwargs):
        calls.append((args, kwargs, mp.get_start_method(allow_none=True)))

    mp_before = mp.get_start_method(allow_none=True)
    monkeypatch.setattr(start_method, "decide", lambda **kw: pytest.fail("no start method is chosen"))
    monkeypatch.setenv(settings.ENV_MARKER, "1")
    several = parse("--detokenizer-worker-num", "2")
    sched_start.around_launch_detokenizers(
        original, None, server_args=several, port_args=1, run_detokenizer_process_func=2
    )
    monkeypatch.delenv(settings.ENV_MARKER)
    sched_start.around_launch_detokenizers(original, None, parse(), 1, 2)
    assert calls == [
        ((), {"server_args": several, "port_args": 1, "run_detokenizer_process_func": 2}, mp_before),
        ((calls[1][0][0], 1, 2), {}, mp_before),
    ]


REGISTER = """
import json, multiprocessing as mp, sys
sys.argv = ["sglang.launch_server", *sys.argv[2:], "--foundry-config", sys.argv[1]]
import foundry_sglang_plugin
from foundry_core import forkserver

def child(q):
    foundry_sglang_plugin.register()
    q.put(forkserver.running())

if __name__ == "__main__":
    foundry_sglang_plugin.register()
    launcher = forkserver.running()
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=child, args=(q,))
    p.start()
    print(json.dumps({"launcher": launcher, "child": q.get(timeout=120)}))
    p.join(30)
"""


@pytest.mark.parametrize(
    "worker_start, flags, started",
    [("auto", ["--enable-foundry"], True), ("spawn", ["--enable-foundry"], False), ("auto", [], False)],
)
def test_register_starts_the_fork_server_in_the_launcher_only(tmp_path, worker_start, flags, started):
    import json
    import subprocess

    script = tmp_path / "launcher.py"
    script.write_text(REGISTER)
    env = {**os.environ, start_method.ENV: worker_start, "FOUNDRY_READAHEAD": "0"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(Path(sched_start.__file__).parents[1]), env.get("PYTHONPATH")] if p
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "foundry.toml"), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["child"] is None  # a spawned scheduler or detokenizer starts no server of its own
    assert out["launcher"] == (list(sched_start.PRELOAD) if started else None)


PRELOAD_PROBE = """
import json, sys
import torch
from foundry_core import forkserver_preload as preload

asked = []
def _query(name):
    def query(*args, **kwargs):  # on a GPU host each of these initialises CUDA (or the driver)
        asked.append(name)
        raise RuntimeError(name)
    return query
for name in ("is_available", "device_count", "get_device_name", "get_device_capability",
             "get_device_properties", "current_device", "init", "_lazy_init", "mem_get_info"):
    setattr(torch.cuda, name, _query(name))
with preload.recording_environment_reads():
    for m in sys.argv[1:]:
        __import__(m)
print(json.dumps({"modules": sorted(sys.modules), "asked": asked, "listed": preload.ENV_LISTED}))
"""


def test_the_preloaded_modules_ask_nothing_of_the_gpu_and_bring_no_engine_module():
    # A fork server whose imports initialised CUDA (or the driver) is of no use to a scheduler; the
    # engine's own modules and the kernel libraries ask the GPU at import (SGLang's platform check,
    # sgl_kernel, FlashInfer, xgrammar's tvm-ffi) or read the launcher's later settings (CuTe DSL).
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", PRELOAD_PROBE, *sched_start.PRELOAD],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["asked"] == []
    assert out["listed"] == []  # no module went through the whole environment but the known ones
    readers = ("flashinfer", "deep_gemm", "tvm_ffi", "sglang", "sgl_kernel", "cutlass", "xgrammar")
    assert [m for m in out["modules"] if m.split(".")[0] in readers or m.startswith(readers)] == []


LAUNCHER_ENV = """
import json, os, sys
model, toml, extra = sys.argv[1:4]
sys.argv = ["sglang.launch_server", "--model-path", model, "--device", "cuda",
            "--enable-foundry", "--foundry-config", toml]
# As sglang.launch_server: its imports, then the plugins (the fork server starts), then the arguments.
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
import foundry_sglang_plugin
from foundry_sglang_plugin import support

support.cuda_device_count = lambda: 1  # a GPU machine, as far as Foundry's checks go
if extra:
    foundry_sglang_plugin.SCHEDULER_PRELOAD = (*foundry_sglang_plugin.SCHEDULER_PRELOAD, extra)
load_plugins()
before = dict(os.environ)
server_args = prepare_server_args(sys.argv[1:])
from foundry_core import forkserver
forkserver.unusable()  # the preload done, whatever its imports made on disk
from foundry_sglang_plugin import hooks
hooks.before_check_server_args(server_args)  # Foundry's launcher step: its settings, cache folders
from sglang.srt.entrypoints.engine import _set_envs_and_config
_set_envs_and_config(server_args)  # SGLang's, just before it starts the schedulers
changed = sorted(k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k))
print(json.dumps({"running": forkserver.running(), "unusable": forkserver.unusable(), "changed": changed,
                  "caches": os.environ["FOUNDRY_CACHES_DIR"]}))
"""


@pytest.mark.parametrize("extra", ["", "foundry_reads_max_connections"])
def test_what_the_launcher_sets_before_the_schedulers_start_is_nothing_the_preload_kept(
    tmp_path, model_dir, foundry_toml, extra
):
    # The fork server imports the preload while the launcher goes on; SGLang's launcher and
    # Foundry's launcher step then set variables (NCCL, CUDA_DEVICE_MAX_CONNECTIONS, CuTe DSL
    # logging, the compile-cache folders, Foundry's settings). A module that read one of them at
    # import would keep the server's value in every scheduler: the launcher passes such a server
    # over. The second case adds a module that reads one, to show the check sees it.
    import importlib.util
    import json
    import subprocess

    (tmp_path / "foundry_reads_max_connections.py").write_text(
        "import os\nMAX_CONNECTIONS = os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')\n"
    )
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER_ENV)
    env = {**os.environ, "FOUNDRY_READAHEAD": "0", "TMPDIR": str(tmp_path / "t")}
    (tmp_path / "t").mkdir()
    # As on a GPU image: libraries on LD_LIBRARY_PATH, which OpenCV (imported by the preload and by
    # the launcher) grows; on the H100 that passed the server over twice (fixed since).
    (tmp_path / "gpu-libs").mkdir()
    (tmp_path / "gpu-libs" / "libcudart.so.13").touch()
    env["LD_LIBRARY_PATH"] = str(tmp_path / "gpu-libs")
    env.pop(start_method.ENV, None)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    env.pop("FOUNDRY_CACHE_ROOT", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(Path(sched_start.__file__).parents[1]), str(tmp_path), env.get("PYTHONPATH")] if p
    )
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(foundry_toml), extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["running"] is not None
    # The launcher did change what matters here (else this shows nothing).
    assert {"CUDA_DEVICE_MAX_CONNECTIONS", "CUTE_DSL_LOG_LEVEL", "TORCHINDUCTOR_CACHE_DIR"} <= set(
        out["changed"]
    )
    assert {"TORCH_COMPILE_JOB_ID", "FOUNDRY_MODE"} <= set(out["changed"])
    if importlib.util.find_spec("cv2") is not None:  # CI installs it (.ci/sglang.sh), as GPU images have it
        assert "LD_LIBRARY_PATH" in out["changed"]  # OpenCV's loader grew it in the launcher
    # The server's imports made nothing in the launcher's way: Foundry's private cache folder is the
    # archive's own (a folder made world-readable before it is refused for a random one, and every
    # LOAD compiles again: seen on an H100 when torch's compile stack was in the preload).
    caches = Path(out["caches"])
    assert caches.parent == tmp_path / "t" / f"foundry-caches-{os.getuid()}"
    assert caches.name.startswith("archive-") and (caches.parent.stat().st_mode & 0o077) == 0
    if not extra:
        assert out["unusable"] is None
    else:
        # How it changed, and where: SGLang's launcher sets it (the reason names the line).
        assert out["unusable"].startswith(
            "its preload read CUDA_DEVICE_MAX_CONNECTIONS (set since, by sglang/"
        ), out["unusable"]


def test_the_resynced_variables_are_the_ones_foundry_applies_again_in_each_scheduler():
    import foundry_sglang_plugin
    from foundry_core.engine import caches, inductor

    assert set(foundry_sglang_plugin.SCHEDULER_RESYNCED) == {
        caches.PGO_JOB_ENVS[0],
        *(env for _value, env, _why in inductor.PINNED.values()),
    }
