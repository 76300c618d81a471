"""What the host's Neuron toolchain is, found without importing it: package versions and dirs,
torch_neuronx's build type, the neuronx-cc on PATH, the instance family and its compile target.
The `neuron` backend (backends/neuron.py) keys its fingerprint on these facts."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

ABSENT = "absent"
DMI_PRODUCT_NAME = Path("/sys/devices/virtual/dmi/id/product_name")

# Instance family -> (neuronx-cc target, default logical NeuronCores), as torch-neuronx maps them
# (PlatformUtils.cpp). An inf2 compiles for trn1; trn2u for trn2.
_FAMILIES = {
    "inf1": ("inf1", "1"), "inf2": ("trn1", "1"), "trn1": ("trn1", "1"), "trn1n": ("trn1", "1"),
    "trn2": ("trn2", "2"), "trn2n": ("trn2", "2"), "trn2u": ("trn2", "2"),
    "trn3": ("trn3", "2"), "trn3u": ("trn3", "2"),
}  # fmt: skip  # a table: its rows packed, not one item a line
DEFAULT_LNC = {target: lnc for target, lnc in _FAMILIES.values()}

_BUILD_TYPE = re.compile(r"""^BUILD_TYPE\s*=\s*["']([A-Za-z_]+)["']""", re.M)

VersionOf = Callable[[str], str | None]
ModuleVersion = Callable[[str], str | None]
RequiresPython = Callable[[str], str | None]
PackageDir = Callable[[str], Path | None]
RunVersion = Callable[[str], str | None]


def package_dir(name: str) -> Path | None:
    """The directory a top-level package would be imported from, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def build_type(package: Path | None) -> str:
    """torch_neuronx's BUILD_TYPE from its _build_config.py file ('absent' without the package)."""
    if package is None:
        return ABSENT
    try:
        found = _BUILD_TYPE.search((package / "_build_config.py").read_text())
    except OSError:
        return "DEV"  # an editable install without the generated file takes the dev defaults
    return found.group(1) if found else "unknown"


def compiler_version(executable: str) -> str | None:
    """`neuronx-cc --version` of an executable outside this venv (its version, or None)."""
    try:
        done = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\b(\d+\.\d+(?:\.[0-9A-Za-z+]+)*)", done.stdout + done.stderr)
    return found.group(1) if done.returncode == 0 and found else None


def find_compiler(env: Mapping[str, str]) -> Path | None:
    """The neuronx-cc that `execvp` finds on env's PATH (made absolute), or None."""
    found = shutil.which("neuronx-cc", path=env.get("PATH", os.defpath))
    return Path(os.path.abspath(found)) if found else None


def installed_version(distribution: str) -> str | None:
    """A distribution's version from its metadata; importing torch_neuronx would start the runtime."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def requires_python(distribution: str) -> str | None:
    """A distribution's Requires-Python (None: not installed, or it says nothing)."""
    try:
        return metadata.metadata(distribution)["Requires-Python"]  # None when absent
    except metadata.PackageNotFoundError:
        return None


_SPEC = re.compile(r"^\s*(>=|<=|==|!=|~=|>|<)\s*(\d+(?:\.\d+)*)(\.\*)?\s*$")


def python_excluded(spec: str, version: tuple[int, ...]) -> bool:
    """True when a Requires-Python spec (PEP 440 clauses over release numbers) excludes version.
    A clause this cannot read excludes nothing: refusing on a guess would be worse."""
    for clause in spec.split(","):
        found = _SPEC.match(clause)
        if not found:
            continue
        op, wanted, star = found.group(1), tuple(int(n) for n in found.group(2).split(".")), found.group(3)
        have = tuple(version[: len(wanted)]) if star or op == "~=" else tuple(version[:3])
        want = wanted if star or op == "~=" else (*wanted, 0, 0)[:3]
        ok = {
            ">=": have >= want, "<=": have <= want, ">": have > want, "<": have < want,
            "==": have == want, "!=": have != want,
            "~=": have >= wanted and version[: len(wanted) - 1] == wanted[:-1],
        }[op]  # fmt: skip  # arguments packed by meaning, not one a line
        if not ok:
            return True
    return False


@functools.cache
def _distributions_by_module() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def module_version(module: str) -> str | None:
    """'<distribution> <version>' of what provides a top-level module, without importing it."""
    found = sorted({f"{d} {installed_version(d)}" for d in _distributions_by_module().get(module, [])})
    return ", ".join(found) or None


def instance_family(product_name: str) -> str | None:
    """'trn2.48xlarge' -> 'trn2'; None for anything that is not a known Neuron instance."""
    family = product_name.strip().split(".", 1)[0].lower()
    return family if family in _FAMILIES else None


def compile_target(family: str | None) -> str | None:
    return _FAMILIES[family][0] if family in _FAMILIES else None


def pin_compiler(environ: dict[str, str] | Any) -> Path | None:
    """Put the dir of the neuronx-cc PATH finds now first on PATH, as an absolute path: upstream
    runs it by name from a temp dir (NeuronCompiler.cpp:237-256), where a relative PATH entry
    would find another, and the fingerprint names this one."""
    found = find_compiler(environ)
    if found is not None:
        environ["PATH"] = os.pathsep.join([str(found.parent), environ.get("PATH", "")])
    return found
