"""`neffbuild doctor`: will this host serve from its compile cache? Checked before it boots.

Each check is a frozen result (pass, fail or skip) with a fix. Nothing here compiles, imports
torch-neuronx (that would start the Neuron runtime) or touches the network. Where the host is
read (mount table, device nodes, module lookup) is a `HostView`, so tests point it at real
files of their choosing instead of patching globals.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from neffbuild import descriptors
from neffbuild.descriptors import BackendDescriptor, HostRuntime
from neffbuild.documents.records import Release, parse
from neffbuild.errors import HostNotReady, InputError
from neffbuild.fs.room import nearest_existing, room_for
from neffbuild.host.exports import serving_env
from neffbuild.host.hostcheck import Facts, check_host, read_facts
from neffbuild.store import StoreChoice

Status = Literal["pass", "fail", "skip"]
GiB = 1 << 30
# Filesystems that lose their content at reboot (or are no place for files at all).
VOLATILE_FSTYPES = frozenset({"tmpfs", "ramfs", "devtmpfs", "proc", "sysfs"})


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True, slots=True)
class DoctorReport:
    backend: str
    cache_dir: Path
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)


def _module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@dataclass(frozen=True, slots=True)
class HostView:
    """Where doctor reads the host; every field can point elsewhere in tests."""

    mounts: Path = Path("/proc/mounts")
    dev_dir: Path = Path("/dev")
    # Directories cleared at boot (tmpfs or systemd-tmpfiles) or aged out (/var/tmp: 30 days).
    volatile_dirs: tuple[str, ...] = ("/tmp", "/var/tmp", "/run", "/dev/shm")
    module_available: Callable[[str], bool] = _module_available
    min_free_bytes: int = 1 * GiB
    facts: Facts = read_facts
    # The compiler's config hashes in a process started with this environment (imports torch).
    config_hashes: Callable[[Mapping[str, str]], Mapping[str, str]] = lambda env: serving_config_hashes(env)


def run_doctor(
    *,
    env: Mapping[str, str],
    cache_dir: Path | None = None,
    backend: str | None = None,
    release: Release | None = None,
    host: HostView = HostView(),
) -> DoctorReport:
    described = _backend(backend, release, host)
    name, info, cache_env = described.name, described.host, described.cache_env
    where = _cache_dir(cache_dir, env, cache_env, info)
    checks = (
        check_module(info, host),
        check_devices(info, host),
        check_versions(release, env, host),
        check_compiler_config(release, env, host),
        check_persistent(where, host, cache_env),
        check_writable(where),
        check_free_space(where, release, host),
        check_lock_dir(info, serving_env(env, release.env if release else {})),
        check_cache_on(info, serving_env(env, release.env if release else {})),
    )
    return DoctorReport(backend=name, cache_dir=where, checks=checks)


def doctor(
    *, env: Mapping[str, str], cache_dir: Path | None, backend: str | None, release_ref: str | None, store: StoreChoice
) -> DoctorReport:
    """`neffbuild doctor`: the checks, against the release release_ref names if given."""
    release = load_release(release_ref, store, env) if release_ref else None
    return run_doctor(env=env, cache_dir=cache_dir, backend=backend, release=release)


def not_ready(report: DoctorReport) -> HostNotReady | None:
    """The error a report with failed checks ends with (exit 11), after it is shown."""
    failed = [c.name for c in report.checks if c.status == "fail"]
    if not failed:
        return None
    return HostNotReady(
        f"{len(failed)} of {len(report.checks)} checks failed: {', '.join(failed)}",
        hint="do what each failed check's fix says, then run `neffbuild doctor` again",
    )


def _backend(backend: str | None, release: Release | None, host: HostView) -> BackendDescriptor:
    """--backend, else the release's, else the one this host has: the first whose runtime is
    installed (neuron where torch_neuronx is), else the portable one (inductor)."""
    here = next(b for b in descriptors.by_specificity() if b.portable or host.module_available(b.host.module))
    name = backend or (release.backend if release else here.name)
    if release is not None and release.backend != name:
        raise InputError(f"--backend {name} but the release was built with {release.backend}", hint="drop --backend")
    described = descriptors.find(name)
    if described is None:
        raise InputError(f"unknown backend {name!r}", hint=f"use one of {', '.join(sorted(descriptors.names()))}")
    return described


def _cache_dir(given: Path | None, env: Mapping[str, str], cache_env: str, info: HostRuntime) -> Path:
    # Unset means the compiler's own default, which is exactly what a misconfigured host uses.
    raw = given or env.get(cache_env) or info.default_cache_dir.format(user=env.get("USER", "root"))
    return Path(os.path.abspath(Path(raw).expanduser()))


def check_module(info: HostRuntime, host: HostView) -> Check:
    if host.module_available(info.module):
        return Check("backend", "pass", f"{info.module} is importable")
    return Check("backend", "fail", f"{info.module} is not importable in this Python", info.install_hint)


def check_devices(info: HostRuntime, host: HostView) -> Check:
    if info.device_pattern is None:
        return Check("devices", "skip", "this backend needs no device nodes")
    pattern = re.compile(info.device_pattern)
    try:
        found = sorted(p.name for p in host.dev_dir.iterdir() if pattern.fullmatch(p.name))
    except OSError:
        found = []
    if found:
        return Check("devices", "pass", f"{len(found)} device(s) visible: {', '.join(found[:8])}")
    return Check(
        "devices",
        "fail",
        f"no {info.device_label} under {host.dev_dir}",
        "run on a Trainium instance with the Neuron driver loaded (`lsmod | grep neuron`, `neuron-ls`); "
        "in a container, pass the /dev/neuron* devices through",
    )


def check_versions(release: Release | None, env: Mapping[str, str], host: HostView) -> Check:
    if release is None:
        return Check("versions", "skip", "no release given (pass --release FILE, or a tag with --store)")
    report = check_host(release, env, facts=host.facts)
    if report.ok:
        notes = "".join(f"; informational: {d.line()}" for d in report.informational)
        return Check("versions", "pass", f"matches release {release.name} ({len(release.fingerprint)} fields){notes}")
    lines = [d.line() for d in report.breaking]
    return Check(
        "versions",
        "fail",
        "differs from release " + release.name + ": " + "; ".join(lines[:6]) + (" …" if len(lines) > 6 else ""),
        "install the versions and settings the release was built with, or rebuild it on this environment",
    )


def serving_config_hashes(env: Mapping[str, str]) -> Mapping[str, str]:
    """envreads.compiler_config_hashes() in a fresh Python started with env: torch reads its
    settings from the environment at import, so this process's own import would not do."""
    import json
    import subprocess
    import sys

    code = "import json; from neffbuild.backends.envreads import compiler_config_hashes as h; print(json.dumps(h()))"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=dict(env), capture_output=True, text=True, timeout=300, check=True
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return {}
    return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}


