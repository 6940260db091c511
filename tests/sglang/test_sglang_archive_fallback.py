"""A LOAD checks the core archive (``fc.verify``) in the scheduler before any model memory exists.

``auto``: a refused archive turns the start into a normal capture and a fresh SAVE, with a warning
naming why (one rank only; with several ranks it is an error). ``load``: a refusal is an error.
``fc.verify`` and ``fc.start_recording`` are stood in for here (no GPU, no native library).
"""

from __future__ import annotations

import logging
import pickle
import types

import pytest

import foundry_core
from foundry_core.archive import ArchiveError, ArchiveNotFound, FingerprintMismatch
from foundry_core.trust import ArchiveLocationError
from foundry_sglang_plugin import archive, settings
from foundry_sglang_plugin.session import FoundrySessionError, Session, settle

pytestmark = pytest.mark.sglang

BASE_ARGV = ["--cuda-graph-backend-prefill", "disabled"]
HINT = {"gpu_id": 0, "tp_rank": 0, "dp_rank": None}
PIN = "ab" * 32
DP2 = ["--dp-size", "2"]  # two ranks, each with its own archive
SLOTS = {"memory_pool_config": {"max_total_num_tokens": 1024}, "max_mamba_cache_size": None}


@pytest.fixture
def launch(parse, tmp_path, monkeypatch):
    """``launch(mode, *argv, pin=None) -> (server_args, cfg)`` with a TOML of its own and, for every
    rank, a finished SAVE on record (the sidecar), so ``auto`` resolves to LOAD."""

    def _launch(mode: str, *argv: str, pin: str | None = None):
        toml = tmp_path / "foundry.toml"
        text = f'mode = "{mode}"\narchive_dir = "{tmp_path / "archive"}"\n'
        if pin:
            text += f'\n[trust]\narchive_digest = "{pin}"\n'
        toml.write_text(text)
        sa = parse(*BASE_ARGV, *argv, foundry=False)
        settings.attach(sa, True, toml)
        cfg = settings.load(sa)
        for rank in range(archive.world_size(sa)):
            archive.write_sidecar(
                cfg, rank, {"fingerprint": archive.fingerprint(sa, cfg), "slots": SLOTS, "outputs": {}}
            )
        return sa, cfg

    return _launch


@pytest.fixture
def core(monkeypatch):
    """Stand-ins for ``fc.verify`` (raising ``core.refuse`` when set) and ``fc.start_recording``."""

    class Core:
        refuse: BaseException | None = None
        archive = None  # what verify hands back
        verified: list[tuple[str, dict]] = []
        recording: list[bool] = []

    def verify(path, **kwargs):
        Core.verified.append((path, kwargs))
        if Core.refuse is not None:
            raise Core.refuse
        return Core.archive

    Core.verified, Core.recording = [], []
    monkeypatch.setattr(foundry_core, "verify", verify)
    monkeypatch.setattr(
        foundry_core, "start_recording", lambda keep_images=True: Core.recording.append(keep_images)
    )
    return Core


def _mismatch():
    return FingerprintMismatch(
        "archive was saved for driver_version=12080, this machine has 13000; SAVE again on this setup",
        "driver_version",
        12080,
        13000,
    )


def test_auto_load_with_an_accepted_archive_stays_a_load(launch, core):
    sa, cfg = launch("auto")
    session = Session.begin(sa, HINT)
    assert session.mode == "load" and session.report["mode"] == "load"
    assert "fallback" not in session.report
    ((path, kwargs),) = core.verified
    assert path == cfg.rank_archive_dir(0)
    assert kwargs["fingerprint_model"] == session.fingerprint
    assert (kwargs["device"], kwargs["rank"], kwargs["world_size"]) == (0, 0, 1)
    assert kwargs["expected_digest"] is None and kwargs["trusted_root"] == cfg.archive_dir
    # images kept until the archive was accepted, then only stream captures are counted
    assert core.recording == [True, False]
    assert archive.read_sidecar(cfg, 0) is not None


def test_the_verified_archive_is_handed_to_fc_load_once(launch, core, monkeypatch):
    """What check_archive read is what fc.load gets (archive=), so LOAD reads and hashes it once."""
    sa, _cfg = launch("auto")
    core.archive = verified = object.__new__(foundry_core.Archive)
    verified.meta = {"slots": SLOTS}
    session = Session.begin(sa, HINT)
    assert session._verified is verified
    seen = {}

    def load(path, **kwargs):
        seen.update(kwargs)
        restored = types.SimpleNamespace(meta={"collectives": {}})
        return types.SimpleNamespace(slots=SLOTS, timings={}, digest="d" * 64, archive=restored)

    monkeypatch.setattr(foundry_core, "load", load)
    session.region = object()
    session.restore()
    assert seen["archive"] is verified and session._verified is None
    assert session.report["archive_digest"] == "d" * 64  # which archive this start restored
    assert session.report["collectives"] == {}  # what its graphs communicate with


