"""The plan cache: a warm cache plans without importing torch, gives the plan an uncached run
gives, and each input the facts depend on invalidates it; a corrupt file is ignored, logged."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from neffbuild.backends.base import Backend
from neffbuild.documents.manifest import load_manifest
from neffbuild.errors import ManifestError
from neffbuild.units import plancache
from neffbuild.units.plan import Plan, make_plan, plan_document
from neffbuild.units.plancache import CheckedFacts, EntryFacts, cache_dir, cached_facts
from tests.conftest import ROOT
from tests.units import test_plan
from tests.units.test_plan import FACTS, edit, facts_provider

manifest = test_plan.manifest  # a model dir with model_index.json and one config: enough to plan


def planned(path: Path, cache: Path | None, env: Mapping[str, str] | None = None, **facts: str) -> Plan:
    return make_plan(load_manifest(path), env or {}, facts_provider(**facts), cache=cache)


def files(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*.json")} if cache.is_dir() else set()


def test_a_cached_plan_is_the_plan_an_uncached_one_gives(manifest: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    uncached = plan_document(planned(manifest, None))
    assert plan_document(planned(manifest, cache)) == uncached  # computed, then kept
    assert len(files(cache)) == 1
    assert plan_document(planned(manifest, cache)) == uncached  # read back


def test_each_input_of_the_facts_is_a_new_cache_entry(manifest: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    planned(manifest, cache)
    seen = files(cache)
    planned(manifest, cache)
    assert files(cache) == seen, "an unchanged input must hit"

    def changed(why: str) -> None:
        before = set(files(cache))
        planned(manifest, cache)
        assert len(files(cache) - before) == 1, f"{why}: no new cache entry"

    edit(manifest, "num_inference_steps = 2", "num_inference_steps = 3")
    changed("the manifest")
    (manifest.parent / "model" / "transformer" / "config.json").write_text('{"num_layers": 3}')
    changed("a model config file")
    index = json.loads((manifest.parent / "model" / "model_index.json").read_text())
    (manifest.parent / "model" / "model_index.json").write_text(json.dumps({**index, "is_distilled": False}))
    changed("the model_index.json")


def test_a_changed_host_fact_is_a_new_entry(manifest: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    def with_facts(**changes: str) -> None:
        def provide(backend: Backend, env: Mapping[str, str], device: str) -> Mapping[str, str]:
            return {**FACTS, **changes}

        make_plan(load_manifest(manifest), {}, provide, cache=cache)

    with_facts()
    with_facts(**{"cxx.default": "g++: 13"})
    assert len(files(cache)) == 2


@pytest.mark.parametrize("variable", ["CI", "TORCHINDUCTOR_FREEZING", "PYTORCH_NO_CUDA_MEMORY_CACHING"])
def test_a_compiler_variable_is_part_of_the_key(manifest: Path, tmp_path: Path, variable: str) -> None:
    cache = tmp_path / "cache"
    planned(manifest, cache, env={})
    planned(manifest, cache, env={variable: "1"})
    planned(manifest, cache, env={variable: "true"})
    assert len(files(cache)) == 3
    planned(manifest, cache, env={"GITHUB_RUN_ID": "7", "HOME": "/elsewhere"})  # reaches no key
    assert len(files(cache)) == 3


def test_installed_versions_and_module_origins_are_part_of_the_key(
    manifest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    planned(manifest, cache)
    shadow = tmp_path / "site"
    (shadow / "diffusers-0.0.1.dist-info").mkdir(parents=True)
    (shadow / "diffusers-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: diffusers\nVersion: 0.0.1\n"
    )
    monkeypatch.syspath_prepend(str(shadow))
    assert plancache.key_inputs({}, {}, "", {})["packages"]["diffusers"] == "0.0.1"
    planned(manifest, cache)
    assert len(files(cache)) == 2, "another diffusers version"
    (shadow / "torch_neuronx").mkdir()
    (shadow / "torch_neuronx" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    planned(manifest, cache)
    assert len(files(cache)) == 3, "a module found elsewhere on sys.path"


def test_neffbuilds_own_code_is_part_of_the_key() -> None:
    module = ROOT / "neffbuild" / "units" / "plancache.py"
    before = plancache.code_digest()
    st = module.stat()
    try:
        os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert plancache.code_digest() != before
    finally:
        os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert plancache.code_digest() == before


def test_a_variable_the_facts_read_is_compared_on_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch and diffusers read while the facts are computed (os.environ or env) is kept
    with them: another value of it is a miss; a variable nobody read changes nothing."""
    computed: list[str] = []

    def compute(env: Mapping[str, str]) -> CheckedFacts:
        computed.append(f"{os.environ.get('NB_READ_BY_TORCH')}/{env.get('NB_READ_BY_CHECK')}")
        return CheckedFacts(("a note",), {"e": EntryFacts({"height": 1}, {}, {}, None)})

    def facts(**env: str) -> CheckedFacts:
        for name in ("NB_READ_BY_TORCH", "NB_UNREAD"):
            if name in env:
                monkeypatch.setenv(name, env[name])
        return cached_facts(tmp_path, {"inputs": 1}, env, compute)

    assert facts(NB_READ_BY_TORCH="1", NB_READ_BY_CHECK="a").notes == ("a note",)
    assert facts(NB_READ_BY_TORCH="1", NB_READ_BY_CHECK="a", NB_UNREAD="x").entries["e"].keyed_call == {"height": 1}
    assert len(computed) == 1
    facts(NB_READ_BY_TORCH="2", NB_READ_BY_CHECK="a")
    facts(NB_READ_BY_TORCH="2", NB_READ_BY_CHECK="b")
    assert len(computed) == 3
    assert not isinstance(os.environ, plancache.ReadRecorder), "the recorder is taken off again"


