"""The inductor backend on real compiles: every listed component is proven compiled, and what
the key leaves out really changes no graph. One shape, one build (`built_with_decode`, made once
per run in tests/conftest.py), shared by the slow tests here and bench/firstcall.py's smoke run.
Which files of a cache dir a bundle takes is tested fast, on a layout Inductor writes; what
`verify --replay --fail-fast` stops at (watch_compiles), on one tiny function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.documents.manifest import load_manifest
from neffbuild.units.plan import make_plan
from tests.conftest import SharedBuild, write_manifest

COMPONENTS = 'components = ["transformer"]'


def manifest_with(path: Path, model: Path, components: str, *, call: tuple[str, str] | None = None) -> Path:
    written = write_manifest(path, model, widths=(128,))
    text = written.read_text()
    assert COMPONENTS in text, "the repo manifest's layout changed; update manifest_with"
    text = text.replace(COMPONENTS, f"components = {components}")
    if call:
        assert call[0] in text
        text = text.replace(*call)
    written.write_text(text)
    return written


def replay(cli, manifest: Path, store: Path, cache: Path) -> tuple[int, dict]:
    if not cache.exists():
        pulled = cli("pull", "tiny-flux2-klein", "--store", str(store), "--cache-dir", str(cache))
        assert pulled.returncode == 0, pulled.stderr
    result = cli("verify", str(manifest), "--cache-dir", str(cache), "--replay", "--json")
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


@pytest.mark.slow
def test_a_method_component_records_graphs_and_replays_with_zero_compiles(
    built_with_decode: SharedBuild, tmp_path: Path, cli
) -> None:
    (outcome,) = built_with_decode.report["outcomes"]
    assert outcome["status"] == "built" and outcome["compiles"] >= 2
    bundle = json.loads((built_with_decode.store / "bundles" / f"{outcome['key']}.json").read_text())
    assert bundle["counters"]["graphs.transformer"] >= 1 and bundle["counters"]["graphs.vae.decode"] >= 1
    code, report = replay(cli, built_with_decode.manifest, built_with_decode.store, tmp_path / "cache")
    assert code == 0, report
    (unit,) = report["units"]
    assert unit["compiles"] == 0 and unit["written"] == []
    assert unit["counters"]["graphs.vae.decode"] >= 1  # decode ran compiled, from the cache


def test_a_component_whose_forward_the_call_never_runs_is_refused_at_plan_naming_the_method(
    tmp_path: Path, tiny_model: Path, cli
) -> None:
    manifest = manifest_with(tmp_path / "vae.toml", tiny_model, '["transformer", "vae"]')
    result = cli("build", str(manifest), "--store", str(tmp_path / "store"), "--json")
    assert result.returncode == 2, result.stderr
    assert "never calls vae.forward" in result.stderr and "'vae.decode'" in result.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_a_component_the_warmup_never_runs_fails_the_build_and_its_row_counts_what_compiled(
    tmp_path: Path, tiny_model: Path, cli
) -> None:
    # Flux2Klein's call reaches vae.encode (image conditioning), so plan cannot refuse it; a
    # text-to-image warmup never runs it: the build fails after compiling the transformer.
    manifest = manifest_with(tmp_path / "vae.toml", tiny_model, '["transformer", "vae.encode"]')
    result = cli("build", str(manifest), "--store", str(tmp_path / "store"), "--json")
    assert result.returncode == 5, result.stderr
    assert "component 'vae.encode' produced no graph (compiled: transformer)" in result.stderr, result.stderr
    (outcome,) = json.loads(result.stdout)["outcomes"]
    assert outcome["status"] == "failed" and outcome["compiles"] > 0
    assert not (tmp_path / "store" / "tags").exists() or not list((tmp_path / "store" / "tags").iterdir())


@pytest.mark.slow
def test_other_steps_and_prompt_text_keep_the_keys_and_replay_with_zero_compiles(
    built_with_decode: SharedBuild, tiny_model: Path, tmp_path: Path, cli
) -> None:
    changed = manifest_with(
        tmp_path / "changed.toml",
        tiny_model,
        '["transformer", "vae.decode"]',
        call=(
            'prompt = "a photo of a cat"\nnum_inference_steps = 2',
            'prompt = "a lighthouse in a storm at night, oil on canvas"\nnum_inference_steps = 3',
        ),
    )
    before = make_plan(load_manifest(built_with_decode.manifest), {})
    after = make_plan(load_manifest(changed), {})
    assert [u.key for u in after.units] == [u.key for u in before.units]
    code, report = replay(cli, changed, built_with_decode.store, tmp_path / "cache")
    assert code == 0, report
    assert all(u["compiles"] == 0 and u["written"] == [] for u in report["units"])


def test_select_files_takes_cache_entries_and_kernels_only(tmp_path: Path) -> None:
    """The layout of a CPU compile (design notes), with what must never be bundled beside it."""
    from neffbuild.backends.inductor import InductorBackend

    kept = [
        "aotautograd/akey/entry", "fxgraph/ab/fkey/entry", "ab/cabc.main.cpp", "ab/cabc.so", "ab/wrapper.py",
        "triton/0/tkey/kernel.cubin",
    ]  # fmt: skip
    never = [
        ".neffbuild/state.json", "locks/fkey.lock", "fxgraph/ab/fkey/entry.lock", "ab/cabc.so.tmp", "ab/tmpx1y2",
        "precompiled_headers/h.gch", "torch_compile_debug/run/log.txt", "aotautograd/akey/tmp_entry",
    ]  # fmt: skip
    for rel in kept + never:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    (tmp_path / "ab" / "link.so").symlink_to(tmp_path / "ab" / "cabc.so")  # a link could point anywhere
    backend = InductorBackend()
    assert backend.select_files(tmp_path) == sorted(kept)
    # Every path named by a hash of what it holds: two builds' copies of one serve alike.
    assert all(backend.is_content_keyed(p) for p in kept)
    assert not any(backend.is_content_keyed(p) for p in ("model_config.json", "fxgraph/entry", "ab/c/d.so"))


@pytest.mark.parametrize(
    "package", ["torch", "click", "xxhash", "typing-extensions", "Jinja2", "diffusers", "torchao", "no-such-package-x"]
)
def test_package_versions_read_from_dist_info_are_importlib_metadatas(package: str) -> None:
    """The host check reads versions without importing importlib.metadata (issue 40): the same
    answers, "" for a package that is not installed."""
    from importlib import metadata

    from neffbuild.backends.inductor import _version

    try:
        expected = metadata.version(package)
    except metadata.PackageNotFoundError:
        expected = ""
    assert _version(package) == expected


def test_which_answers_as_shutil_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host check finds the compiler without importing shutil: same answer for every case."""
    import shutil

    from neffbuild.backends.inductor import which

    plain, runnable, folder = tmp_path / "plain", tmp_path / "runnable", tmp_path / "folder"
    for where in (plain, runnable, folder):
        (where / "cc").parent.mkdir()
    (plain / "cc").write_text("")  # not executable: skipped for a later one
    (runnable / "cc").write_text("#!/bin/sh\n")
    (runnable / "cc").chmod(0o755)
    (folder / "cc").mkdir()  # a directory is no command
    monkeypatch.chdir(runnable)
    for path in (
        f"{plain}:{folder}:{runnable}",
        f"{folder}:{plain}",
        f"{plain}::{runnable}:{runnable}",
        "",
        f"/usr/bin:/bin:{runnable}",
    ):
        monkeypatch.setenv("PATH", path)
        for command in (
            "cc",
            "sh",
            "no-such-compiler",
            str(runnable / "cc"),
            str(plain / "cc"),
            "./cc",
            str(folder / "cc"),
        ):
            assert which(command) == shutil.which(command), (path, command)
    monkeypatch.delenv("PATH")
    assert which("sh") == shutil.which("sh")


