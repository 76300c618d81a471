"""The verdict against the compiler: what `status` (and the unit key) predicts for a host or a call
that differs from the build's, checked against what a real replay does (0 compiles or not).

One real build is shared (the `built` fixture: the tiny FLUX manifest); each perturbation pulls
nothing new, it runs `status` and `verify --replay --fail-fast` (a private copy of the cache dir per replay,
two at a time) in a changed environment (the host half), or plans and replays a changed manifest
(the call half: two tests, so two workers share the minutes of replays). Every
disagreement fails naming the perturbation. A second, one-shape build, made with `CI` and a
variable neffbuild has no list for set, shows the reverse direction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import BuiltStore, write_manifest

pytestmark = pytest.mark.slow

# torch 2.13 reads these at import into config that its cache keys hash, and neffbuild's own
# lists (inductor._ENV_NAMES, _ENV_PREFIXES) name none of them:
# torch/_functorch/config.py: error_on_custom_op_aliasing = bool(os.getenv("CI")),
# debug_partitioner = AOT_PARTITIONER_DEBUG, fake_tensor_allow_meta = FAKE_ALLOW_META.
UNLISTED = "AOT_PARTITIONER_DEBUG"


def neffbuild(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`neffbuild ARGS` in exactly env (run_cli would add this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "neffbuild", *args], capture_output=True, text=True, env=env, check=False
    )


def base_env() -> dict[str, str]:
    """The environment the shared build ran in (the test process's own)."""
    return dict(os.environ)


@dataclass(frozen=True)
class Perturbation:
    name: str
    env: Callable[[dict[str, str]], dict[str, str]] = dict  # the host's environment from the build's
    manifest_edit: tuple[tuple[str, str], ...] = ()  # (old, new) in the manifest text: a call change


def setting(name: str, value: str | None) -> Callable[[dict[str, str]], dict[str, str]]:
    def apply(env: dict[str, str]) -> dict[str, str]:
        out = {k: v for k, v in env.items() if k != name}
        return out if value is None else {**out, name: value}

    return apply


def flipped(name: str, value: str = "1") -> Callable[[dict[str, str]], dict[str, str]]:
    """Set where the build had it unset, unset where it was set."""
    return lambda env: setting(name, None if name in env else value)(env)


HOST = [
    Perturbation("CI flipped", env=flipped("CI", "true")),
    Perturbation(f"{UNLISTED}=1 (torch reads it, no list of ours names it)", env=setting(UNLISTED, "1")),
    Perturbation("FAKE_ALLOW_META=0", env=setting("FAKE_ALLOW_META", "0")),
    Perturbation("TORCHINDUCTOR_MAX_AUTOTUNE=1", env=setting("TORCHINDUCTOR_MAX_AUTOTUNE", "1")),
    Perturbation("TORCHINDUCTOR_FREEZING=1", env=setting("TORCHINDUCTOR_FREEZING", "1")),
    Perturbation("TORCHINDUCTOR_CPP_WRAPPER=1", env=setting("TORCHINDUCTOR_CPP_WRAPPER", "1")),
    Perturbation(
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=1 (the release exports 0 over it)",
        env=setting("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1"),
    ),
    Perturbation("OMP_NUM_THREADS=1 (the unit sets 2 over it)", env=setting("OMP_NUM_THREADS", "1")),
    Perturbation("ATEN_CPU_CAPABILITY=default", env=setting("ATEN_CPU_CAPABILITY", "default")),
    Perturbation("TORCH_LOGS=recompiles", env=setting("TORCH_LOGS", "recompiles")),
    Perturbation("TMPDIR elsewhere", env=setting("TMPDIR", "/var/tmp")),
    Perturbation("HF_HUB_OFFLINE flipped", env=flipped("HF_HUB_OFFLINE")),
    Perturbation("LANG=C (never read)", env=setting("LANG", "C")),
    Perturbation("an unrelated variable", env=setting("NEFFBUILD_ORACLE_UNRELATED", "1")),
    Perturbation("USER elsewhere", env=setting("USER", "oracle")),
    Perturbation("XDG_CACHE_HOME elsewhere", env=setting("XDG_CACHE_HOME", "/var/tmp/oracle-cache")),
]
CALL = [
    Perturbation("prompt text", manifest_edit=(('prompt = "a photo of a cat"', 'prompt = "a red bicycle"'),)),
    Perturbation("num_inference_steps 2 -> 3", manifest_edit=(("num_inference_steps = 2", "num_inference_steps = 3"),)),
    Perturbation(
        "max_sequence_length 64 -> 32", manifest_edit=(("max_sequence_length = 64", "max_sequence_length = 32"),)
    ),
    Perturbation(
        "prompt as a list of one",
        manifest_edit=(('prompt = "a photo of a cat"', 'prompt = ["a photo of a cat"]'),),
    ),
    Perturbation(
        "guidance_scale 4.0 added",
        manifest_edit=(("num_inference_steps = 2", "num_inference_steps = 2\nguidance_scale = 4.0"),),
    ),
    Perturbation(
        "guidance_scale 1.0 added",
        manifest_edit=(("num_inference_steps = 2", "num_inference_steps = 2\nguidance_scale = 1.0"),),
    ),
    Perturbation(
        "OMP_NUM_THREADS in the unit 2 -> 1", manifest_edit=(('OMP_NUM_THREADS = "2"', 'OMP_NUM_THREADS = "1"'),)
    ),
    Perturbation("an unchanged manifest"),
    Perturbation(
        "max_sequence_length 64 -> 128", manifest_edit=(("max_sequence_length = 64", "max_sequence_length = 128"),)
    ),
]
# Where the verdict is knowingly conservative (says miss; a replay may hit), with why: never the
# other way. A plain call value stays keyed as written, since it may change the shapes a
# component that is not compiled hands on (max_sequence_length does); this one picks which hidden
# layer of the text encoder, of one width, reaches the transformer.
CONSERVATIVE = [
    Perturbation(
        "text_encoder_out_layers [1] -> [0]",
        manifest_edit=(("text_encoder_out_layers = [1]", "text_encoder_out_layers = [0]"),),
    ),
]


@dataclass
class Outcome:
    name: str
    predicted_hit: bool
    replay_hit: bool
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def replay_hits(manifest: Path, cache: Path, env: dict[str, str]) -> tuple[bool, str]:
    """Did a real replay (a fresh process, a private copy of cache) compile nothing? It stops at
    its first compile (--fail-fast): the first miss is the answer, the rest would only compile."""
    args = ("verify", str(manifest), "--cache-dir", str(cache), "--replay", "--fail-fast", "--json")
    result = neffbuild(*args, env=env)
    if result.returncode not in (0, 6):
        # A compile that ran and failed is a miss too (torch 2.13 under ATEN_CPU_CAPABILITY=default
        # on an AVX-512 host fails to compile a vectorised kernel): anything else is the test's fault.
        assert "BackendCompilerFailed" in result.stderr, result.stderr[-3000:]
        return False, f"replay exit {result.returncode}: a compile ran and failed"
    report = json.loads(result.stdout)
    return result.returncode == 0, f"replay exit {result.returncode}, misses {report.get('misses')}"


def judge_host(p: Perturbation, manifest: Path, cache: Path) -> Outcome:
    started = time.monotonic()
    env = p.env(base_env())
    status = neffbuild("status", "--cache-dir", str(cache), "--json", env=env)
    assert status.returncode in (0, 12), status.stderr
    changes = sorted({c["name"] for u in json.loads(status.stdout)["units"] for c in u["changes"] if c["breaking"]})
    hit, detail = replay_hits(manifest, cache, env)
    seconds = time.monotonic() - started
    return Outcome(
        p.name, status.returncode == 0, hit, f"status names {changes}; {detail}", seconds, {"names": changes}
    )


def judge_call(p: Perturbation, manifest: Path, cache: Path, root: Path) -> Outcome:
    started = time.monotonic()
    text = manifest.read_text()
    for old, new in p.manifest_edit:
        assert old in text, f"{p.name}: the tiny manifest has no {old!r}"
        text = text.replace(old, new, 1)
    edited = root / f"{abs(hash(p.name))}.toml"
    edited.write_text(text)
    env = base_env()
    plan = neffbuild("plan", str(edited), "--json", env=env)
    assert plan.returncode == 0, plan.stderr
    planned = {u["unit_id"]: u["key"] for u in json.loads(plan.stdout)["units"]}
    state = json.loads((cache / ".neffbuild" / "state.json").read_text())
    built = {u["unit_id"]: u["key"] for u in state["installed"]["units"]}
    same = all(built.get(unit) == key for unit, key in planned.items())
    hit, detail = replay_hits(edited, cache, env)
    return Outcome(p.name, same, hit, f"keys {'equal' if same else 'differ'}; {detail}", time.monotonic() - started)


@pytest.fixture(scope="module")
def pulled(built: BuiltStore, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("oracle") / "cache"
    result = neffbuild(
        "pull", "tiny-flux2-klein", "--store", str(built.path), "--cache-dir", str(cache), env=base_env()
    )
    assert result.returncode == 0, result.stderr
    return cache


def judged(jobs: list[Callable[[], Outcome]]) -> list[Outcome]:
    with ThreadPoolExecutor(2) as pool:  # two replays at a time
        return list(pool.map(lambda job: job(), jobs))


def agree(outcomes: list[Outcome], started: float) -> None:
    """Every verdict agrees with its replay (else fail naming each disagreement), and both answers
    occur: the corpus holds real misses, not only hits."""
    lines = [
        f"{o.name}: predicted {'hit' if o.predicted_hit else 'miss'}, replay {'hit' if o.replay_hit else 'miss'} "
        f"({o.detail}; {o.seconds:.0f} s)"
        for o in outcomes
    ]
    print(f"oracle: {len(outcomes)} perturbations in {time.monotonic() - started:.0f} s\n" + "\n".join(lines))
    disagreements = [line for o, line in zip(outcomes, lines, strict=True) if o.predicted_hit != o.replay_hit]
    assert not disagreements, "the verdict disagrees with a real replay:\n" + "\n".join(disagreements)
    assert {o.replay_hit for o in outcomes} == {True, False}


def test_the_corpus_holds_at_least_25_perturbations() -> None:
    assert len(HOST) + len(CALL) >= 25


# The two halves of the corpus are two xdist groups (minutes of replays each): they run on both
# workers at once. Replays run one of the release's two units (the same key either way): half the time.
@pytest.mark.xdist_group("oracle-host")
def test_status_agrees_with_real_replays_on_changed_hosts(pulled: Path, tiny_model: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    one_shape = write_manifest(tmp_path / "one-shape.toml", tiny_model, widths=(128,))
    outcomes = judged([lambda p=p: judge_host(p, one_shape, pulled) for p in HOST])
    agree(outcomes, started)
    # The build ran without CI (or with it): status names the variable itself on the flipped host.
    assert outcomes[0].extra["names"] == ["env.CI"], outcomes[0].detail


@pytest.mark.xdist_group("oracle-call")
def test_keys_agree_with_real_replays_of_changed_calls(pulled: Path, tiny_model: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    one_shape = write_manifest(tmp_path / "one-shape.toml", tiny_model, widths=(128,))
    outcomes = judged([lambda p=p: judge_call(p, one_shape, pulled, tmp_path) for p in CALL + CONSERVATIVE])
    outcomes, conservative = outcomes[: -len(CONSERVATIVE)], outcomes[-len(CONSERVATIVE) :]
    for o in conservative:
        print(f"conservative: {o.name}: predicted miss={not o.predicted_hit}, replay hit={o.replay_hit} ({o.detail})")
        assert not o.predicted_hit, f"{o.name}: the verdict says hit where it was meant to stay conservative"
    agree(outcomes, started)


@pytest.fixture(scope="module")
def built_with_ci(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Path, dict[str, str]]:
    """A one-shape release built with CI=true and AOT_PARTITIONER_DEBUG=1, pulled: (manifest,
    store, cache dir, the build's environment)."""
    root = tmp_path_factory.mktemp("built-ci")
    manifest = write_manifest(root / "m.toml", tiny_model, widths=(128,), mode="regional")
    env = {**base_env(), "CI": "true", UNLISTED: "1"}
    build = neffbuild("build", str(manifest), "--store", str(root / "store"), env=env)
    assert build.returncode == 0, build.stderr[-3000:]
    pull = neffbuild(
        "pull", "tiny-flux2-klein", "--store", str(root / "store"), "--cache-dir", str(root / "cache"), env=env
    )
    assert pull.returncode == 0, pull.stderr
    return manifest, root / "store", root / "cache", env


@pytest.mark.xdist_group("oracle-ci")
def test_built_with_ci_and_an_unlisted_variable_a_host_without_either_is_told_and_misses(built_with_ci) -> None:
    manifest, store, cache, env = built_with_ci
    without = {name: {k: v for k, v in env.items() if k != name} for name in ("CI", UNLISTED)}
    assert neffbuild("status", "--cache-dir", str(cache), env=env).returncode == 0
    for name, host in without.items():
        result = neffbuild("status", "--cache-dir", str(cache), env=host)
        assert result.returncode == 12, result.stdout + result.stderr
        assert f"env.{name}: build sets '<a value, xxh3" in result.stdout and f"(env.{name})" in result.stderr
    diff = neffbuild("diff", "--host", "tiny-flux2-klein", "--store", str(store), env=without["CI"])
    assert "env.CI" in diff.stdout, diff.stdout + diff.stderr
    # The truth, from real replays; and doctor, recomputing torch's config hashes, agrees.
    with ThreadPoolExecutor(2) as pool:
        replays = list(pool.map(lambda e: replay_hits(manifest, cache, e), (env, without["CI"])))
    assert [hit for hit, _ in replays] == [True, False], replays

    def compiler_config(host: dict[str, str]) -> dict:
        args = ("--cache-dir", str(cache), "--release", "tiny-flux2-klein", "--store", str(store), "--json")
        result = neffbuild("doctor", *args, env=host)
        assert result.stdout, result.stderr
        return next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "compiler config")

    assert compiler_config(env)["status"] == "pass"
    failed = compiler_config(without["CI"])
    assert failed["status"] == "fail" and "torch._functorch.config" in failed["detail"], failed