def check_compiler_config(release: Release | None, env: Mapping[str, str], host: HostView) -> Check:
    """The config hashes the compiler's cache keys hash (AOTAutograd: the functorch config;
    Inductor: its own; torch_key: torch's sources), recomputed in the serving environment and
    compared with the build's: what `status` (no torch import) cannot check."""
    if release is None or not release.compiler_keys:
        return Check("compiler config", "skip", "the release records no compiler config hashes (built before them)")
    if not host.module_available("torch"):
        return Check("compiler config", "skip", "torch is not importable here (the backend check says so)")
    # As the server runs: this environment, the release's exports, the variables the units set.
    unit_env = {k.removeprefix("env."): v for k, v in release.fingerprint.items() if k.startswith("env.")}
    here = host.config_hashes({**serving_env(env, release.env), **unit_env})
    if not here:
        return Check(
            "compiler config",
            "fail",
            "could not compute torch's config hashes here",
            "run `python -c 'import torch'` to see why",
        )
    # Only the hashes both sides compute: a name only the release has was recorded by another
    # neffbuild (another view of the config), and comparing it would fail every such release.
    shared = {k: v for k, v in release.compiler_keys.items() if k in here}
    if not shared:
        return Check(
            "compiler config", "skip", "the release records none of the config hashes computed here (rebuild it)"
        )
    differing = sorted(k for k, v in shared.items() if here[k] != v)
    if not differing:
        return Check("compiler config", "pass", f"{len(shared)} config hashes match the build's")
    return Check(
        "compiler config",
        "fail",
        f"differs from the build: {', '.join(differing)} (a setting read from the environment, or another torch)",
        "`neffbuild status` names the variables the build read that differ here; unset or set them as at build",
    )


def check_persistent(cache_dir: Path, host: HostView, cache_env: str) -> Check:
    resolved = _resolve_existing(cache_dir)
    mount, fstype = mount_of(resolved, _read_mounts(host.mounts))
    volatile = next((d for d in host.volatile_dirs if _is_under(resolved, Path(d))), None)
    fix = (
        f"choose a directory on a disk, e.g. /var/cache/neffbuild, for `neffbuild pull --cache-dir` "
        f"and the server's {cache_env}"
    )
    if fstype in VOLATILE_FSTYPES:
        return Check("persistent", "fail", f"{cache_dir} is on {fstype} (mounted at {mount}): emptied at reboot", fix)
    if volatile is not None:
        return Check(
            "persistent",
            "fail",
            f"{cache_dir} is under {volatile}, which is cleared at boot or aged out by systemd-tmpfiles",
            fix,
        )
    return Check("persistent", "pass", f"{cache_dir} is on {fstype or 'an unknown filesystem'} (mounted at {mount})")


def check_writable(cache_dir: Path) -> Check:
    target = nearest_existing(cache_dir)
    fix = f"make {target} writable by the serving user (e.g. `sudo install -d -o $USER {cache_dir}`) or choose another"
    if cache_dir.exists() and not cache_dir.is_dir():
        return Check(
            "writable", "fail", f"{cache_dir} exists and is not a directory", "remove it or choose another path"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".neffbuild-doctor-", dir=target)
    except OSError as exc:
        return Check("writable", "fail", f"cannot create files in {target}: {exc.strerror or exc}", fix)
    os.close(fd)
    os.unlink(probe)
    made = "" if target == cache_dir else f" (does not exist yet; {target} is writable)"
    return Check("writable", "pass", f"{cache_dir} is writable{made}")


