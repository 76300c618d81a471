"""The one atomic write: whole or nothing, never a temp file left behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import pytest

from neffbuild.errors import DiskError, IntegrityError
from neffbuild.fs.atomic import write_atomic, write_atomic_at


def test_replace_and_keep(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    assert write_atomic(target, b"one") and target.read_bytes() == b"one"
    assert write_atomic(target, b"two") and target.read_bytes() == b"two"
    assert not write_atomic(target, b"three", mode=0o444, replace=False)  # an existing name is kept
    assert target.read_bytes() == b"two" and os.listdir(tmp_path) == ["doc.json"]
    fresh = tmp_path / "new.json"
    assert write_atomic(fresh, b"x", mode=0o444, replace=False) and fresh.stat().st_mode & 0o777 == 0o444


def test_a_failing_writer_leaves_the_target_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    target.write_bytes(b"old")

    def half(out: BinaryIO) -> None:
        out.write(b"half of it")
        raise IntegrityError("changed while copying")

    with pytest.raises(IntegrityError):
        write_atomic(target, half)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["doc.json"]


def test_a_failing_rename_is_a_disk_error_and_leaves_no_temp(tmp_path: Path) -> None:
    (tmp_path / "d" / "inside").mkdir(parents=True)  # a non-empty directory cannot be replaced by a file
    with pytest.raises(DiskError, match=f"{tmp_path}/d: Is a directory"):
        write_atomic(tmp_path / "d", b"x")
    assert sorted(os.listdir(tmp_path)) == ["d"]
    with pytest.raises(DiskError, match="No such file or directory"):
        write_atomic(tmp_path / "absent" / "x", b"x")


def test_relative_to_a_directory_descriptor(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert write_atomic_at(fd, "state.json", b"{}", shown=tmp_path / "state.json")
        (tmp_path / "dir").mkdir()
        (tmp_path / "dir" / "x").touch()
        with pytest.raises(DiskError, match="shown/here"):
            write_atomic_at(fd, "dir", b"{}", shown=Path("shown/here"))
    finally:
        os.close(fd)
    assert (tmp_path / "state.json").read_bytes() == b"{}" and sorted(os.listdir(tmp_path)) == ["dir", "state.json"]
