"""Scratch space on the real filesystem: a run's scratch root, and its removal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neffbuild.errors import InputError
from neffbuild.runner.scratch import make_scratch_root, remove_tree


def test_scratch_root_is_created_in_the_work_dir_or_refused_with_an_input_error(tmp_path: Path) -> None:
    root = make_scratch_root(tmp_path / "new" / "work", "neffbuild-work-")
    assert root.parent == tmp_path / "new" / "work" and root.is_dir()
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(InputError, match=f"work dir {a_file / 'sub'}: cannot make a scratch dir there"):
        make_scratch_root(a_file / "sub", "neffbuild-work-")


def test_remove_tree_removes_read_only_dirs(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    os.chmod(tree / "a" / "b" / "f", 0o444)
    os.chmod(tree / "a" / "b", 0o555)
    os.chmod(tree / "a", 0o555)
    remove_tree(tree)
    assert not tree.exists()
