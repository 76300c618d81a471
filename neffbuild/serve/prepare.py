"""`neffbuild.serve.prepare(pipe, manifest)` applies to a loaded pipeline exactly what the build
applied: the entry's recipe (memory format, fusions, attention backend, quantization) and
torch.compile with the same arguments on the same callables.

It runs the very function the build worker and `verify --replay` run (Backend.apply_mode ->
backends/recipe.py), so build and serving cannot drift.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from neffbuild.backends import get_backend
from neffbuild.documents.manifest import LoadedManifest, ModelEntry, load_manifest
from neffbuild.errors import InputError, PipelineMismatch


def prepare(
    pipe: Any,
    manifest: str | os.PathLike[str] | LoadedManifest,
    entry: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Apply the manifest entry's recipe to `pipe` and compile its components; return the pipeline.

    entry: the entry's id; None picks the one entry whose pipeline class is `pipe`'s. Refuses
    (PipelineMismatch, exit 2) a pipeline whose class, dtype or components differ from the entry.
    An entry with artifact 'package' loads its packages from `cache_dir` (default: the backend's
    cache variable, as the pulled release's exports set it) and compiles nothing.
    """
    loaded = manifest if isinstance(manifest, LoadedManifest) else load_manifest(_path(manifest))
    chosen = select_entry(loaded, type(pipe).__name__, entry)
    check_pipeline_matches(pipe, chosen)
    backend = get_backend(chosen.backend)
    backend.prepare_process(len(chosen.expanded_shapes()))
    return backend.apply_mode(pipe, chosen, _artifacts(backend.cache_env, chosen, cache_dir))


def _artifacts(cache_env: str, entry: ModelEntry, cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """Where an artifact entry's packages are: only an entry that ships some needs the dir."""
    if not any(entry.recipe_for(c).artifact != "cache" for c in entry.components) or entry.mode == "eager":
        return None
    where = cache_dir if cache_dir is not None else os.environ.get(cache_env)
    if not where:
        raise InputError(
            f"model[{entry.id}] ships AOTInductor packages, and neither cache_dir= nor {cache_env} says where",
            hint="apply the pulled release's exports (neffbuild.apply_exports) or pass cache_dir=",
        )
    return Path(where)


def select_entry(loaded: LoadedManifest, pipeline: str, entry: str | None) -> ModelEntry:
    entries = loaded.manifest.models
    if entry is not None:
        found = next((e for e in entries if e.id == entry), None)
        if found is None:
            raise InputError(
                f"{loaded.path}: no entry {entry!r}", hint=f"its entries: {', '.join(e.id for e in entries)}"
            )
        return found
    matching = [e for e in entries if e.pipeline == pipeline]
    if len(matching) == 1:
        return matching[0]
    ids = ", ".join(e.id for e in (matching or entries))
    raise InputError(
        f"{loaded.path}: {len(matching)} entries build a {pipeline}: cannot tell which to apply",
        hint=f"pass entry= one of {ids}",
    )


def check_pipeline_matches(pipe: Any, entry: ModelEntry) -> None:
    """The pipeline must be the one the entry built: a recipe on another one compiles from scratch."""
    where = f"model[{entry.id}]"
    if type(pipe).__name__ != entry.pipeline:
        raise PipelineMismatch(
            f"{where}: the pipeline is a {type(pipe).__name__}, the entry built a {entry.pipeline}",
            hint="load the pipeline the manifest names, or pass entry= the one that built this class",
        )
    if entry.mode == "eager":
        return
    for name in dict.fromkeys(name for name, _method in entry.components_named()):
        module = getattr(pipe, name, None)
        if module is None:
            raise PipelineMismatch(f"{where}: the pipeline has no component {name!r}", hint="load the full pipeline")
        dtype = str(getattr(module, "dtype", "")).removeprefix("torch.")
        if dtype and dtype != entry.dtype:
            raise PipelineMismatch(
                f"{where}: {name} is {dtype}, the entry built {entry.dtype}",
                hint=f"load with torch_dtype=torch.{entry.dtype}: every graph is keyed by its dtype",
            )


def _path(manifest: str | os.PathLike[str]) -> Path:
    return Path(manifest)
