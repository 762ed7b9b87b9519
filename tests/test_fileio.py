"""Atomic writes: the umask honoured, and every OS failure one line with nothing left behind."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from mla_tune import fileio
from mla_tune.fileio import WriteError, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_gets_the_mode_the_umask_gives_and_a_replaced_one_keeps_its_own(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "t.yaml", "a")
        assert _mode(path) == 0o644 and path.read_text() == "a"
        os.umask(0o077)
        assert _mode(atomic_write_text(tmp_path / "private.yaml", "b")) == 0o600
        path.chmod(0o664)
        atomic_write_text(path, "c")
        assert _mode(path) == 0o664 and path.read_text() == "c"
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private.yaml", "t.yaml"]


def test_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "t.yaml"
    path.write_text("old")

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", no_space)
    with pytest.raises(WriteError, match=r"cannot write .*t\.yaml: No space left on device; free "
                                         r"some space or write elsewhere") as info:
        atomic_write_text(path, "new")
    assert "\n" not in str(info.value) and isinstance(info.value, OSError)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["t.yaml"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders anyway")
def test_a_read_only_folder_is_one_line(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(WriteError, match="Permission denied; write somewhere you may write"):
            atomic_write_text(folder / "t.yaml", "x")
    finally:
        folder.chmod(0o755)


def test_a_read_only_folder_as_root_too_by_faking_the_refusal(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(fileio.tempfile, "mkstemp", refuse)
    with pytest.raises(WriteError, match=r"t\.yaml: Permission denied; write somewhere you may write"):
        atomic_write_text(tmp_path / "t.yaml", "x")


def test_a_directory_or_a_file_in_the_path_is_one_line(tmp_path):
    with pytest.raises(WriteError, match="Is a directory; name a file, not a directory"):
        atomic_write_text(tmp_path, "x")
    (tmp_path / "f").write_text("")
    with pytest.raises(WriteError, match="cannot write .*f/t.yaml"):
        atomic_write_text(tmp_path / "f" / "t.yaml", "x")
