"""The verdict against the compiler: what `status` (and the unit key) predicts for a host or a call
that differs from the build's, checked against what a real replay does (0 compiles or not).

One real build is shared (the `built` fixture: the tiny FLUX manifest); each perturbation pulls
nothing new, it runs `status` in a changed environment (the host half), or is planned as a changed
manifest (the call half: every manifest in one planning process), and its truth comes from
`verify --replay --fail-fast` (a private copy of the cache dir per replay, two at a time). The
predicted hits are replayed in groups, all of a group's changes in one replay, and alone only
where that replay misses (tests/oraclekit.py says why a combined hit is each member's hit); every
predicted miss is replayed alone. Every disagreement fails naming the perturbation. A second,
one-shape build, made with `CI` and a variable neffbuild has no list for set, shows the reverse
direction.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import PIPE

import pytest

from tests.conftest import BuiltStore, write_manifest
from tests.oraclekit import Truth, first_fit, truths

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
# An edit's text is all it touches: edits of different text can share a replay (guidance_scale goes
# in under [model.call], apart from num_inference_steps, for that).
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
        manifest_edit=(("[model.call]", "[model.call]\nguidance_scale = 4.0"),),
    ),
    Perturbation(
        "guidance_scale 1.0 added",
        manifest_edit=(("[model.call]", "[model.call]\nguidance_scale = 1.0"),),
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


def replay_truth(manifest: Path, cache: Path, env: dict[str, str]) -> Truth:
    started = time.monotonic()
    hit, detail = replay_hits(manifest, cache, env)
    return Truth(hit, detail, seconds=time.monotonic() - started)


@pytest.fixture(scope="module")
def pulled(built: BuiltStore, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("oracle") / "cache"
    result = neffbuild(
        "pull", "tiny-flux2-klein", "--store", str(built.path), "--cache-dir", str(cache), env=base_env()
    )
    assert result.returncode == 0, result.stderr
    return cache


def names(members: Sequence[Perturbation]) -> str:
    return ", ".join(p.name for p in members)


def outcomes_of(
    judged: list[tuple[Perturbation, Truth]], predicted: dict[str, tuple[bool, str]], extra: dict[str, dict]
) -> list[Outcome]:
    """Each perturbation's verdict beside its truth, in the corpus's order as the groups give it."""
    out = []
    for p, truth in judged:
        hit, said = predicted[p.name]
        by = f"; judged by the combined replay of {truth.shared}" if truth.shared > 1 else ""
        out.append(Outcome(p.name, hit, truth.hit, f"{said}; {truth.detail}{by}", truth.seconds, extra.get(p.name, {})))
    return out


def agree(outcomes: list[Outcome], started: float, combinations: list[str]) -> None:
    """Every verdict agrees with its replay (else fail naming each disagreement, and any combination
    that missed though its members alone hit: its verdict said hit), and both answers occur: the
    corpus holds real misses, not only hits."""
    lines = [
        f"{o.name}: predicted {'hit' if o.predicted_hit else 'miss'}, replay {'hit' if o.replay_hit else 'miss'} "
        f"({o.detail}; {o.seconds:.0f} s)"
        for o in outcomes
    ]
    print(f"oracle: {len(outcomes)} perturbations in {time.monotonic() - started:.0f} s\n" + "\n".join(lines))
    disagreements = [line for o, line in zip(outcomes, lines, strict=True) if o.predicted_hit != o.replay_hit]
    disagreements += combinations
    assert not disagreements, "the verdict disagrees with a real replay:\n" + "\n".join(disagreements)
    assert {o.replay_hit for o in outcomes} == {True, False}


def test_the_corpus_holds_at_least_25_perturbations() -> None:
    assert len(HOST) + len(CALL) >= 25


def host_env(members: Sequence[Perturbation]) -> dict[str, str]:
    env = base_env()
    for p in members:
        env = p.env(env)
    return env


def changed_variables(p: Perturbation) -> set[str]:
    base, env = base_env(), p.env(base_env())
    return {name for name in base.keys() | env.keys() if base.get(name) != env.get(name)}


def status_of(env: dict[str, str], cache: Path) -> tuple[bool, list[str]]:
    """Does status predict a hit, and which breaking changes does it name?"""
    status = neffbuild("status", "--cache-dir", str(cache), "--json", env=env)
    assert status.returncode in (0, 12), status.stderr
    changes = sorted({c["name"] for u in json.loads(status.stdout)["units"] for c in u["changes"] if c["breaking"]})
    return status.returncode == 0, changes


# The two halves of the corpus are two xdist groups (minutes of replays each): they run on both
# workers at once. Replays run one of the release's two units (the same key either way): half the time.
@pytest.mark.xdist_group("oracle-host")
def test_status_agrees_with_real_replays_on_changed_hosts(pulled: Path, tiny_model: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    one_shape = write_manifest(tmp_path / "one-shape.toml", tiny_model, widths=(128,))
    with ThreadPoolExecutor(2) as pool:  # two processes at a time
        statuses = dict(
            zip((p.name for p in HOST), pool.map(lambda p: status_of(p.env(base_env()), pulled), HOST), strict=True)
        )
        hits = first_fit([p for p in HOST if statuses[p.name][0]], changed_variables)
        together = [g for g in hits if len(g) > 1]
        for group, (hit, changes) in zip(
            together, pool.map(lambda g: status_of(host_env(g), pulled), together), strict=True
        ):
            assert hit, f"together ({names(group)}): status names {changes} where each alone predicts a hit"
        groups = hits + [[p] for p in HOST if not statuses[p.name][0]]
        judged, combinations = truths(
            groups, lambda members: replay_truth(one_shape, pulled, host_env(members)), lambda p: p.name, pool.map
        )
    predicted = {name: (hit, f"status names {changes}") for name, (hit, changes) in statuses.items()}
    outcomes = outcomes_of(judged, predicted, {name: {"names": changes} for name, (_, changes) in statuses.items()})
    agree(outcomes, started, combinations)
    # The build ran without CI (or with it): status names the variable itself on the flipped host.
    flipped_ci = next(o for o in outcomes if o.name == HOST[0].name)
    assert flipped_ci.extra["names"] == ["env.CI"], flipped_ci.detail


# One process plans every manifest it is sent (a line each; it answers a line of unit keys each):
# torch and diffusers are imported once, not once a manifest. No plan cache: a cache entry records
# the variables torch read while its facts were computed, and only the first plan here sees torch's
# import-time reads; `plan` with the cache gives the same keys by that cache's design.
PLANNER = """
import json, os, sys
from pathlib import Path
from neffbuild.documents.manifest import load_manifest
from neffbuild.units.plan import make_plan
for line in sys.stdin:
    plan = make_plan(load_manifest(Path(line.strip())), os.environ)
    print(json.dumps({u.unit_id: u.key for u in plan.units}), flush=True)
