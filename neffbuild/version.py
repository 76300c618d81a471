"""The package's version, importable by every stage without the package's own __init__."""

import os
import re
import sys
from pathlib import Path

__version__ = "0.1.0"


def installed_version(distribution: str) -> str:
    """An installed distribution's version, "" when it is not installed. Read from the header of
    its METADATA in the dist-info directory on sys.path where the path holds only directories:
    importing importlib.metadata costs about 35 ms (most of a no-op pull's host check), and its
    version() parses the whole file, long description included (13 ms for transformers')."""
    found = _dist_info_version(distribution)
    if found is not None:
        return found
    from importlib import metadata

    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return ""
    return _header_version(dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "") or dist.version or ""


_DIST_INFO = re.compile(r"([^-]+)-[^-]+\.dist-info")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dist_info_version(package: str) -> str | None:
    """The Version of package's first dist-info on sys.path, "" where none has one; None where
    that cannot be told so (a zip or egg on the path, two dist-infos in one directory, no Version)."""
    wanted = _normal(package)
    for entry in sys.path:
        try:
            names = _listing(entry or ".")
        except NotADirectoryError:
            return None
        except OSError:
            continue
        if any(n.endswith((".egg-info", ".egg")) and _normal(n).startswith(wanted) for n in names):
            return None
        found = [
            n for n in names if n.endswith(".dist-info") and (m := _DIST_INFO.fullmatch(n)) and _normal(m[1]) == wanted
        ]
        if len(found) > 1:
            return None
        if found:
            try:
                text = (Path(entry or ".") / found[0] / "METADATA").read_text()
            except OSError:
                return None
            return _header_version(text)
    return ""


_LISTINGS: dict[str, tuple[tuple[int, int, int], list[str]]] = {}


def _listing(path: str) -> list[str]:
    """os.listdir(path), kept while the directory is the same one with the same mtime: a host
    check asks for four distributions, each a walk of sys.path (a listing per entry was most of it)."""
    st = os.stat(path)
    seen = (st.st_dev, st.st_ino, st.st_mtime_ns)
    kept = _LISTINGS.get(path)
    if kept is not None and kept[0] == seen:
        return kept[1]
    names = os.listdir(path)
    _LISTINGS[path] = (seen, names)
    return names


def _header_version(text: str) -> str | None:
    for line in text.splitlines():
        if not line:
            break  # the headers end at the first blank line
        if line.startswith("Version:"):
            return line.removeprefix("Version:").strip()
    return None
