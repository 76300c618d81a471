"""neffbuild: build, publish and pull compiled-model caches for static-shape pipelines.

For serving code: `ensure_cache(ref, store=..., cache_dir=...)` pulls in-process and returns a
PullReport; `apply_exports(report)` sets its variables (before the compiler is imported).
"""

from __future__ import annotations

from typing import Any

__all__ = ["__version__", "apply_exports", "ensure_cache"]


def __getattr__(name: str) -> Any:
    # Lazy: `import neffbuild` (and the CLI's start-up) stays as light as it was.
    if name in ("apply_exports", "ensure_cache"):
        from neffbuild import api

        return getattr(api, name)
    if name == "__version__":
        from neffbuild.version import __version__

        return __version__
    raise AttributeError(f"module 'neffbuild' has no attribute {name!r}")