@pytest.mark.parametrize(
    "damage",
    [
        "",
        "{",
        '{"format": "neffbuild.plan-cache/9"}',
        '{"format": "neffbuild.plan-cache/1", "reads": {}, "facts": {"notes": [1], "entries": {}}}',
    ],
)
def test_a_corrupt_cache_file_is_ignored_with_a_log_line_and_replaced(
    manifest: Path, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    good = plan_document(planned(manifest, cache))
    (name,) = files(cache)
    (cache / name).write_text(damage)
    with caplog.at_level(logging.WARNING, logger="neffbuild.units.plancache"):
        assert plan_document(planned(manifest, cache)) == good
    assert any("ignoring corrupt" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    assert json.loads((cache / name).read_text())["format"] == "neffbuild.plan-cache/1"


def test_a_failing_check_is_never_cached(manifest: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    edit(manifest, "num_inference_steps = 2", "num_inference_step = 2")
    for _ in range(2):
        with pytest.raises(ManifestError, match="num_inference_step"):
            planned(manifest, cache)
    assert files(cache) == set()


def test_where_the_cache_lives() -> None:
    assert cache_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/neffbuild/plans")
    assert cache_dir({"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/neffbuild/plans")
    assert cache_dir({"HOME": "/home/u", "XDG_CACHE_HOME": "relative"}) == Path("/home/u/.cache/neffbuild/plans")
    assert cache_dir({"HOME": "/home/u", "NEFFBUILD_PLAN_CACHE": "/srv/plans"}) == Path("/srv/plans")
    for off in ("off", "0", "false", "OFF"):
        assert cache_dir({"HOME": "/home/u", "NEFFBUILD_PLAN_CACHE": off}) is None
    assert cache_dir({}) is None


def test_an_unwritable_cache_plans_anyway(manifest: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="neffbuild.units.plancache"):
        assert planned(manifest, blocker / "plans").units
    assert any("cannot write" in r.getMessage() for r in caplog.records)


_PROBE = """
import json, runpy, sys
for args in json.loads(sys.argv[1]):
    sys.argv = ["neffbuild", *args]
    try:
        runpy.run_module("neffbuild", run_name="__main__")
    except SystemExit as exc:
        print("exit", exc.code, file=sys.stderr)
print(json.dumps({"torch": "torch" in sys.modules, "diffusers": "diffusers" in sys.modules}))
"""


def _probe(commands: list[list[str]], env: dict[str, str]) -> dict[str, bool]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(commands)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_cache_plans_without_importing_torch_and_ci_invalidates(manifest: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["NEFFBUILD_PLAN_CACHE"] = str(tmp_path / "plans")
    cache_dir_arg = tmp_path / "empty-cache"
    cache_dir_arg.mkdir()
    plan = ["plan", str(manifest), "--json"]
    status = ["status", str(manifest), "--cache-dir", str(cache_dir_arg), "--json"]
    assert _probe([plan], env) == {"torch": True, "diffusers": True}  # cold: the checks import them
    verify = ["verify", str(manifest), "--cache-dir", str(cache_dir_arg), "--json"]
    assert _probe([plan, status, verify], env) == {"torch": False, "diffusers": False}
    assert _probe([plan], {**env, "CI": "true"}) == {"torch": True, "diffusers": True}
    assert _probe([plan], {**env, "CI": "true"}) == {"torch": False, "diffusers": False}
