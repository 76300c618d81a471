"""Artifact `package` (backends/artifacts.py): the transformer and `vae.decode` of the tiny pipeline
built as AOTInductor packages for two static shapes, pulled into another path and made read-only;
a fresh process prepares and warms up from it, and serves both shapes with no Dynamo frame and no
C++ kernel compiled, images equal to eager's; a third shape is refused naming it.

The slow tests share one build (`packaged_build`, made once per run in tests/conftest.py, which
bench/firstcall.py's smoke run looks up too): one entry, two shapes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.backends.inductor import InductorBackend
from neffbuild.documents.manifest import load_manifest
from tests.conftest import PACKAGE, ROOT, SharedBuild, write_manifest, write_model_index

# A server as docs/serving.md writes one, counting every Dynamo frame and C++ build it starts.
SERVER = r"""
import json, os, sys
exports, manifest, model = sys.argv[1:4]
os.environ.update(json.loads(exports))
import torch, diffusers
import torch._dynamo
from torch._inductor import cpp_builder
import neffbuild.serve as serve
from neffbuild.errors import UnlistedShape

counts = {"frames": 0, "kernel_builds": 0}
torch._dynamo.callback_handler.register_start_callback(lambda *a: counts.__setitem__("frames", counts["frames"] + 1))
build = cpp_builder.CppBuilder.build
def counted(self, *a, **k):
    counts["kernel_builds"] += 1
    return build(self, *a, **k)
cpp_builder.CppBuilder.build = counted

def images(pipe, width):
    with torch.inference_mode():
        return pipe(prompt="a photo of a cat", height=128, width=width, num_inference_steps=2, max_sequence_length=64,
                    text_encoder_out_layers=[1], output_type="pt", generator=torch.Generator().manual_seed(0)).images

load = lambda: diffusers.Flux2KleinPipeline.from_pretrained(model, torch_dtype=torch.float32)
pipe = serve.prepare(load(), manifest)
report = serve.warmup(pipe, manifest)
packaged = {w: images(pipe, w) for w in (128, 256)}
out = {"warmup": [[s.shape, s.compiles] for s in report.shapes], **counts}
try:
    images(pipe, 192)
    out["refused"] = None
except UnlistedShape as exc:
    out["refused"] = str(exc)
eager = load()
out["diff"] = {w: float((packaged[w] - images(eager, w)).abs().max()) for w in packaged}
print("RESULT " + json.dumps(out))
"""


def _read_only(root: Path) -> None:
    """As a host mounts a pulled cache: all read-only but `locks/` (docs/hosts.md)."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.name != "locks" and "locks" not in path.relative_to(root).parts:
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    root.chmod(root.stat().st_mode & ~stat.S_IWUSR)


