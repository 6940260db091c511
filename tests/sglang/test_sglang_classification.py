"""Every ``ServerArgs`` field and every declared ``SGLANG_*`` switch of the installed SGLang is
fingerprinted, refused or irrelevant (``foundry_sglang_plugin.classified``); the examples below were
neither fingerprinted nor refused before (SGLang 0.5.23 added them)."""

from __future__ import annotations

import typing

import pytest

# SGLang's ServerArgs is a msgspec record; msgspec comes with SGLang (absent from the core environment,
# where the SGLang tests skip themselves at collection's end, after this module is imported).
msgspec = pytest.importorskip(
    "msgspec", reason="the real SGLang package is not installed (see .ci/sglang.sh)"
)
from foundry_sglang_plugin import FoundryUnsupportedError, archive, check_supported, classified  # noqa: E402

OK = ["--cuda-graph-backend-prefill", "disabled"]
TP_OK = [
    *OK,
    "--tp-size",
    "2",
    "--enable-torch-symm-mem",
    "--disable-custom-all-reduce",
    "--cuda-graph-bs-decode",
    "8",
]


def _server_fields() -> set[str]:
    from sglang.srt.server_args import ServerArgs

    return set(ServerArgs.__struct_fields__)


def _env_switches() -> set[str]:
    from sglang.srt.environ import Envs

    return {n for n in dir(Envs) if n.startswith("SGLANG_")}


def _groups(kind: str) -> list[frozenset[str]]:
    if kind == "server":
        return [
            classified.SERVER_FINGERPRINTED,
            classified.SERVER_REFUSED_BY_RULE,
            *map(frozenset, classified.SERVER_REFUSED.values()),
            *map(frozenset, classified.SERVER_IRRELEVANT.values()),
        ]
    return [
        classified.ENV_FINGERPRINTED,
        *map(frozenset, classified.ENV_REFUSED.values()),
        *map(frozenset, classified.ENV_IRRELEVANT.values()),
    ]


@pytest.mark.parametrize("kind, declared", [("server", _server_fields), ("env", _env_switches)])
def test_every_field_and_switch_of_this_sglang_is_classified_once(kind, declared):
    names = declared()
    groups = _groups(kind)
    unclassified = sorted(names - set().union(*groups))
    assert not unclassified, f"SGLang has {kind} settings Foundry has not classified: {unclassified}"
    seen: dict[str, int] = {}
    for group in groups:
        for n in group:
            seen[n] = seen.get(n, 0) + 1
    assert not [n for n, c in seen.items() if c > 1], "classified twice"
    # Nothing stale: every name classified exists in this release.
    assert set().union(*groups) <= names


def test_an_unclassified_field_is_fingerprinted(monkeypatch):
    monkeypatch.setattr(classified, "SERVER_CLASSIFIED", classified.SERVER_CLASSIFIED - {"enable_waterfill"})
    assert "enable_waterfill" in classified.server_fields_to_fingerprint({"enable_waterfill", "port"})
    assert "port" not in classified.server_fields_to_fingerprint({"enable_waterfill", "port"})


def _on_value(name: str):
    """A value that turns field ``name`` on, from its declared type."""
    from sglang.srt.server_args import ServerArgs

    ftype = typing.get_type_hints(ServerArgs)[name]
    args = [a for a in typing.get_args(ftype) if a is not type(None)] or [ftype]
    kind = typing.get_origin(args[0]) or args[0]
    if kind is bool:
        return True
    if kind is int:
        return 1
    if kind in (list, tuple):
        return ["x"]
    if kind is dict:
        return {"x": 1}
    return "x"


REFUSED = sorted(n for names in classified.SERVER_REFUSED.values() for n in names)


@pytest.mark.parametrize("name", REFUSED)
def test_every_refused_field_is_refused_when_on(parse, name):
    server_args = msgspec.structs.replace(parse(*TP_OK), **{name: _on_value(name)})
    with pytest.raises(FoundryUnsupportedError, match=f"--{name.replace('_', '-')}"):
        check_supported(server_args)


@pytest.mark.parametrize("argv", [["--enable-tp-lm-head-all-to-all"], ["--enable-paged-experts"]])
def test_new_0_5_23_flags_are_refused(parse, argv):
    with pytest.raises(FoundryUnsupportedError, match=argv[0]):
        check_supported(parse(*TP_OK, *argv))


@pytest.mark.parametrize("name", sorted(n for names in classified.ENV_REFUSED.values() for n in names))
def test_every_refused_switch_is_refused_when_set(parse, monkeypatch, name):
    from sglang.srt.environ import Envs

    default = getattr(Envs, name)._resolve_default()
    monkeypatch.setenv(name, "0" if default is True else "7" if not isinstance(default, bool) else "1")
    with pytest.raises(FoundryUnsupportedError, match=name):
        check_supported(parse(*OK))


def test_pcie_ipc_allreduce_is_refused(parse, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "1")
    with pytest.raises(FoundryUnsupportedError, match="SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"):
        check_supported(parse(*TP_OK))


def test_the_default_launch_is_accepted_with_the_switches_at_their_defaults(parse, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_GRAPH_POOL_BORROW", "false")  # set, but to its default
    check_supported(parse(*OK))
    check_supported(parse(*TP_OK))


@pytest.fixture
def cfg():
    from types import SimpleNamespace

    return SimpleNamespace(region_base=1 << 40, region_size=1 << 30)


@pytest.mark.parametrize(
    "argv",
    [
        ["--fp8-gemm-backend", "deep_gemm"],
        ["--enable-two-batch-overlap"],
        ["--gc-threshold", "1000"],
        ["--linear-attn-backend", "cutedsl"],
    ],
)
def test_new_graph_settings_are_fingerprinted(parse, cfg, argv):
    assert archive.fingerprint(parse(*OK, *argv), cfg) != archive.fingerprint(parse(*OK), cfg)


def test_set_graph_switches_are_fingerprinted_and_serving_ones_are_not(parse, cfg, monkeypatch):
    base = archive.fingerprint(parse(*OK), cfg)
    monkeypatch.setenv("SGLANG_LOG_FORWARD_ITERS", "1")
    assert archive.fingerprint(parse(*OK), cfg) == base
    assert "SGLANG_FLASHINFER_WORKSPACE_SIZE" in classified.ENV_FINGERPRINTED
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(1 << 28))
    assert archive.fingerprint(parse(*OK), cfg) != base


def test_cache_directories_foundry_redirects_are_not_fingerprinted(parse, cfg, monkeypatch):
    """The launcher fingerprints before it redirects the caches, the schedulers after."""
    base = archive.fingerprint(parse(*OK), cfg)
    monkeypatch.setenv("SGLANG_CACHE_DIR", "/tmp/elsewhere")
    monkeypatch.setenv("SGLANG_DG_CACHE_DIR", "/tmp/elsewhere/dg")
    assert archive.fingerprint(parse(*OK), cfg) == base
