"""Worker side, Inductor: cache entries whose bytes do not depend on when they were compiled.

Inductor's graph entries (`fxgraph/<key>/<name>`) and AOTAutograd's (`aotautograd/<key>/<name>`)
are pickles named by a hash of their own bytes, and each carries how long its compile took
(`_time_taken_ns`, `forward_time_taken_ns`, `backward_time_taken_ns`): so every compile of one
unit wrote entries of other bytes under other names, and no two builds released the same id.
Those times are read only to log the time a hit saves, so the worker records them as zero
before each entry is pickled. Where a torch version lacks these methods nothing is patched:
builds still work, their entries just differ from build to build (docs/ci.md says so).

Graph and AOTAutograd entries also keep the lines that explain their key, for a log line on a
miss; they show functions by repr, with their address in the compiling process: those addresses
are written as `0x?`.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

log = logging.getLogger(__name__)
# `<function select_decomp_table at 0x7f8987881080>`: an object's address in this process.
_ADDRESS = re.compile(r" at 0x[0-9a-f]+>")


def zero_compile_times() -> bool:
    """Patch the two entry writers of this process; whether both were found."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        from torch._inductor.codecache import FxGraphCache
    except ImportError:
        return False
    patched = 0
    save_graph = getattr(FxGraphCache, "_save_graph", None)
    if save_graph is not None and not getattr(save_graph, "neffbuild_patched", False):

        @functools.wraps(save_graph)
        def _save_graph(key: str, compiled_graph: Any, *args: Any, **kwargs: Any) -> None:
            if hasattr(compiled_graph, "_time_taken_ns"):
                compiled_graph._time_taken_ns = 0
            lines = getattr(compiled_graph, "_fx_graph_cache_debug_lines", None)
            if isinstance(lines, list):
                compiled_graph._fx_graph_cache_debug_lines = _scrubbed(lines)
            return save_graph(key, compiled_graph, *args, **kwargs)

        _save_graph.neffbuild_patched = True  # type: ignore[attr-defined]
        FxGraphCache._save_graph = staticmethod(_save_graph)
        patched += 1
    save_entry = getattr(AOTAutogradCache, "save", None)
    if save_entry is not None and not getattr(save_entry, "neffbuild_patched", False):

        @functools.wraps(save_entry)
        def _save(key: str, entry: Any, *args: Any, **kwargs: Any) -> None:
            for name in ("forward_time_taken_ns", "backward_time_taken_ns"):
                if hasattr(entry, name):
                    setattr(entry, name, 0)
            for name in ("compiled_fw", "compiled_bw"):
                _without_addresses(getattr(entry, name, None))
            return save_entry(key, entry, *args, **kwargs)

        _save.neffbuild_patched = True  # type: ignore[attr-defined]
        AOTAutogradCache.save = staticmethod(_save)
        patched += 1
    if patched < 2:
        log.warning(
            "this torch lacks an Inductor cache writer neffbuild knows: entries will differ from build to build"
        )
    return patched == 2


def _without_addresses(compiled: Any) -> None:
    info = getattr(compiled, "fx_graph_cache_info", None)
    if not (isinstance(info, tuple) and len(info) == 2 and isinstance(info[1], list)):
        return
    object.__setattr__(compiled, "fx_graph_cache_info", (info[0], _scrubbed(info[1])))


def _scrubbed(lines: list[Any]) -> list[Any]:
    return [_ADDRESS.sub(" at 0x?>", line) if isinstance(line, str) else line for line in lines]
