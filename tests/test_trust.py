"""Trust guards in front of LOAD: location under the configured directory, world-writable warning."""

import os
import warnings

import pytest

from foundry_core import trust


def test_location_inside_root(tmp_path):
    root = tmp_path / "archives"
    (root / ".rank0.abc").mkdir(parents=True)
    os.symlink(".rank0.abc", root / "rank0")
    assert trust.check_location(root / "rank0", root) == (root / ".rank0.abc").resolve()


def test_location_symlink_escaping_root_is_refused(tmp_path):
    root = tmp_path / "archives"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / "rank0")
    with pytest.raises(trust.ArchiveLocationError, match="outside the configured directory"):
        trust.check_location(root / "rank0", root)


def test_world_writable_warns_and_sticky_does_not(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.warns(trust.WritableArchiveWarning, match="writable by every user"):
        assert trust.warn_if_world_writable(d, stop_at=tmp_path) == [d.resolve()]
    os.chmod(d, 0o1777)  # sticky, like /tmp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trust.warn_if_world_writable(d, stop_at=tmp_path) == []
    os.chmod(d, 0o755)
    assert trust.world_writable(d, stop_at=tmp_path) == []


def test_verify_checks_the_location_first(tmp_path, monkeypatch):
    """verify(trusted_root=...) refuses an archive outside the root before opening it, as load does."""
    from foundry_core import api

    root = tmp_path / "archives"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / "rank0")
    monkeypatch.setattr(api, "open_archive", lambda *a, **k: pytest.fail("opened before the location check"))
    with pytest.raises(trust.ArchiveLocationError, match="outside the configured directory"):
        api.verify(root / "rank0", trusted_root=root)