@pytest.mark.parametrize(
    "refusal",
    [
        _mismatch(),
        ArchiveError(
            "archive /x/rank0: graphs/decode.bin: checksum mismatch (damaged or modified); SAVE again"
        ),
        ArchiveNotFound("no Foundry archive at /x/rank0; run SAVE first"),
        ArchiveLocationError("archive /x/rank0 resolves to /elsewhere, outside the configured directory"),
    ],
    ids=["fingerprint", "damaged", "missing", "location"],
)
def test_auto_falls_back_to_a_fresh_save_with_a_warning(launch, core, logged, refusal):
    sa, cfg = launch("auto")
    core.refuse = refusal
    session = Session.begin(sa, HINT)
    reason = str(refusal)
    assert session.mode == "save" and session.sidecar is None
    assert session.report["mode"] == "save" and session.report["fallback"] == reason
    warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert warnings == [
        f"Foundry rank 0: archive {cfg.rank_archive_dir(0)} refused ({reason}); capturing and saving a fresh one"
    ]
    # module images are kept from before the model's kernels load: the fresh SAVE needs them
    assert core.recording == [True, True]
    # the old archive no longer counts as finished, and the rest of this start is a SAVE
    assert archive.read_sidecar(cfg, 0) is None
    assert settle(sa) == (cfg, "save")


def test_the_fallback_save_profiles_the_pools_again(launch, core):
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    sa, _ = launch("auto")
    core.refuse = _mismatch()
    session = Session.begin(sa, HINT)
    profiled = MemoryPoolConfig(max_total_num_tokens=4096, max_running_requests=8, mem_fraction_static=0.3)
    assert session.pool_config(lambda: profiled, MemoryPoolConfig) is profiled
    assert session.slots["memory_pool_config"]["max_total_num_tokens"] == 4096


def test_auto_as_the_scheduler_sees_it_through_the_environment(launch, core, monkeypatch, tmp_path):
    """The launcher settled auto to load and exported it; the scheduler reads the TOML's own mode."""
    sa, cfg = launch("auto")
    monkeypatch.setenv(settings.ENV_MARKER, "1")
    monkeypatch.setenv("FOUNDRY_MODE", "load")
    monkeypatch.setenv("FOUNDRY_CONFIG", str(tmp_path / "foundry.toml"))
    bare = pickle.loads(pickle.dumps(sa))  # a record that arrived without the attributes
    for name in (settings.ENABLE_ATTR, settings.CONFIG_ATTR, settings.MODE_ATTR):
        vars(bare).pop(name, None)
    assert settings.requested(bare).config_path is None
    core.refuse = _mismatch()
    session = Session.begin(bare, HINT)
    assert session.mode == "save" and session.report["fallback"].startswith("archive was saved for driver")


def test_auto_settled_by_the_launcher_on_the_record(launch, core):
    sa, _ = launch("auto")
    settings.set_mode(sa, "load")
    core.refuse = _mismatch()
    assert Session.begin(sa, HINT).mode == "save"


def test_auto_passes_the_pinned_digest_and_falls_back_when_it_differs(launch, core):
    sa, cfg = launch("auto", pin=PIN)
    core.refuse = ArchiveError(f"archive {cfg.rank_archive_dir(0)} has digest {'cd' * 32}, expected {PIN}")
    session = Session.begin(sa, HINT)
    assert core.verified[0][1]["expected_digest"] == PIN
    assert session.mode == "save" and "expected " + PIN in session.report["fallback"]


def test_auto_falls_back_when_the_pool_sizing_disagrees_with_the_sidecar(launch, core):
    sa, _ = launch("auto")
    core.archive = type("A", (), {"meta": {"slots": {"memory_pool_config": {"max_total_num_tokens": 7}}}})()
    session = Session.begin(sa, HINT)
    assert session.mode == "save" and "pool sizing differs" in session.report["fallback"]


def test_auto_keeps_loading_when_the_pool_sizing_agrees(launch, core):
    sa, _ = launch("auto")
    core.archive = type("A", (), {"meta": {"slots": SLOTS}})()
    assert Session.begin(sa, HINT).mode == "load"


def test_auto_with_several_ranks_refuses_instead_of_falling_back(launch, core):
    sa, cfg = launch("auto", *DP2)
    core.refuse = _mismatch()
    with pytest.raises(FoundrySessionError) as err:
        Session.begin(sa, {**HINT, "dp_rank": 0})
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(
        f"Foundry rank 0: archive {cfg.rank_archive_dir(0)} refused (archive was saved for driver"
    )
    assert "start once with mode = save" in text and "has 2 ranks" in text
    assert core.verified[0][1]["world_size"] == 2
    assert archive.read_sidecar(cfg, 0) is not None  # nothing was invalidated


def test_load_mode_refusal_is_a_one_line_error(launch, core):
    sa, cfg = launch("load")
    core.refuse = _mismatch()
    with pytest.raises(FoundrySessionError) as err:
        Session.begin(sa, HINT)
    text = str(err.value)
    assert "\n" not in text
    assert f"archive {cfg.rank_archive_dir(0)} refused (archive was saved for driver_version=12080" in text
    assert err.value.__context__ is None  # no chained traceback around the one line
    assert archive.read_sidecar(cfg, 0) is not None
    assert core.recording == [False]  # LOAD never kept images


def test_load_mode_with_an_accepted_archive(launch, core):
    sa, _ = launch("load")
    assert Session.begin(sa, HINT).mode == "load"
    assert core.recording == [False, False] and len(core.verified) == 1


def test_save_mode_does_not_check_the_old_archive(launch, core):
    sa, cfg = launch("save")
    session = Session.begin(sa, HINT)
    assert session.mode == "save" and core.verified == [] and core.recording == [True, True]
    assert archive.read_sidecar(cfg, 0) is None


def test_other_errors_are_not_a_refusal(launch, core):
    sa, _ = launch("auto")
    core.refuse = RuntimeError("cannot fingerprint this machine: torch sees no CUDA device")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        Session.begin(sa, HINT)
