"""Where TorchNeuron and libneuronxla put cache entries in one dir, and which of its files a
bundle takes: finished entries only, never temp files, locks or cached failures."""

from __future__ import annotations

import re
from pathlib import Path

# TorchNeuron: $DIR/ab/cd/<32 hex>.neff, written to `.tmp.*` then renamed (locks live elsewhere).
_NEFF_ENTRY = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{2})/(\1\2[0-9a-f]{28})\.neff$")
# Its Python compiler path (synchronous eager ops): $DIR/<sha256>/<sha256>.neff, written to a
# `tmp*.tmp` file beside it then renamed (kernels/cache_utils.py:28-38).
_SUBPROCESS_ENTRY = re.compile(r"^([0-9a-f]{64})/\1\.neff$")
# What upstream leaves only after a crash between write and rename: never bundled, not unknown.
_TEMP_FILE = re.compile(r"^(?:[0-9a-f]{2}/[0-9a-f]{2}/\.tmp\.[A-Za-z0-9]{6}|[0-9a-f]{64}/tmp[^/]*\.tmp)$")
# libneuronxla (torch-xla based): neuronxcc-<ver>/MODULE_<graph hash>+<flags hash>/<file>.
_MODULE_FILE = re.compile(r"^neuronxcc-[^/]+/MODULE_[^/]+/[^/]+$")
_MODULE_KEEP = frozenset(
    {"model.neff", "model.done", "compile_flags.json", "compile_flags.txt", "model.hlo_module.pb", "model.hlo.pb"}
)


def cache_files(cache_dir: Path) -> list[str]:
    """The entries a bundle takes from cache_dir, as sorted relative paths."""
    selected = []
    for path in sorted(cache_dir.rglob("*.neff")):
        rel = path.relative_to(cache_dir).as_posix()
        if (_NEFF_ENTRY.match(rel) or _SUBPROCESS_ENTRY.match(rel)) and is_plain_file(path):
            selected.append(rel)
    selected.extend(_complete_module_files(cache_dir))
    return sorted(selected)


def unrecognised_files(cache_dir: Path, selected: set[str], state_dir: str) -> list[str]:
    """Files in cache_dir that are neither selected, a leftover temp file, nor a libneuronxla
    file; state_dir (pull's own state in a pulled dir) is skipped."""
    found = []
    for path in sorted(cache_dir.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        rel = path.relative_to(cache_dir).as_posix()
        if rel.startswith(f"{state_dir}/"):
            continue
        if rel not in selected and not _TEMP_FILE.match(rel) and not _MODULE_FILE.match(rel):
            found.append(rel)
    return found


def is_content_keyed(path: str) -> bool:
    # Every layout names entries by a hash of what they compile: any copy of a path serves.
    return bool(_NEFF_ENTRY.match(path) or _SUBPROCESS_ENTRY.match(path) or _MODULE_FILE.match(path))


def subprocess_entry_count(root: Path) -> int:
    """How many entries the Python compiler path has written under root."""
    return sum(
        1 for p in root.glob("*/*.neff") if _SUBPROCESS_ENTRY.match(p.relative_to(root).as_posix()) and is_plain_file(p)
    )


def _complete_module_files(cache_dir: Path) -> list[str]:
    """libneuronxla entries that finished: model.done beside model.neff and no *.lock. An entry
    with only model.log is a cached failure (poisoned); one with a lock is still compiling."""
    selected = []
    for entry in sorted(cache_dir.glob("neuronxcc-*/MODULE_*")):
        names = {p.name for p in entry.iterdir()} if entry.is_dir() else set()
        if not {"model.done", "model.neff"} <= names or any(n.endswith(".lock") for n in names):
            continue
        for name in sorted(names & _MODULE_KEEP):
            if is_plain_file(entry / name):
                selected.append((entry / name).relative_to(cache_dir).as_posix())
    return selected


def is_plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()
