"""Artifact `package` (backends/artifacts.py): the transformer and `vae.decode` of the tiny pipeline
built as AOTInductor packages for two static shapes (conftest's `package_release`, built once per
run), pulled into another path and made read-only; a fresh process prepares and warms up from it,
and serves both shapes with no Dynamo frame and no C++ kernel compiled, images equal to eager's; a
third shape is refused naming it, and the serving guard records it as an event `suggest` turns
into the shape. The same for the code `neffbuild recipe` prints, and `verify --replay` proves it
per unit (and fails when the loader's kernels are missing from the cache dir)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from neffbuild.backends.inductor import InductorBackend
from neffbuild.documents.manifest import load_manifest
from tests.conftest import PACKAGE, ROOT, PackageRelease, write_manifest, write_model_index

# A server as docs/serving.md writes one (or one that runs `neffbuild recipe`'s printed code),
# counting every Dynamo frame and C++ build it starts.
SERVER = r"""
import json, os, sys
exports, manifest, model, how, events = sys.argv[1:6]
os.environ.update(json.loads(exports))
import torch, diffusers
import torch._dynamo
from torch._inductor import cpp_builder

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
out = {}
if how == "prepare":
    import neffbuild.serve as serve
    pipe = serve.prepare(load(), manifest)
    report = serve.warmup(pipe, manifest)
    out["warmup"] = [[s.shape, s.compiles] for s in report.shapes]
    serve.guard(manifest, pipe=pipe, mode="record", events=events).install()
else:
    pipe = load()
    exec(open(how).read(), {"pipe": pipe})
packaged = {w: images(pipe, w) for w in (128, 256)}
out.update(counts)
try:
    images(pipe, 192)
    out["refused"] = None
except Exception as exc:
    out["refused"] = f"{type(exc).__name__}: {exc}"
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


@dataclass(frozen=True)
class Host:
    cache: Path  # a read-only copy of the shared pulled release (but locks/)
    exports: str  # `neffbuild env --json` for it


@pytest.fixture(scope="module")
def host(package_release: PackageRelease, tmp_path_factory: pytest.TempPathFactory, cli) -> Host:
    cache = tmp_path_factory.mktemp("host") / "cache"
    shutil.copytree(package_release.cache, cache)  # symlinks followed: the shared build is never chmod'ed
    exports = cli("env", "--cache-dir", str(cache), "--json")
    assert exports.returncode == 0, exports.stderr
    (cache / "locks").mkdir(exist_ok=True)
    _read_only(cache)
    return Host(cache, exports.stdout)


def serve(host: Host, manifest: Path, model: Path, how: str, events: Path) -> dict:
    """One fresh serving process against the host's cache dir; its RESULT, and whether it left the
    cache dir's files as they were."""

    def files() -> list[str]:
        return sorted(p.relative_to(host.cache).as_posix() for p in host.cache.rglob("*") if "locks" not in p.parts)

    before = files()
    run = subprocess.run(
        [sys.executable, "-c", SERVER, host.exports, str(manifest), str(model), how, str(events)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {**result, "unchanged": before == files()}


@pytest.fixture(scope="module")
def packaged(package_release: PackageRelease, host: Host, tiny_model: Path, tmp_path_factory) -> dict:
    events = tmp_path_factory.mktemp("events") / "compiles.jsonl"
    return {**serve(host, package_release.manifest, tiny_model, "prepare", events), "events": events}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first one builds: two shapes, compile and package (minutes each)
def test_a_pulled_read_only_release_serves_both_shapes_with_no_compile(packaged: dict) -> None:
    assert packaged["warmup"] == [["128x128x1", 0], ["128x256x1", 0]]
    assert packaged["frames"] == 0 and packaged["kernel_builds"] == 0
    assert packaged["unchanged"]
    assert max(packaged["diff"].values()) < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_shape_no_package_covers_is_refused_naming_shape_component_and_entry(packaged: dict) -> None:
    refused = packaged["refused"]
    assert refused.startswith("UnlistedShape")
    assert "128x192x1" in refused and "transformer" in refused and "model[klein]" in refused


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_guard_records_only_the_unlisted_call_and_suggest_adds_its_shape(
    packaged: dict, package_release: PackageRelease, tmp_path: Path, cli
) -> None:
    # Both listed shapes were served under the guard (hits: no event); the third, one refused event.
    [event] = [json.loads(line) for line in packaged["events"].read_text().splitlines()]
    assert event["refused"] is True and event["artifact"] == "package"
    assert event["component"] == "transformer" and event["call"] == {"height": 128, "width": 192, "batch": 1}
    manifest = tmp_path / "package.toml"
    shutil.copy(package_release.manifest, manifest)
    suggested = cli("suggest", str(manifest), str(packaged["events"]), "--json")
    assert suggested.returncode == 0, suggested.stderr
    [entry] = json.loads(suggested.stdout)["entries"]
    assert entry["entry"] == "klein" and entry["added"] == ["128x192x1"], suggested.stdout


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_printed_recipe_loads_the_packages_and_compiles_nothing(
    package_release: PackageRelease, host: Host, tiny_model: Path, tmp_path: Path, cli
) -> None:
    printed = cli("recipe", str(package_release.manifest))
    assert printed.returncode == 0, printed.stderr
    assert "neffbuild" not in printed.stdout.replace("# neffbuild recipe", "").replace("`neffbuild pull`", "")
    code = tmp_path / "recipe.py"
    code.write_text(printed.stdout)
    result = serve(host, package_release.manifest, tiny_model, str(code), tmp_path / "unused.jsonl")
    assert result["frames"] == 0 and result["kernel_builds"] == 0 and result["unchanged"]
    assert max(result["diff"].values()) < 1e-3
    assert result["refused"].startswith("RuntimeError") and "no package for inputs" in result["refused"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_replay_loads_the_packages_and_proves_no_frame_and_no_kernel_compiled(
    package_release: PackageRelease, cli
) -> None:
    result = cli(
        "verify", str(package_release.manifest), "--cache-dir", str(package_release.cache), "--replay", "--json"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    units = json.loads(result.stdout)["units"]
    assert [u["unit_id"] for u in units] == ["klein/128x128x1", "klein/128x256x1"]
    for unit in units:
        counters = unit["counters"]
        assert unit["compiles"] == 0 and unit["written"] == [], unit
        # Served by the packages (2 denoising steps, one decode), not by the cache path's graphs.
        assert counters["neffbuild.packages.transformer"] == 2 and counters["neffbuild.packages.vae.decode"] == 1
        assert not any(k.startswith(("graphs.", "inductor.", "neffbuild.compiles.")) for k in counters), counters


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_replay_fails_when_loading_the_packages_compiles_their_kernels(
    package_release: PackageRelease, tmp_path: Path, cli
) -> None:
    # Without the loader's runtime kernels (the .so files outside aoti/), loading the packages
    # builds them again: a fresh host would pay that at start-up, and the replay says so.
    cache = tmp_path / "cache"
    shutil.copytree(package_release.cache, cache)
    kernels = [p for p in cache.rglob("*.so") if "aoti" not in p.relative_to(cache).parts]
    assert kernels
    for path in kernels:
        path.unlink()
    result = cli("verify", str(package_release.manifest), "--cache-dir", str(cache), "--replay", "--json")
    assert result.returncode == 6, result.stderr[-3000:]
    first, second = json.loads(result.stdout)["units"]
    assert first["compiles"] > 0 and first["counters"]["load.neffbuild.compiles.kernel_builds"] > 0
    assert second["compiles"] == 0


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
