"""fs/disk.py: which filesystems keep their files in memory (read from a mount table)."""

from __future__ import annotations

import os
from pathlib import Path

from neffbuild.fs.disk import in_memory


def _table(tmp_path: Path, fstype: str) -> Path:
    """A mount table naming tmp_path's device as a mount of fstype (the format of /proc/self/mountinfo)."""
    dev = os.stat(tmp_path).st_dev
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 0:99 / /elsewhere rw,relatime shared:1 - tmpfs tmpfs rw\n"
        f"23 1 {os.major(dev)}:{os.minor(dev)} / /here rw,relatime shared:2 - {fstype} /dev/x rw\n"
    )
    return table


def test_a_tmpfs_mount_is_in_memory_and_a_disk_is_not(tmp_path: Path) -> None:
    assert in_memory(tmp_path, _table(tmp_path, "tmpfs"))
    assert in_memory(tmp_path, _table(tmp_path, "ramfs"))
    assert not in_memory(tmp_path, _table(tmp_path, "ext4"))


def test_what_cannot_be_told_is_not_in_memory(tmp_path: Path) -> None:
    assert not in_memory(tmp_path, tmp_path / "no-such-table")
    assert not in_memory(tmp_path / "missing", _table(tmp_path, "tmpfs"))
    (tmp_path / "other").write_text("22 1 0:99 / /elsewhere rw - tmpfs tmpfs rw\n")
    assert not in_memory(tmp_path, tmp_path / "other")  # its device is not listed


def test_this_machines_dev_shm_is_told_as_the_kernel_says(tmp_path: Path) -> None:
    # The real table: /dev/shm is tmpfs on Linux, the pytest tmp dir here is not in memory
    # unless TMPDIR points there.
    shm = Path("/dev/shm")
    if shm.is_dir():
        assert in_memory(shm) == ("tmpfs" in Path("/proc/mounts").read_text().split("/dev/shm ")[-1].split(" ", 1)[0])
