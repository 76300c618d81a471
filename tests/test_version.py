"""installed_version reads a distribution's version from its METADATA header, as
importlib.metadata would, without parsing the whole file."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from neffbuild.version import installed_version


@pytest.mark.parametrize("name", ["torch", "diffusers", "transformers", "pydantic", "click", "xxhash"])
def test_an_installed_distribution_has_the_version_metadata_gives(name: str) -> None:
    assert installed_version(name) == metadata.version(name) != ""


def test_a_missing_distribution_is_empty() -> None:
    assert installed_version("neffbuild-no-such-distribution") == ""


def test_the_version_comes_from_the_header_not_the_description(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "fakedist-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakedist\nVersion: 1.2.3\n\nVersion: 9.9.9 (a line of the description)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed_version("fakedist") == "1.2.3"


def test_a_dist_info_without_a_version_or_twice_in_one_dir_asks_importlib_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neffbuild.version import _dist_info_version

    (tmp_path / "one_pkg-1.0.dist-info").mkdir()
    (tmp_path / "one_pkg-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: one-pkg\n\nVersion: 9\n")
    (tmp_path / "two-1.0.dist-info").mkdir()
    (tmp_path / "two-2.0.dist-info").mkdir()
    (tmp_path / "three-1.0.dist-info").mkdir()
    (tmp_path / "three-1.0.dist-info" / "METADATA").write_text("Name: three\nVersion: 1.0.post1\n\n")
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    assert _dist_info_version("one.pkg") is None  # no Version among the headers
    assert _dist_info_version("two") is None
    assert _dist_info_version("three") == "1.0.post1"
    assert _dist_info_version("absent") == ""
