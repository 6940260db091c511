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


def test_a_launcher_with_cuda_forks_its_scheduler_from_the_fork_server(launch, monkeypatch):
    monkeypatch.setattr(start_method, "cuda_initialized", lambda: True)
    monkeypatch.setattr(forkserver, "_started", None)  # this test's server; later tests see none
    assert forkserver.start(["colorsys"])
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


def test_the_preloaded_modules_read_no_cache_folder_and_touch_no_gpu():
    # The fork server imports these before the launcher points the compile caches (Triton,
    # Inductor, FlashInfer, DeepGEMM, tvm-ffi) at Foundry's folders: none of the modules that read
    # those folders may come in with them, nor SGLang (its import initialises CUDA).
    import json
    import subprocess

    code = (
        "import json, sys\n"
        f"for m in {list(sched_start.PRELOAD)!r}: __import__(m)\n"
        "import torch\n"
        "print(json.dumps({'modules': sorted(sys.modules), 'cuda': torch.cuda.is_initialized()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["cuda"] is False
    readers = ("triton", "torch._inductor", "flashinfer", "deep_gemm", "tvm_ffi", "sglang", "sgl_kernel")
    assert [m for m in out["modules"] if m.split(".")[0] in readers or m.startswith(readers)] == []
