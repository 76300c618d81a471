"""`neffbuild doctor --neuron-selfcheck`: settle on a Trainium host what the neuron backend only
infers from torch_neuronx's source (docs/trainium.md, "First run on hardware").

Each check runs probes (neffbuild.backends.neuron_probe) in fresh processes and says what it
found; without torch_neuronx every check is skipped. A check fails only where the backend's
assumption is wrong for this wheel (the fix names what to change), or where a probe broke.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from neffbuild.backends.base import Scope
from neffbuild.backends.neuron import BUILD_FACT, IMPORT_DEFAULTS, TARGET_ENV, NeuronBackend, sync_mode
from neffbuild.descriptors import NEURON
from neffbuild.host.doctor import Check, DoctorReport
from neffbuild.printable import printable

log = logging.getLogger(__name__)

PROBE = "neffbuild.backends.neuron_probe"
DEVICE = NEURON.devices[0]  # the one it probes
PROBE_TIMEOUT_S = 3600  # a first compile of the probe model; neuronx-cc alone starts in seconds
# What `import torch_neuronx` 0.1.0 writes when unset (__init__.py:41-65); another wheel may differ.
WATCHED = (
    "NEURON_LAUNCH_BLOCKING", "TORCH_NEURONX_MLIR_ATEN_OPS", "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS",
    "TORCH_NEURONX_RETAIN_DEVICE_MODE", "TORCH_NEURONX_ENABLE_ASYNC_NRT", "TORCH_NEURONX_ENABLE_STACK_TRACE",
    "NEURON_RT_ALLOW_LEGACY_NEFF", "NEURON_RT_DBG_ZEROCOPY",
)  # fmt: skip  # a table: its rows packed, not one item a line
NAMES = ("import defaults", "platform", "venv paths", "eager ops", "tp keys", "read-only", "lock dir")
DEFAULT_LOCK_DIR = Path("/tmp/local_cache")  # CompilationCache.cpp:50-57, kernels/cache_utils.py:15

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
            NEURON.name, Path(work_dir or tempfile.gettempdir()), tuple(Check(n, "skip", why) for n in NAMES)
        )
    root = Path(tempfile.mkdtemp(prefix="neffbuild-selfcheck-", dir=work_dir))
    try:
        checks = (
            check_import_defaults(backend, env, run),
            check_platform(backend, env, run),
            check_venv_paths(root / "paths", env, run),
            check_eager_ops(root / "eager", env, run),
            check_tp_keys(backend, env, run),
            check_read_only(root / "readonly", env, run),
            check_lock_dir(root / "locks", env, run),
        )
    finally:
        _make_writable(root)
        shutil.rmtree(root, ignore_errors=True)
    return DoctorReport(NEURON.name, root, checks)


def check_import_defaults(backend: NeuronBackend, env: Mapping[str, str], run: Run) -> Check:
    """Which defaults the wheel writes, and whether NEURON_LAUNCH_BLOCKING's is what its
    _build_config.py says (that decides the layout eager ops land in)."""
    clean = {k: v for k, v in env.items() if k not in WATCHED}
    done = run([sys.executable, "-m", PROBE, "defaults", *WATCHED], clean)
    found = _json_line(done)
    if not isinstance(found, dict):
        return _broken("import defaults", done)
    facts = backend.collect_facts(clean, DEVICE)
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
    unknown = _unrecognised(results)
    if unknown:
        return _unknown_layout("venv paths", unknown)
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
        backend.collect_facts(planned_env, DEVICE), planned_env, Scope(DEVICE, tensor_parallel)
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


def check_platform(backend: NeuronBackend, env: Mapping[str, str], run: Run) -> Check:
    """The target and logical cores keyed from DMI (plan) against the runtime's own answer
    (utils.get_platform_target / get_lnc_setting, from nrt_get_instance_info)."""
    clean = {k: v for k, v in env.items() if k not in ("NEURON_LOGICAL_NC_CONFIG", TARGET_ENV)}
    done = run([sys.executable, "-m", PROBE, "platform"], clean)
    found = _json_line(done)
    if not isinstance(found, dict):
        return _broken("platform", done)
    planned = backend.fingerprint(backend.collect_facts(clean, DEVICE), clean, Scope(DEVICE))
    wrong = [
        f"{field} {planned[field]!r} (DMI), runtime {found.get(name)!r}"
        for field, name in (("neuron.target", "target"), ("neuron.lnc", "lnc"))
        if planned[field] != str(found.get(name))
    ]
    if wrong:
        return Check(
            "platform",
            "fail",
            f"the key would say {'; '.join(wrong)}",
            "every unit would be keyed for another target: fix _FAMILIES in neffbuild/backends/neuron_toolchain.py "
            f"(or set {TARGET_ENV} / NEURON_LOGICAL_NC_CONFIG for the build and the servers alike)",
        )
    return Check(
        "platform", "pass", f"DMI and the runtime agree: target {found['target']}, {found['lnc']} logical cores"
    )


def check_eager_ops(root: Path, env: Mapping[str, str], run: Run) -> Check:
    """An eager run of the probe model as a build runs it (CPU fallback off): it compiles, and
    every file it writes is one the bundler takes."""
    from neffbuild.backends.neuron_probe import PROBE_MODULE, PROBE_SOURCE

    source = root / "src"
    source.mkdir(parents=True)
    (source / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE)
    probe_env = {**env, **NeuronBackend().worker_env(root / "cache", root / "scratch")}
    done = run([sys.executable, "-m", PROBE, "compile", str(source), "eager"], probe_env)
    found = _json_line(done)
    if not isinstance(found, dict):
        return _broken("eager ops", done)  # a failed op names itself: it would fail a build too
    if found.get("unrecognised"):
        return _unknown_layout("eager ops", _unrecognised([found]))
    if int(found.get("compiles", 0)) < 1 or not found.get("written"):
        return Check(
            "eager ops",
            "fail",
            f"an eager run counted {found.get('compiles')} compiles and wrote {len(found.get('written') or [])} "
            "files the bundler takes",
            "eager units would be refused (no cache files) or ship without their ops: fix compiler_counters / "
            "select_files in neffbuild/backends/neuron.py",
        )
    return Check("eager ops", "pass", f"{found['compiles']} compiles, {len(found['written'])} files, all bundled")


def check_read_only(root: Path, env: Mapping[str, str], run: Run) -> Check:
    """A hit over a warm NEFF dir writes nothing into it. chmod a-w does not stop root, so the
    tree (every path, its inode, size and mtime) is compared before and after the serving run."""
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
    before = _tree(cache)
    serving = {k: v for k, v in env.items() if k != "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"}
    serving = {
        **serving,
        "TORCH_NEURONX_NEFF_CACHE_DIR": str(cache),
        "TORCH_NEURONX_METRICS_ENABLED": "1",
        "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(root / "locks"),
    }
    hit = run([sys.executable, "-m", PROBE, "compile", str(source)], serving)
    found = _json_line(hit)
    if not isinstance(found, dict):
        return _broken("read-only", hit)
    after = _tree(cache)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    if found.get("compiles") or changed:
        return Check(
            "read-only",
            "fail",
            f"a hit over a warm NEFF dir compiled {found.get('compiles')} and changed {changed[:4] or 'nothing'}",
            "do not serve this wheel from a read-only NEFF dir",
        )
    how = "compared the tree (as root chmod does not stop writes)" if os.geteuid() == 0 else "dir made read-only"
    return Check("read-only", "pass", f"a hit served with 0 compiles and wrote nothing into the NEFF dir ({how})")


def check_lock_dir(root: Path, env: Mapping[str, str], run: Run) -> Check:
    """Where the runtime puts its lock dir when TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR is unset (doctor
    checks the literal /tmp/local_cache, not $TMPDIR), and that one it cannot make fails start-up."""
    from neffbuild.backends.neuron_probe import PROBE_MODULE, PROBE_SOURCE

    source = root / "src"
    source.mkdir(parents=True)
    (source / f"{PROBE_MODULE}.py").write_text(PROBE_SOURCE)
    tmpdir = root / "tmp"
    tmpdir.mkdir()
    base = {k: v for k, v in env.items() if k != "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"}
    base = {**base, "TORCH_NEURONX_NEFF_CACHE_DIR": str(root / "cache"), "TMPDIR": str(tmpdir)}
    unset = run([sys.executable, "-m", PROBE, "compile", str(source)], base)
    if not isinstance(_json_line(unset), dict):
        return _broken("lock dir", unset)
    fix = "update the neuron backend's lock dir (neffbuild/descriptors.py, NEURON.host) to this wheel"
    if (tmpdir / "local_cache").exists():
        return Check(
            "lock dir", "fail", "with it unset the runtime made $TMPDIR/local_cache, not /tmp/local_cache", fix
        )
    if not DEFAULT_LOCK_DIR.is_dir():
        return Check("lock dir", "fail", f"with it unset the runtime made no {DEFAULT_LOCK_DIR}", fix)
    # /proc refuses new dirs even to root: the lock dir cannot be made.
    refused = run(
        [sys.executable, "-m", PROBE, "compile", str(source)],
        {**base, "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": "/proc/neffbuild-locks"},
    )
    if refused.returncode == 0:
        return Check(
            "lock dir",
            "fail",
            "with a lock dir it cannot make the runtime still served: doctor fails such hosts for nothing",
            fix,
        )
    return Check(
        "lock dir",
        "pass",
        f"unset: {DEFAULT_LOCK_DIR} (not $TMPDIR); one it cannot make fails start-up, as doctor assumes",
    )


def _unrecognised(results: Sequence[Mapping[str, object]]) -> list[str]:
    found: set[str] = set()
    for result in results:
        paths = result.get("unrecognised")
        if isinstance(paths, list):
            found.update(p for p in paths if isinstance(p, str))
    return sorted(found)


def _unknown_layout(name: str, paths: list[str]) -> Check:
    return Check(
        name,
        "fail",
        f"the compiler wrote {len(paths)} file(s) the bundler does not know: {', '.join(printable(p) for p in paths[:3])}",
        "builds would fail on them: teach select_files in neffbuild/backends/neuron.py this layout",
    )


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    return {
        p.relative_to(root).as_posix(): (st.st_ino, st.st_size, st.st_mtime_ns)
        for p in [root, *root.rglob("*")]
        if (st := p.lstat())
    }


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