"""


def planned_keys(planner: subprocess.Popen[str], log: Path, manifests: list[Path]) -> list[dict[str, str]]:
    assert planner.stdin is not None and planner.stdout is not None
    keys = []
    for manifest in manifests:
        planner.stdin.write(f"{manifest}\n")
        planner.stdin.flush()
        line = planner.stdout.readline()
        assert line, f"planning {manifest} failed: {log.read_text()[-3000:]}"
        keys.append(json.loads(line))
    return keys


def edit_spans(text: str, p: Perturbation) -> list[tuple[int, int, str]]:
    """Where each of p's edits applies in text (its first occurrence), and what replaces it."""
    spans = []
    for old, new in p.manifest_edit:
        start = text.find(old)
        assert start >= 0, f"{p.name}: the tiny manifest has no {old!r}"
        spans.append((start, start + len(old), new))
    return spans


def edited(text: str, members: Sequence[Perturbation]) -> str:
    """text with every member's edits applied (they touch disjoint spans of it)."""
    out, at = [], 0
    for start, end, new in sorted(s for p in members for s in edit_spans(text, p)):
        assert start >= at, f"{names(members)}: edits overlap"
        out += [text[at:start], new]
        at = end
    return "".join(out) + text[at:]


@pytest.mark.xdist_group("oracle-call")
def test_keys_agree_with_real_replays_of_changed_calls(pulled: Path, tiny_model: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    text = write_manifest(tmp_path / "one-shape.toml", tiny_model, widths=(128,)).read_text()

    def manifest(members: Sequence[Perturbation]) -> Path:
        path = tmp_path / f"{hashlib.sha256(names(members).encode()).hexdigest()[:16]}.toml"
        if not path.exists():
            path.write_text(edited(text, members))
        return path

    state = json.loads((pulled / ".neffbuild" / "state.json").read_text())
    built = {u["unit_id"]: u["key"] for u in state["installed"]["units"]}
    corpus = CALL + CONSERVATIVE
    args, log = [sys.executable, "-c", PLANNER], tmp_path / "planner.log"
    with (
        log.open("w") as err,
        subprocess.Popen(args, stdin=PIPE, stdout=PIPE, stderr=err, text=True, env=base_env()) as planner,
    ):
        keys = planned_keys(planner, log, [manifest([p]) for p in corpus])
        same = {
            p.name: all(built.get(unit) == key for unit, key in k.items()) for p, k in zip(corpus, keys, strict=True)
        }
        for p in CONSERVATIVE:
            assert not same[p.name], f"{p.name}: the verdict says hit where it was meant to stay conservative"
        hits = first_fit(
            [p for p in corpus if same[p.name]], lambda p: {i for a, b, _ in edit_spans(text, p) for i in range(a, b)}
        )
        together = [g for g in hits if len(g) > 1]
        for group, k in zip(together, planned_keys(planner, log, [manifest(g) for g in together]), strict=True):
            assert all(built.get(u) == key for u, key in k.items()), f"together ({names(group)}): keys differ"
    groups = hits + [[p] for p in corpus if not same[p.name]]
    with ThreadPoolExecutor(2) as pool:  # two replays at a time
        judged, combinations = truths(
            groups, lambda members: replay_truth(manifest(members), pulled, base_env()), lambda p: p.name, pool.map
        )
    predicted = {name: (hit, f"keys {'equal' if hit else 'differ'}") for name, hit in same.items()}
    outcomes = outcomes_of(judged, predicted, {})
    conservative = [o for o in outcomes if o.name in {p.name for p in CONSERVATIVE}]
    for o in conservative:
        print(f"conservative: {o.name}: predicted miss={not o.predicted_hit}, replay hit={o.replay_hit} ({o.detail})")
    agree([o for o in outcomes if o not in conservative], started, combinations)


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
