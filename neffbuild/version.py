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
            dist_infos, eggs = _listing(entry or ".")
        except NotADirectoryError:
            return None
        except OSError:
            continue
        if any(egg.startswith(wanted) for egg in eggs):
            return None
        found = dist_infos.get(wanted, ())
        if len(found) > 1:
            return None
        if found:
            try:
                text = (Path(entry or ".") / found[0] / "METADATA").read_text()
            except OSError:
                return None
            return _header_version(text)
    return ""


# What a sys.path directory holds of distributions: each normalised name's dist-info directories,
# and the normalised names of its eggs (egg-info too).
_Listing = tuple[dict[str, list[str]], tuple[str, ...]]
_LISTINGS: dict[str, tuple[tuple[int, int, int], _Listing]] = {}


def _listing(path: str) -> _Listing:
    """path's distributions, from os.listdir, kept while the directory is the same one with the
    same mtime: a host check asks for four distributions, each a walk of sys.path (a listing per
    entry was most of it, then matching its names once per distribution)."""
    st = os.stat(path)
    seen = (st.st_dev, st.st_ino, st.st_mtime_ns)
    kept = _LISTINGS.get(path)
    if kept is not None and kept[0] == seen:
        return kept[1]
    names = os.listdir(path)
    dist_infos: dict[str, list[str]] = {}
    for name in names:
        if name.endswith(".dist-info") and (m := _DIST_INFO.fullmatch(name)):
            dist_infos.setdefault(_normal(m[1]), []).append(name)
    listing = dist_infos, tuple(_normal(n) for n in names if n.endswith((".egg-info", ".egg")))
    _LISTINGS[path] = (seen, listing)
    return listing


def _header_version(text: str) -> str | None:
    for line in text.splitlines():
        if not line:
            break  # the headers end at the first blank line
        if line.startswith("Version:"):
            return line.removeprefix("Version:").strip()
    return None
