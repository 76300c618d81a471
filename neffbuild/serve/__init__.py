"""For serving code, in the order a server calls them:

- `prepare(pipe, manifest)` applies to a loaded pipeline exactly what the build applied (the
  entry's recipe and torch.compile with the same arguments on the same callables);
- `warmup(pipe, manifest, readiness_file=...)` calls it once per listed shape before traffic and
  fails if one compiled (a readiness gate);
- `guard(manifest, mode=..., events=...)` records, warns about or refuses what compiles while
  serving; `neffbuild suggest` turns its events into manifest shapes.

Set the pulled cache's exports (`neffbuild.apply_exports`, or what `pull` prints) before torch is
imported.
"""

from neffbuild.serve.guard import Guard, guard
from neffbuild.serve.prepare import check_pipeline_matches, prepare, select_entry
from neffbuild.serve.warmup import ShapeWarmup, WarmupReport, warmup

__all__ = [
    "Guard",
    "ShapeWarmup",
    "WarmupReport",
    "check_pipeline_matches",
    "guard",
    "prepare",
    "select_entry",
    "warmup",
]
