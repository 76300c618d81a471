"""`neffbuild doctor --neuron-selfcheck`: settle on a Trainium host what the neuron backend only
infers from torch_neuronx's source (docs/trainium.md, "First run on hardware").

Each check runs probes (neffbuild.backends.neuron_probe) in fresh processes and says what it
found; without torch_neuronx every check is skipped. A check fails only where the backend's
assumption is wrong for this wheel (the fix names what to change), or where a probe broke.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from neffbuild.backends.base import Scope
from neffbuild.backends.neuron import BUILD_FACT, IMPORT_DEFAULTS, NeuronBackend, sync_mode
from neffbuild.host.doctor import Check, DoctorReport

log = logging.getLogger(__name__)

PROBE = "neffbuild.backends.neuron_probe"
PROBE_TIMEOUT_S = 3600  # a first compile of the probe model; neuronx-cc alone starts in seconds
# What `import torch_neuronx` 0.1.0 writes when unset (__init__.py:41-65); another wheel may differ.
WATCHED = (
    "NEURON_LAUNCH_BLOCKING", "TORCH_NEURONX_MLIR_ATEN_OPS", "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS",
    "TORCH_NEURONX_RETAIN_DEVICE_MODE", "TORCH_NEURONX_ENABLE_ASYNC_NRT", "TORCH_NEURONX_ENABLE_STACK_TRACE",
    "NEURON_RT_ALLOW_LEGACY_NEFF", "NEURON_RT_DBG_ZEROCOPY",
)  # fmt: skip
NAMES = ("import defaults", "venv paths", "tp keys", "read-only")

Run = Callable[[Sequence[str], Mapping[str, str]], subprocess.CompletedProcess[str]]


def run_probe(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), env=dict(env), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
    )


def neuron_selfcheck(
    *, env: Mapping[str, str], work_dir: Path | None = None, backend: NeuronBackend | None = None, run: Run = run_probe
) -> DoctorReport:
    backend = backend or NeuronBackend(env=env)
    if backend.package_dir_of("torch_neuronx") is None:
        why = f"torch_neuronx is not importable in {sys.executable}: run this on a Trainium host (docs/trainium.md)"
        return DoctorReport(
            "neuron", Path(work_dir or tempfile.gettempdir()), tuple(Check(n, "skip", why) for n in NAMES)
        )
    root = Path(tempfile.mkdtemp(prefix="neffbuild-selfcheck-", dir=work_dir))
    try:
        checks = (
            check_import_defaults(backend, env, run),
            check_venv_paths(root / "paths", env, run),
            check_tp_keys(backend, env, run),
            check_read_only(root / "readonly", env, run),
        )
    finally:
        _make_writable(root)
        shutil.rmtree(root, ignore_errors=True)
    return DoctorReport("neuron", root, checks)


def check_import_defaults(backend: NeuronBackend, env: Mapping[str, str], run: Run) -> Check:
    """Which defaults the wheel writes, and whether NEURON_LAUNCH_BLOCKING's is what its
    _build_config.py says (that decides the layout eager ops land in)."""
    clean = {k: v for k, v in env.items() if k not in WATCHED}
    done = run([sys.executable, "-m", PROBE, "defaults", *WATCHED], clean)
    found = _json_line(done)
    if not isinstance(found, dict):
        return _broken("import defaults", done)
    facts = backend.collect_facts(clean, "neuron")
    expected = sync_mode(facts, clean)
    got = "1" if found.get("NEURON_LAUNCH_BLOCKING") == "1" else "0"
    written = ", ".join(f"{k}={v}" for k, v in sorted(found.items()) if v is not None)
    wrong = [k for k, v in IMPORT_DEFAULTS.items() if found.get(k) != v]
    if got != expected or wrong:
        return Check(
            "import defaults",
            "fail",
            f"the wheel ({BUILD_FACT} {facts.get(BUILD_FACT)}) writes {written}; the backend expects "
            f"NEURON_LAUNCH_BLOCKING={expected}"
            + (f" and {', '.join(f'{k}={IMPORT_DEFAULTS[k]}' for k in wrong)}" if wrong else ""),
            "update sync_mode/IMPORT_DEFAULTS in neffbuild/backends/neuron.py to this wheel, then re-plan",
        )
    layout = "<64 hex>/<64 hex>.neff (synchronous)" if got == "1" else "ab/cd/<32 hex>.neff (asynchronous)"
    return Check("import defaults", "pass", f"{written}; eager ops cache as {layout}")


def check_venv_paths(root: Path, env: Mapping[str, str], run: Run) -> Check:
    """Does the same model code at another path compile again? (source locations in the key)"""
    from neffbuild.backends.neuron_probe import PROBE_MODULE, PROBE_SOURCE

    cache = root / "cache"
    results = []
    for name in ("a", "b"):
        source = root / name
        source.mkdir(parents=True)
        (source / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE)
        probe_env = {**env, **NeuronBackend().worker_env(cache, root / f"scratch-{name}")}
        done = run([sys.executable, "-m", PROBE, "compile", str(source)], probe_env)
        found = _json_line(done)
        if not isinstance(found, dict):
            return _broken("venv paths", done)
        results.append(found)
    first, second = results
    if int(first.get("compiles", 0)) < 1:
        return Check(
            "venv paths",
            "fail",
            f"the first compile counted {first.get('compiles')} compiles",
            "the compile counters are wrong for this wheel: fix compiler_counters",
        )
    if int(second.get("compiles", 0)) > 0:
        detail = f"the same code at another path compiled again ({second['compiles']} compiles): source paths are in the key; venv, python, diffusers, transformers stay breaking"
    else:
        detail = "the same code at another path hit every graph: source paths are not in the key (venv could be informational)"
    return Check("venv paths", "pass", detail)


def check_tp_keys(backend: NeuronBackend, env: Mapping[str, str], run: Run, tensor_parallel: int = 2) -> Check:
    """A TP unit's planned fingerprint (before the import) against each rank's (after it)."""
    planned_env = {k: v for k, v in env.items() if k not in WATCHED}
    planned = backend.fingerprint(
        backend.collect_facts(planned_env, "neuron"), planned_env, Scope("neuron", tensor_parallel)
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={tensor_parallel}",
        "-m",
        PROBE,
        "fingerprint",
        str(tensor_parallel),
    ]
    done = run(command, planned_env)
    ranks = [line for line in _json_lines(done) if isinstance(line, dict) and "fingerprint" in line]
    if done.returncode != 0 or len(ranks) != tensor_parallel:
        return _broken("tp keys", done)
    differing = sorted(
        {k for r in ranks for k in set(r["fingerprint"]) | set(planned) if r["fingerprint"].get(k) != planned.get(k)}
    )
    if differing:
        first = differing[0]
        seen = {r["rank"]: r["fingerprint"].get(first) for r in sorted(ranks, key=lambda r: r["rank"])}
        return Check(
            "tp keys",
            "fail",
            f"{len(differing)} field(s) differ between plan and ranks: {', '.join(differing[:6])} ({first}: planned {planned.get(first)!r}, ranks {seen})",
            "a TP build would fail its fingerprint check: key the field by its effect in neffbuild/backends/neuron.py",
        )
    return Check("tp keys", "pass", f"plan and {tensor_parallel} ranks agree on all {len(planned)} fields")


def check_read_only(root: Path, env: Mapping[str, str], run: Run) -> Check:
    """A read-only NEFF dir serves with a writable lock dir; an unwritable lock dir fails start-up."""
    from neffbuild.backends.neuron_probe import PROBE_MODULE, PROBE_SOURCE

    source, cache = root / "src", root / "cache"
    source.mkdir(parents=True)
    (source / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE)
    warm = run(
        [sys.executable, "-m", PROBE, "compile", str(source)], {**env, **NeuronBackend().worker_env(cache, root / "s1")}
    )
    if not isinstance(_json_line(warm), dict):
        return _broken("read-only", warm)
    _make_read_only(cache)
    serving = {k: v for k, v in env.items() if k != "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"}
    serving = {**serving, "TORCH_NEURONX_NEFF_CACHE_DIR": str(cache), "TORCH_NEURONX_METRICS_ENABLED": "1"}
    hit = run(
        [sys.executable, "-m", PROBE, "compile", str(source)],
        {**serving, "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(root / "locks")},
    )
    found = _json_line(hit)
    if not isinstance(found, dict):
        return _broken("read-only", hit)
    # /proc refuses new dirs even to root: the lock dir cannot be made.
    refused = run(
        [sys.executable, "-m", PROBE, "compile", str(source)],
        {**serving, "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": "/proc/neffbuild-locks"},
    )
    starts = "starts anyway" if refused.returncode == 0 else "fails to start"
    if found.get("compiles") or found.get("written"):
        return Check(
            "read-only",
            "fail",
            f"a hit over a read-only dir compiled {found.get('compiles')} and wrote {found.get('written')}",
            "do not serve this wheel from a read-only NEFF dir",
        )
    return Check(
        "read-only",
        "pass",
        f"a read-only NEFF dir served with 0 compiles and no writes; with an unwritable lock dir the server {starts}",
    )


def _make_read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)


def _make_writable(root: Path) -> None:
    for path in [root, *root.rglob("*")] if root.exists() else []:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o200)


def _json_lines(done: subprocess.CompletedProcess[str]) -> list[object]:
    found = []
    for line in done.stdout.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def _json_line(done: subprocess.CompletedProcess[str]) -> object:
    lines = _json_lines(done)
    return lines[-1] if done.returncode == 0 and lines else None


def _broken(name: str, done: subprocess.CompletedProcess[str]) -> Check:
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    log.debug("probe %s failed:\n%s", " ".join(done.args), done.stderr)
    return Check(
        name,
        "fail",
        f"the probe exited {done.returncode}: {tail[0]}",
        "run it again with --debug; the probe is neffbuild.backends.neuron_probe",
    )
