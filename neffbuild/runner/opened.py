"""Which files under one dir this process opened while a block ran (worker side of
`verify --replay --trace`): `with opened_under(cache_dir) as seen: ...`, then `seen.paths`.

Two sources, because a compiler's cache is read two ways:
- Python's audit events (PEP 578): `open` (builtins.open, io.open_code, os.open: the graph
  and autograd cache entries, the generated .py kernels Inductor reads and execs) and
  `ctypes.dlopen` (the C++ kernels Inductor loads with cdll.LoadLibrary);
- /proc/self/maps before and after: a shared library loaded by native code raises no audit event
  (an extension module imported through importlib, as Inductor's Python-binding kernels are, is
  dlopened by the interpreter's C code), but it stays mapped;
- `subprocess.Popen` events: a path under root named in a child's command line counts as opened
  (Inductor's ISA probe dlopens its probe library in a child `python -c`).
Not seen: reads by native code that maps nothing (a C++ fopen), a child's reads of files its command
line does not name, and files only checked for existence (os.stat raises no audit event: Inductor
rewrites an absent kernel source before it loads the kernel, so such a file is needed unopened).

An audit hook cannot be removed, so one module-level hook is installed on first use and records
only while a block runs (one at a time per process, as the worker runs its units).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

_MAPS = "/proc/self/maps"


@dataclass
class Opened:
    """What one block opened under root: paths relative to it, files only."""

    root: Path
    paths: tuple[str, ...] = ()
    _raw: set[str] = field(default_factory=set)
    _prefixes: tuple[str, ...] = ()


_state: dict[str, Opened | None] = {"current": None}
_installed = {"hook": False}


def _hook(event: str, args: tuple[object, ...]) -> None:
    current = _state["current"]
    if current is None or not args:
        return
    if event == "subprocess.Popen":
        _named(current, args[1])
        return
    if event != "open" and event != "ctypes.dlopen":
        return
    path = args[0]
    if isinstance(path, int) or path is None:  # an open fd, or dlopen(None): the process itself
        return
    try:
        name = os.fsdecode(os.fspath(path))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return
    current._raw.add(name if os.path.isabs(name) else os.path.abspath(name))  # the cwd of the time


def _named(current: Opened, argv: object) -> None:
    """Paths under root named in a child's command line (whole words, or inside a -c program)."""
    words = [argv] if isinstance(argv, str | bytes) else argv if isinstance(argv, list | tuple) else []
    for word in words:
        text = os.fsdecode(word) if isinstance(word, str | bytes) else ""
        for prefix in current._prefixes:
            for match in re.finditer(re.escape(prefix) + r"[^\s'\"]+", text):
                current._raw.add(match.group())


@contextmanager
def opened_under(root: Path) -> Iterator[Opened]:
    """Record the files under root that the block opens (the result is complete on exit)."""
    if not _installed["hook"]:
        sys.addaudithook(_hook)
        _installed["hook"] = True
    if _state["current"] is not None:
        raise RuntimeError("opened_under does not nest")
    absolute = os.path.abspath(root)
    prefixes = tuple(dict.fromkeys(p.rstrip("/") + "/" for p in (absolute, os.path.realpath(absolute))))
    seen = Opened(Path(absolute), _prefixes=prefixes)
    maps_before = _mapped()
    _state["current"] = seen
    try:
        yield seen
    finally:
        _state["current"] = None
        seen._raw.update(_mapped() - maps_before)
        seen.paths = _relative(seen)


def _mapped() -> set[str]:
    """The files this process has mapped (empty where there is no /proc)."""
    try:
        with open(_MAPS, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    files = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            files.add(parts[5].removesuffix(" (deleted)"))
    return files


def _relative(seen: Opened) -> tuple[str, ...]:
    found = set()
    for name in seen._raw:
        full = os.path.normpath(name)
        for prefix in seen._prefixes:
            if full.startswith(prefix):
                rel = full[len(prefix) :]
                if os.path.isfile(os.path.join(prefix, rel)):  # a dir opened for its fd is no file read
                    found.add(rel)
                break
    return tuple(sorted(found))
