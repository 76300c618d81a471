"""runner/opened.py: the files under a dir a block opened, by every way a compiler's cache is read
(open, os.open, io.open_code, ctypes dlopen, an extension module imported by path), and nothing
outside it, nor directories, nor anything opened after the block."""

from __future__ import annotations

import ctypes
import importlib.util
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.runner.opened import opened_under


def test_every_way_of_reading_a_cache_file_is_seen_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    (root / "fx" / "ab").mkdir(parents=True)
    for name in ("fx/ab/entry", "osopen.bin", "code.py", "unread.bin"):
        (root / name).write_bytes(b"x" * 10)
    outside = tmp_path / "outside.txt"
    outside.write_text("not under root")
    dynload = Path(sys.modules["_bisect"].__file__ or "")
    shutil.copy(dynload, root / "probe.so")
    shutil.copy(dynload, root / "kernel.so")  # a shared library, as Inductor's C++ kernels are
    (root / "ext").mkdir()
    shutil.copy(dynload, root / "ext" / dynload.name)  # an extension module, as its Python-binding kernels are
    monkeypatch.chdir(root / "fx")  # a relative name is the cwd's
    with opened_under(root) as seen:
        Path("ab/entry").read_bytes()
        os.close(os.open(root / "osopen.bin", os.O_RDONLY))
        io.open_code(str(root / "code.py")).close()
        outside.read_text()
        os.close(os.open(root / "fx", os.O_RDONLY))  # a dir opened for its fd is no file read
        ctypes.CDLL(str(root / "kernel.so"))
        spec = importlib.util.spec_from_file_location("_bisect", root / "ext" / dynload.name)
        assert spec is not None and spec.loader is not None
        spec.loader.create_module(spec)  # the interpreter dlopens it: no audit event, a mapping
        program = f"import ctypes; ctypes.CDLL('{root / 'probe.so'}')"  # as Inductor's ISA probe does
        subprocess.run([sys.executable, "-c", program], check=True)
    (root / "unread.bin").read_bytes()  # after the block
    assert seen.paths == ("code.py", f"ext/{dynload.name}", "fx/ab/entry", "kernel.so", "osopen.bin", "probe.so")


def test_a_symlinked_root_counts_paths_by_either_name(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a").write_text("a")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with opened_under(tmp_path / "link") as seen:
        (tmp_path / "real" / "a").read_text()
    assert seen.paths == ("a",)


def test_blocks_do_not_nest_and_a_later_block_starts_empty(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a")
    with opened_under(tmp_path) as first:
        (tmp_path / "a").read_text()
        with pytest.raises(RuntimeError, match="does not nest"), opened_under(tmp_path):
            pass
    with opened_under(tmp_path) as second:
        pass
    assert first.paths == ("a",) and second.paths == ()
