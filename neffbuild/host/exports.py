"""The environment a release gives its serving process, checked, and written for a shell or systemd.

A release comes from a store; what `pull` prints is `eval`ed by a shell and what it writes is read
by systemd, so a release may export only (see servingenv.py):
- its backend's cache variable, always set to the pulled dir (a release cannot point it elsewhere),
- the compiler settings its backend declares, and
- what the host accepts by name with `--allow-env NAME` or `NEFFBUILD_ALLOW_ENV` (host_allow).
Variables that choose which code runs (the loader's LD_*, interpreters' PYTHON*, PATH, BASH_ENV,
...) are exported only when the host names each one, whatever a backend declares.
The allow is the host's, read on every command: the state a pull leaves in a cache dir records
what it exported, and is never read as a permission (anyone who can write the dir can edit it).
Names must be shell variable names and every value is quoted, so no name or value can become a
command; characters a terminal would act on are given to the shell as printf escapes. The env file (`pull --env-file`) is written so that systemd's EnvironmentFile= and bash's
`set -a; source FILE` read the same variables and values (systemd's parser: src/basic/env-file.c).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild import descriptors
from neffbuild.errors import InputError, IntegrityError
from neffbuild.fs.atomic import write_atomic
from neffbuild.printable import UNSAFE, printable

if TYPE_CHECKING:
    from neffbuild.documents.records import Release

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ALLOW_ENV_VARIABLE = "NEFFBUILD_ALLOW_ENV"  # names the host accepts, separated by commas or blanks
# Linux refuses to start a process (execve: E2BIG, "Argument list too long") whose environment
# holds one NAME=value string over MAX_ARG_STRLEN (32 pages: 128 KiB with its NUL), or whose
# arguments and environment together pass ARG_MAX (2 MiB with the default stack limit). Exports
# are refused past these, before pull writes anything: once exported, no process could start.
EXPORT_MAX = 128 << 10
EXPORTS_TOTAL_MAX = 1 << 20  # leaves the other half of ARG_MAX to the host's own environment
# What the dynamic loader, the C library, interpreters and shells read to decide what code runs.
# Compiled where first used (re caches it): a pull whose release exports only its own names never asks.
_RUNS_CODE = (
    r"(LD_|DYLD_|PYTHON|PERL|RUBY|NODE_|JAVA_TOOL_|_JAVA_|GCONV_).*"
    r"|PATH|BASH_ENV|ENV|IFS|CDPATH|PS4|SHELLOPTS|BASHOPTS|GLOBIGNORE|HOME|GLIBC_TUNABLES|LOCPATH|NLSPATH|CC|CXX"
)


def _unfit_for_env_file(value: str) -> str | None:
    """A character an env file cannot give systemd and bash alike, or None.

    systemd drops (with a log line) a variable whose value is not valid Unicode to it:
    noncharacters (U+FDD0..U+FDEF, U+xFFFE, U+xFFFF); versions before 240 also one holding a
    control character other than tab. A BOM (U+FEFF) is refused with them, as systemd documents.
    """
    if value.isascii() and value.isprintable():
        return None
    for ch in value:
        code = ord(ch)
        if (
            (code < 0x20 and ch != "\t")
            or code == 0x7F
            or 0xFDD0 <= code <= 0xFDEF
            or code & 0xFFFE == 0xFFFE
            or code == 0xFEFF
        ):
            return ch
    return None


def is_env_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def runs_code(name: str) -> bool:
    """Whether name is read by a loader, interpreter or shell (only a host's allow exports it)."""
    return re.fullmatch(_RUNS_CODE, name) is not None


def check_allowed_names(names: Collection[str], source: str = "--allow-env") -> tuple[str, ...]:
    """--allow-env values: each must be a variable name."""
    for name in names:
        if not is_env_name(name):
            raise InputError(
                f"{source} {name!r}: not an environment variable name", hint="give a name like NEURON_RT_VISIBLE_CORES"
            )
    return tuple(names)


def host_allow(flags: Collection[str], env: Mapping[str, str]) -> tuple[str, ...]:
    """The names this host accepts beyond its backend's: --allow-env, then NEFFBUILD_ALLOW_ENV
    (set by the deploy env file, or the unit); each checked."""
    configured = (
        tuple(re.split(r"[\s,]+", env.get(ALLOW_ENV_VARIABLE, "").strip()))
        if env.get(ALLOW_ENV_VARIABLE, "").strip()
        else ()
    )
    return (*check_allowed_names(flags), *check_allowed_names(configured, ALLOW_ENV_VARIABLE))


def exports_for(release: Release, cache_dir: Path, where: str, allow: Collection[str] = ()) -> dict[str, str]:
    """The variables to export for a release, its cache variable first; IntegrityError naming the
    release document (where) and the variable for anything a release may not set."""
    check_allowed_names(allow)
    backend, cache_env, env = release.backend, release.cache_env, release.env
    described = descriptors.find(backend)
    if described is None:
        raise IntegrityError(
            f"{where}: backend {backend!r} is not one this neffbuild knows",
            hint=f"known: {', '.join(sorted(descriptors.names()))}; upgrade neffbuild?",
        )
    serving = described.serving
    if cache_env != serving.cache_env:
        raise IntegrityError(
            f"{where}: cache_env {cache_env!r} is not the {backend} backend's cache variable {serving.cache_env}",
            hint="the release is corrupt or forged; rebuild or re-push it",
        )
    for name, value in env.items():
        if not is_env_name(name):
            raise IntegrityError(
                f"{where}: env name {name!r} is not a variable name",
                hint="the release is corrupt or forged; rebuild it",
            )
        if name == serving.cache_env:
            raise IntegrityError(
                f"{where}: env sets {name}, which pull sets to the pulled dir",
                hint="the release is corrupt or forged; rebuild it",
            )
        if name not in allow and (runs_code(name) or not serving.declares(name)):
            what = (
                f"which the {backend} backend does not declare as a compiler setting"
                if not serving.declares(name)
                else "which decides what code runs"
            )
            raise IntegrityError(
                f"{where}: env sets {name}, {what}",
                hint=f"if this host accepts it, pass --allow-env {name} (or list it in {ALLOW_ENV_VARIABLE})",
            )
        if "\x00" in value:
            raise IntegrityError(
                f"{where}: env.{name} holds a NUL character", hint="the release is corrupt or forged; rebuild it"
            )
    exports = {serving.cache_env: str(cache_dir), **env}
    if (problem := _size_problem(exports)) is not None:
        raise IntegrityError(f"{where}: {problem}", hint="the release is corrupt or forged; rebuild it")
    return exports


def _size_problem(exports: Mapping[str, str]) -> str | None:
    """Why a process could not start with these exported (see EXPORT_MAX), or None."""
    total = 0
    for name, value in exports.items():
        size = len(name.encode()) + 1 + len(value.encode("utf-8", "surrogateescape")) + 1  # NAME=value and NUL
        if size > EXPORT_MAX:
            return f"env.{name} is {size} bytes, over the {EXPORT_MAX} one environment string may hold: no process could start with it exported"
        total += size
    if total > EXPORTS_TOTAL_MAX:
        return f"the exports are {total} bytes, over {EXPORTS_TOTAL_MAX}: processes could not start with them exported"
    return None


def check_exports(exports: Mapping[str, str], allowed: Collection[str]) -> dict[str, str]:
    """exports, checked again where they are applied (apply_exports): variable names, no NUL,
    nothing that decides what code runs unless the host allowed it by name, sizes a process
    can start with."""
    for name, value in exports.items():
        if not is_env_name(name):
            raise IntegrityError(f"env name {printable(name)!r} is not a variable name")
        if "\x00" in value:
            raise IntegrityError(f"{name}: the value holds a NUL character")
        if runs_code(name) and name not in allowed:
            raise IntegrityError(
                f"{name} decides what code runs, and this host did not allow it",
                hint=f"pass allow_env=[{name!r}] to ensure_cache",
            )
    if (problem := _size_problem(exports)) is not None:
        raise IntegrityError(problem, hint="the release is corrupt or forged; rebuild it")
    return dict(exports)


def serving_env(env: Mapping[str, str], exports: Mapping[str, str]) -> dict[str, str]:
    """The environment the server runs with: env (this host's), with the release's exports over it."""
    return {**env, **exports}


def serving_dirs(backend: str) -> tuple[str, ...]:
    """Dirs inside the cache dir that the backend's server writes even on a hit (see servingenv.py)."""
    described = descriptors.find(backend)
    return described.serving.writable if described else ()


def shell_lines(exports: Mapping[str, str]) -> str:
    """`export NAME=value` lines for `eval` (names are checked; values are quoted)."""
    for name in exports:
        if not is_env_name(name):
            raise IntegrityError(f"env name {printable(name)!r} is not a variable name")
    return "".join(f"export {name}={shell_word(value)}\n" for name, value in exports.items())


def shell_word(value: str) -> str:
    """value as one shell word that bash and dash read back exactly, holding no character a
    terminal acts on: those are given as `"$(printf '\\033')"` (octal, POSIX printf), the rest
    single-quoted. A newline stays literal inside quotes: $(...) would drop a trailing one."""
    pieces, last = [], 0
    for match in UNSAFE.finditer(value):
        if match.group() == "\n":
            continue
        if match.start() > last:
            pieces.append(shlex.quote(value[last : match.start()]))
        octal = "".join(f"\\{byte:03o}" for byte in match.group().encode("utf-8", "surrogatepass"))
        pieces.append(f"\"$(printf '{octal}')\"")
        last = match.end()
    if not pieces:
        return shlex.quote(value)
    if last < len(value):
        pieces.append(shlex.quote(value[last:]))
    return "".join(pieces)


def env_file_text(exports: Mapping[str, str]) -> str:
    """NAME=value lines that systemd's EnvironmentFile= and bash's `source` read identically.

    shlex.quote leaves a value bare only when it holds nothing but [A-Za-z0-9_@%+=:,./-] (no
    backslash, quote, blank or comment sign: systemd and bash take it as it is), else wraps it in
    single quotes, inside which both take every character literally up to the next quote; a
    quote in the value ends the quoted part and is given as "'" (literal in both). systemd
    expands no variables in EnvironmentFile=. Values systemd would drop are refused.
    """
    for name, value in exports.items():
        if not is_env_name(name):
            raise IntegrityError(f"env name {name!r} is not a variable name")
        if (bad := _unfit_for_env_file(value)) is not None:
            raise IntegrityError(
                f"{name}: the value holds {bad!r}, which an env file cannot give systemd and bash alike",
                hint="use the printed exports instead (eval in a shell), or fix the manifest's env",
            )
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in exports.items())


def write_env_file(path: Path, text: str) -> bool:
    """Replace path with text atomically (a temp file beside it, then rename); False if it already
    held exactly that (nothing written)."""
    try:
        if path.read_text(encoding="utf-8", errors="strict") == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    return write_atomic(path, text.encode())