def check_cache_on(info: HostRuntime, env: Mapping[str, str]) -> Check:
    """No variable in the server's environment turns the runtime's cache off."""
    if not info.cache_switches:
        return Check("cache on", "skip", "this backend has no cache switch")
    off = [f"{name}={env[name]}" for name, values in info.cache_switches if env.get(name, "").lower() in values]
    if off:
        return Check(
            "cache on",
            "fail",
            f"{', '.join(off)} in this environment turns the compile cache off: every graph compiles, whatever was pulled",
            f"unset {', '.join(o.split('=', 1)[0] for o in off)} in the server's environment",
        )
    return Check("cache on", "pass", f"neither {' nor '.join(n for n, _ in info.cache_switches)} turns the cache off")


def check_lock_dir(info: HostRuntime, env: Mapping[str, str]) -> Check:
    """The runtime's lock dir can be made by the serving user: without it the server fails to
    start even when every lookup would hit, also with a read-only cache dir."""
    if info.lock_dir_env is None:
        return Check("lock dir", "skip", "this backend keeps its locks inside the cache dir")
    if env.get(info.lock_dir_env) == "":
        # The C++ path takes empty as unset (CompilationCache.cpp:41-58); the Python path's
        # os.getenv gives "", the working directory (kernels/cache_utils.py:13-15).
        return Check(
            "lock dir",
            "fail",
            f"{info.lock_dir_env} is set but empty: one runtime path uses {info.default_lock_dir}, "
            "the other the server's working directory",
            f"unset {info.lock_dir_env}, or set it to a dir the server's user can write",
        )
    raw = env.get(info.lock_dir_env) or info.default_lock_dir
    where = Path(os.path.abspath(raw))
    writable = check_writable(where)
    if writable.status == "pass":
        return Check("lock dir", "pass", f"{info.lock_dir_env}: {writable.detail}")
    return Check(
        "lock dir",
        "fail",
        f"{info.lock_dir_env} ({where}): {writable.detail}; the runtime creates it at start-up and fails without it",
        f"set {info.lock_dir_env} in the server's environment to a dir its user can write (it holds only locks), "
        "or make that one writable",
    )


def check_free_space(cache_dir: Path, release: Release | None, host: HostView) -> Check:
    if release is not None:  # what pull itself requires (neffbuild.fs.room), so a pass here is not refused there
        room = room_for(cache_dir, [f.size for f in release.files if not _present(cache_dir / f.path, f.size)])
        target, free, need = room.where, room.free, room.need
        what = f"{_gib(need)} still to pull for release {release.name}"
    else:
        target = nearest_existing(cache_dir)
        free, need = shutil.disk_usage(target).free, host.min_free_bytes
        what = f"at least {_gib(need)} (no release given)"
    if free >= need:
        return Check("free space", "pass", f"{_gib(free)} free on {target}; needs {what}")
    return Check(
        "free space", "fail", f"{_gib(free)} free on {target}; needs {what}", "free space there or choose a larger disk"
    )


def load_release(ref: str, store: StoreChoice | None, env: Mapping[str, str]) -> Release:
    """A release document from a file, or a reference (neffbuild.documents.refs) resolved in a store."""
    path = Path(ref)
    if path.suffix == ".json" and path.is_file():
        return parse(Release, path.read_bytes(), str(path))
    if store is None:
        raise InputError(f"{ref!r} is not a release file", hint="give a release JSON file, or a tag with --store")
    from neffbuild.documents.refs import resolve

    return resolve(store.open(env), ref).release


def report_lines(report: DoctorReport) -> list[str]:
    lines = [f"neffbuild doctor: backend {report.backend}, cache dir {report.cache_dir}"]
    for check in report.checks:
        lines.append(f"{check.status.upper():4}  {check.name:10}  {check.detail}")
        if check.status == "fail" and check.fix:
            lines.append(f"{'':4}  {'':10}  fix: {check.fix}")
    lines.append("ok" if report.ok else f"{sum(c.status == 'fail' for c in report.checks)} check(s) failed")
    return lines


def report_json(report: DoctorReport) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "backend": report.backend,
        "cache_dir": str(report.cache_dir),
        "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "fix": c.fix} for c in report.checks],
    }


def mount_of(path: Path, mounts: list[tuple[str, str]]) -> tuple[str, str]:
    """(mount point, fstype) of the longest mount point containing path; the last mount wins."""
    best = ("/", "")
    for point, fstype in mounts:
        if _is_under(path, Path(point)) and len(point) >= len(best[0]):
            best = (point, fstype)
    return best


def _read_mounts(path: Path) -> list[tuple[str, str]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            mounts.append((_unescape(parts[1]), parts[2]))
    return mounts


def _unescape(field_text: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _resolve_existing(path: Path) -> Path:
    """The real path of the nearest existing ancestor, with the missing tail appended."""
    base = nearest_existing(path)
    return base.resolve() / path.relative_to(base)


def _present(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"
