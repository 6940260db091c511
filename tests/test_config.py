"""Tests for the shared Foundry TOML configuration (foundry_core.config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_core.config import (
    DEFAULT_REGION_BASE,
    DEFAULT_REGION_SIZE,
    RANK_STRIDE,
    ConfigError,
    FoundryConfig,
    config_from_dict,
    config_from_env,
    load_config,
    parse_size,
)

DIGEST = "ab" * 32

FULL = f"""
mode = "load"
archive_dir = "/var/cache/foundry/qwen3"

[region]
base = 0x500000000000
size = "64GiB"

[trust]
archive_digest = "{DIGEST}"
"""


def write(tmp_path: Path, text: str, name: str = "foundry.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_valid_file(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    assert cfg == FoundryConfig(
        mode="load",
        archive_dir=Path("/var/cache/foundry/qwen3"),
        region_base=0x500000000000,
        region_size=64 << 30,
        archive_digest=DIGEST,
        archive_digests=((0, DIGEST),),
        source=(tmp_path / "foundry.toml").resolve(),
    )
    assert cfg.rank_archive_dir(3) == Path("/var/cache/foundry/qwen3/rank3")
    assert cfg.rank_region_base(0) == 0x500000000000
    assert cfg.rank_region_base(2) == 0x500000000000 + 2 * RANK_STRIDE


def test_defaults_and_relative_archive_dir(tmp_path):
    cfg = load_config(write(tmp_path, 'archive_dir = "archives/a"'))
    assert cfg.mode == "auto"
    assert cfg.archive_dir == tmp_path.resolve() / "archives/a"  # relative to the config file
    assert cfg.region_base == DEFAULT_REGION_BASE and cfg.region_size == DEFAULT_REGION_SIZE
    assert cfg.archive_digest is None
    assert (
        load_config(write(tmp_path, 'archive_dir = "x"\n[trust]\narchive_digest = ""')).archive_digest is None
    )


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(write(tmp_path, 'archive_dir = "~/fa"')).archive_dir == tmp_path / "fa"


@pytest.mark.parametrize("mode", ["save", "load", "auto"])
def test_every_mode(tmp_path, mode):
    assert load_config(write(tmp_path, f'mode = "{mode}"\narchive_dir = "/a"')).mode == mode


ERRORS = {
    "unknown-top-key": (
        'archive_dir = "/a"\nmdoe = "save"',
        r"unknown key 'mdoe' \(known: allow_untested_release, archive_dir, caches, load, mode, region, strict, trust\)",
    ),
    "unknown-region-key": ('archive_dir = "/a"\n[region]\nbsae = 0', r"\[region\]: unknown key 'bsae'"),
    "unknown-trust-key": ('archive_dir = "/a"\n[trust]\ndigest = ""', r"\[trust\]: unknown key 'digest'"),
    "bad-mode": (
        'mode = "restore"\narchive_dir = "/a"',
        "mode must be one of save, load, auto, got 'restore'",
    ),
    "bad-mode-type": ('mode = 1\narchive_dir = "/a"', "mode must be one of save, load, auto, got 1"),
    "missing-archive-dir": ('mode = "save"', "archive_dir is required"),
    "empty-archive-dir": ('archive_dir = ""', "archive_dir must be a non-empty path string"),
    "archive-dir-type": ("archive_dir = 5", "archive_dir must be a non-empty path string"),
    "region-not-table": ('archive_dir = "/a"\nregion = 5', r"\[region\] must be a table"),
    "trust-not-table": ('archive_dir = "/a"\ntrust = "x"', r"\[trust\] must be a table"),
    "bad-size-text": ('archive_dir = "/a"\n[region]\nsize = "lots"', "region.size: cannot read size 'lots'"),
    "bad-size-unit": ('archive_dir = "/a"\n[region]\nsize = "64XB"', "region.size: cannot read size '64XB'"),
    "bad-size-fraction": ('archive_dir = "/a"\n[region]\nsize = "1.5GiB"', "cannot read size '1.5GiB'"),
    "bad-size-float": (
        'archive_dir = "/a"\n[region]\nsize = 1.5e9',
        "region.size: expected a size, got float",
    ),
    "bad-size-bool": ('archive_dir = "/a"\n[region]\nsize = true', "region.size: expected a size, got True"),
    "bad-size-zero": ('archive_dir = "/a"\n[region]\nsize = 0', "region.size: size must be positive, got 0"),
    "bad-size-negative": ('archive_dir = "/a"\n[region]\nsize = -4', "size must be positive"),
    "bad-size-granule": (
        'archive_dir = "/a"\n[region]\nsize = "3M"',
        "region.size: 3145728 must be a multiple of 2 MiB",
    ),
    "bad-size-stride": ('archive_dir = "/a"\n[region]\nsize = "2TiB"', "exceeds the per-rank stride"),
    "bad-base-alignment": (
        'archive_dir = "/a"\n[region]\nbase = 0x600000001000',
        "region.base: 0x600000001000 must be a positive multiple of 2 MiB",
    ),
    "bad-base-zero": (
        'archive_dir = "/a"\n[region]\nbase = 0',
        "region.base: 0x0 must be a positive multiple",
    ),
    "bad-base-negative": ('archive_dir = "/a"\n[region]\nbase = "-0x200000"', "must be a positive multiple"),
    "bad-base-text": (
        'archive_dir = "/a"\n[region]\nbase = "high"',
        "region.base: cannot read address 'high'",
    ),
    "bad-base-float": (
        'archive_dir = "/a"\n[region]\nbase = 1.0',
        "region.base: expected an address, got float",
    ),
    "bad-base-bool": (
        'archive_dir = "/a"\n[region]\nbase = false',
        "region.base: expected an address, got False",
    ),
    "bad-base-high": (
        'archive_dir = "/a"\n[region]\nbase = 0x800000000000',
        "outside the 47-bit user address space",
    ),
    "bad-region-end": (
        'archive_dir = "/a"\n[region]\nbase = 0x7fffffe00000\nsize = "4MiB"',
        "ends past the 47-bit",
    ),
    "bad-digest-short": (
        'archive_dir = "/a"\n[trust]\narchive_digest = "abc"',
        "trust.archive_digest: expected 64 lowercase hex",
    ),
    "bad-digest-upper": (
        f'archive_dir = "/a"\n[trust]\narchive_digest = "{DIGEST.upper()}"',
        "expected 64 lowercase hex",
    ),
    "bad-digest-type": ('archive_dir = "/a"\n[trust]\narchive_digest = 5', "expected 64 lowercase hex"),
    "bad-digest-false": ('archive_dir = "/a"\n[trust]\narchive_digest = false', "expected 64 lowercase hex"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_error_branches(tmp_path, case):
    text, message = ERRORS[case]
    with pytest.raises(ConfigError, match=message) as ei:
        load_config(write(tmp_path, text))
    assert "\n" not in str(ei.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(write(tmp_path, "mode = = 1"))
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'archive_dir = "/caf\xe9"')
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="expected a table"):
        config_from_dict([])


def test_error_names_the_file(tmp_path):
    p = write(tmp_path, 'archive_dir = "/a"\nbogus = 1')
    with pytest.raises(ConfigError, match=str(p.resolve())):
        load_config(p)


@pytest.mark.parametrize(
    "value,expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("64GiB", 64 << 30),
        ("64GB", 64 << 30),
        ("64G", 64 << 30),
        ("64gib", 64 << 30),
        ("512M", 512 << 20),
        ("512MiB", 512 << 20),
        ("512 MiB", 512 << 20),
        (" 2T ", 2 << 40),
        ("1TiB", 1 << 40),
        ("8K", 8 << 10),
        ("8KiB", 8 << 10),
        ("100B", 100),
    ],
)
def test_sizes(value, expected):
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize("value", ["", "G", "64 GiBs", "64P", "0x100", "-1M", "1e9", None, [1], 3.0, True])
def test_bad_sizes(value):
    with pytest.raises(ConfigError, match="^x: "):
        parse_size(value, "x")


def test_region_from_file(tmp_path):
    cfg = load_config(
        write(tmp_path, 'archive_dir = "/a"\n[region]\nbase = "0x400000000000"\nsize = 536870912')
    )
    assert cfg.region_base == 0x400000000000 and cfg.region_size == 512 << 20


def test_env_round_trip_without_file():
    cfg = config_from_dict({"mode": "save", "archive_dir": "/data/a", "region": {"size": "512M"}})
    env = cfg.to_env()
    assert env == {
        "FOUNDRY_MODE": "save",
        "FOUNDRY_ARCHIVE_DIR": "/data/a",
        "FOUNDRY_REGION_BASE": hex(DEFAULT_REGION_BASE),
        "FOUNDRY_REGION_SIZE": str(512 << 20),
    }
    assert config_from_env(env) == cfg
    pinned = config_from_dict({"archive_dir": "/a", "trust": {"archive_digest": DIGEST}})
    assert pinned.to_env()["FOUNDRY_ARCHIVE_DIGEST"] == DIGEST
    assert config_from_env(pinned.to_env()) == pinned


def test_env_round_trip_with_file(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    env = cfg.to_env()
    assert env["FOUNDRY_CONFIG"] == str((tmp_path / "foundry.toml").resolve())
    assert config_from_env(env) == cfg


def test_env_disabled_and_partial(monkeypatch):
    assert config_from_env({}) is None
    assert config_from_env({"FOUNDRY_ARCHIVE_DIR": "/a"}) is None  # no mode: Foundry is off
    cfg = config_from_env({"FOUNDRY_MODE": "load", "FOUNDRY_ARCHIVE_DIR": "/a"})
    assert cfg.region_base == DEFAULT_REGION_BASE and cfg.region_size == DEFAULT_REGION_SIZE
    monkeypatch.setenv("FOUNDRY_MODE", "auto")
    monkeypatch.setenv("FOUNDRY_ARCHIVE_DIR", "/b")
    monkeypatch.delenv("FOUNDRY_CONFIG", raising=False)
    assert config_from_env().archive_dir == Path("/b")  # defaults to os.environ


def test_env_errors_are_config_errors():
    with pytest.raises(ConfigError, match="archive_dir is required|archive_dir must be a non-empty"):
        config_from_env({"FOUNDRY_MODE": "load"})
    with pytest.raises(ConfigError, match="mode must be one of"):
        config_from_env({"FOUNDRY_MODE": "fast", "FOUNDRY_ARCHIVE_DIR": "/a"})
    with pytest.raises(ConfigError, match="region.size: cannot read size"):
        config_from_env({"FOUNDRY_MODE": "load", "FOUNDRY_ARCHIVE_DIR": "/a", "FOUNDRY_REGION_SIZE": "big"})
    assert (
        config_from_env(
            {"FOUNDRY_MODE": "load", "FOUNDRY_ARCHIVE_DIR": "/a", "FOUNDRY_REGION_SIZE": "64GiB"}
        ).region_size
        == 64 << 30
    )
    with pytest.raises(ConfigError, match="region.base"):
        config_from_env(
            {"FOUNDRY_MODE": "load", "FOUNDRY_ARCHIVE_DIR": "/a", "FOUNDRY_REGION_BASE": "0x1001"}
        )
    with pytest.raises(ConfigError, match="does not exist"):
        config_from_env({"FOUNDRY_CONFIG": "/nonexistent/foundry.toml"})


OTHER = "b" * 64


def test_per_rank_digest_table(tmp_path):
    cfg = load_config(
        write(tmp_path, f'archive_dir = "/a"\n[trust]\narchive_digest = {{ 0 = "{DIGEST}", 1 = "{OTHER}" }}')
    )
    assert cfg.digest_for_rank(0) == DIGEST and cfg.digest_for_rank(1) == OTHER
    with pytest.raises(ConfigError, match="pins rank\\(s\\) \\[0, 1\\] but not rank 2"):
        cfg.digest_for_rank(2)
    assert config_from_env(cfg.to_env()).archive_digests == cfg.archive_digests
    single = config_from_dict({"archive_dir": "/a", "trust": {"archive_digest": DIGEST}})
    assert single.digest_for_rank(0) == DIGEST
    with pytest.raises(ConfigError, match="but not rank 1"):
        single.digest_for_rank(1)  # one digest pins rank 0 only; other ranks are not let through unpinned
    assert config_from_dict({"archive_dir": "/a"}).digest_for_rank(5) is None


@pytest.mark.parametrize(
    "table,message",
    [
        ({"x": DIGEST}, "table keys are ranks"),
        ({"0": "abc"}, "trust.archive_digest.0: expected 64 lowercase hex"),
        ({}, "an empty table pins nothing"),
    ],
)
def test_per_rank_digest_table_errors(table, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"archive_dir": "/a", "trust": {"archive_digest": table}})


def test_the_load_table_switches_the_structure_check():
    base = {"mode": "load", "archive_dir": "/a"}
    assert config_from_dict(base).check_structure is False
    assert config_from_dict({**base, "load": {"check_structure": True}}).check_structure is True
    with pytest.raises(ConfigError, match="load.check_structure: expected true or false"):
        config_from_dict({**base, "load": {"check_structure": "yes"}})
    with pytest.raises(ConfigError, match=r"\[load\]: unknown key 'check'"):
        config_from_dict({**base, "load": {"check": True}})