def test_the_python_and_machine_facts_are_platforms() -> None:
    """The host check reads them without importing platform: the same strings."""
    import platform

    from neffbuild.backends.inductor import machine, python_fact

    assert python_fact() == f"{platform.python_implementation()} {platform.python_version()}"
    assert machine() == platform.machine()


def test_a_compilers_version_is_its_first_line_or_says_why_not(tmp_path: Path) -> None:
    """The first line of `CXX --version` (stderr dropped); "unusable" where it cannot start or
    runs past its timeout (killed), "not found" where it is nowhere."""
    from neffbuild.backends.inductor import _compiler_version

    scripts = {
        "lines": r"printf 'cc (Ver) 1.2\r\nsecond\n'; echo noise >&2",
        "empty": "exit 0",
        "unrunnable": None,
        "hanging": "echo started\nexec sleep 600",
    }
    for name, body in scripts.items():
        script = tmp_path / name
        script.write_text("no interpreter line\n" if body is None else f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
    assert _compiler_version(str(tmp_path / "lines")) == f"{tmp_path / 'lines'}: cc (Ver) 1.2"
    assert _compiler_version(str(tmp_path / "empty")) == f"{tmp_path / 'empty'}: unknown"
    assert _compiler_version(str(tmp_path / "unrunnable")) == f"{tmp_path / 'unrunnable'} (unusable)"
    assert _compiler_version(str(tmp_path / "hanging"), timeout=0.2) == f"{tmp_path / 'hanging'} (unusable)"
    assert _compiler_version(str(tmp_path / "absent")) == f"{tmp_path / 'absent'} (not found)"


# A fresh interpreter: the watch stays on torch's counters for the life of the process.
WATCHED_COMPILE = """
import sys, torch
from neffbuild.backends.inductor import InductorBackend

class Stop(BaseException):
    pass

def stop(counter):
    print(counter)
    raise Stop

backend = InductorBackend()
if sys.argv[1] == "watched":
    assert backend.watch_compiles(stop)
compiled = torch.compile(lambda x: (x * 2).sin(), backend=backend.compiler(), fullgraph=True)
try:
    compiled(torch.ones(8))
    print("ran")
except Stop:
    print("stopped")
"""


@pytest.mark.slow
def test_watch_compiles_sees_the_first_cache_miss_before_inductor_compiles_it(tmp_path: Path) -> None:
    def run(how: str) -> tuple[list[str], list[str]]:
        cache = tmp_path / how
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        result = subprocess.run(
            [sys.executable, "-c", WATCHED_COMPILE, how], env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        entries = [p.name for p in (cache / "fxgraph").rglob("*") if p.is_file()] if cache.exists() else []
        return result.stdout.split(), entries

    said, entries = run("watched")
    assert said in (["aot_autograd.autograd_cache_miss", "stopped"], ["inductor.fxgraph_cache_miss", "stopped"]), said
    assert entries == []  # stopped at the lookup: Inductor compiled nothing
    said, entries = run("plain")  # the same call unwatched compiles, and writes its entry
    assert said == ["ran"] and entries, (said, entries)
