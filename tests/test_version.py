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