@pytest.fixture(scope="module")
def packaged(packaged_build: SharedBuild, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> dict:
    """The shared package build (tests/conftest.py) pulled into another path, read-only, served."""
    manifest, store = packaged_build.manifest, packaged_build.store
    cache = tmp_path_factory.mktemp("packages") / "pulled" / "cache"
    pull = cli("pull", packaged_build.report["release_id"], "--store", str(store), "--cache-dir", str(cache))
    assert pull.returncode == 0, pull.stderr
    exports = cli("env", "--cache-dir", str(cache), "--json")
    assert exports.returncode == 0, exports.stderr
    (cache / "locks").mkdir(exist_ok=True)
    _read_only(cache)
    before = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if "locks" not in p.parts)
    run = subprocess.run(
        [sys.executable, "-c", SERVER, exports.stdout, str(manifest), str(tiny_model)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    after = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if "locks" not in p.parts)
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {"result": result, "cache": cache, "unchanged": before == after}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one builds: two shapes, compile and package (minutes each)
def test_a_pulled_read_only_release_serves_both_shapes_with_no_compile(packaged: dict) -> None:
    result = packaged["result"]
    assert result["warmup"] == [["128x128x1", 0], ["128x256x1", 0]]
    assert result["frames"] == 0 and result["kernel_builds"] == 0
    assert packaged["unchanged"]
    assert max(result["diff"].values()) < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one builds: two shapes, compile and package (minutes each)
def test_a_shape_no_package_covers_is_refused_naming_shape_component_and_entry(packaged: dict) -> None:
    refused = packaged["result"]["refused"]
    assert refused and "128x192x1" in refused and "transformer" in refused and "model[klein]" in refused


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one builds: two shapes, compile and package (minutes each)
def test_the_bundle_records_each_packages_difference_from_the_compiled_component(packaged: dict) -> None:
    records = [json.loads(p.read_text()) for p in sorted((packaged["cache"] / "aoti").rglob("*.json"))]
    assert sorted(r["component"] for r in records) == ["transformer", "transformer", "vae.decode", "vae.decode"]
    assert all(0 <= r["max_abs_diff"] <= r["tolerance"] for r in records)


# -- fast: manifest, key and bundle layout ----------------------------------------------------------


def test_the_artifact_kind_is_keyed_and_the_default_keys_as_before(tmp_path: Path) -> None:
    write_model_index(tmp_path / "model")
    cache = load_manifest(write_manifest(tmp_path / "cache.toml", tmp_path / "model"))
    package = load_manifest(write_manifest(tmp_path / "package.toml", tmp_path / "model", extra=PACKAGE))
    [cache_entry], [package_entry] = cache.manifest.models, package.manifest.models
    assert cache_entry.recipe_document() is None
    assert package_entry.recipe_document() == {"transformer": {**package_entry.recipe_for("transformer").as_dict()}}
    assert package_entry.recipe_document()["transformer"]["artifact"] == "package"


@pytest.mark.parametrize(
    ("extra", "mode", "says"),
    [
        ("dynamic = true\n", "full", "remove dynamic"),
        ("", "regional", "needs mode 'full'"),
    ],
)
def test_a_package_entry_that_cannot_be_exported_statically_is_refused(
    tmp_path: Path, extra: str, mode: str, says: str, cli
) -> None:
    write_model_index(tmp_path / "model")
    manifest = write_manifest(tmp_path / "m.toml", tmp_path / "model", extra=PACKAGE + extra, mode=mode)
    result = cli("plan", str(manifest))
    assert result.returncode == 2 and says in result.stderr


def test_packages_are_bundled_and_aotinductors_build_dirs_are_not(tmp_path: Path) -> None:
    backend = InductorBackend()
    digest = "0123456789abcdef01234567"
    files = [
        f"aoti/transformer/{digest}/{digest}.pt2",
        f"aoti/vae.decode/{digest}/{digest}.json",
        "ciwrdn4mj5jdgr2rqayneulhttacs7nujtci3obkfbg7n35s542j/cpzv.wrapper.so",
        "th/cthddkr6tqpvvx2keoyfjfaz3e5tmldioaoosvrbpzssty5wzlrd.so",
    ]
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    assert backend.select_files(tmp_path) == [files[0], files[1], files[3]]
    assert all(backend.is_content_keyed(f) for f in (files[0], files[1], files[3]))


def test_a_packages_recorded_inputs_make_inputs_of_the_same_signature() -> None:
    # prepare's first run of each package (artifacts._first_run) must reach the package it warms
    import torch

    from neffbuild.backends.artifacts import _example, signature_digest
    from neffbuild.backends.components import signature_parts

    args = (torch.ones(1, 1, 16, 32),)
    kwargs = {"img_ids": torch.ones(1, 64, 4, dtype=torch.int64), "guidance": None, "return_dict": False}
    parts = signature_parts(args, kwargs)
    made_args = [_example(p) for p in parts if "=" not in p]
    made_kwargs = {p.split("=", 1)[0]: _example(p.split("=", 1)[1]) for p in parts if "=" in p}
    assert signature_digest(tuple(made_args), made_kwargs) == signature_digest(args, kwargs)
    assert made_kwargs["img_ids"].dtype == torch.int64 and not made_kwargs["img_ids"].any()
