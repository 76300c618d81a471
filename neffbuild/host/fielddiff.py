"""One fingerprint field that differs between a build and this host, as a host check says it.

A module of its own: host/hostcheck.py builds one only where something differs, so a pull whose
host matches (every boot) does not build the class (each frozen dataclass costs the import that
builds it about 0.5-0.8 ms)."""

from __future__ import annotations

from dataclasses import dataclass

FLAG_LISTS = frozenset({"cpu.isa"})  # comma-separated flags: say which ones differ


@dataclass(frozen=True, slots=True)
class FieldDiff:
    """One fingerprint field that differs between the build and this host."""

    name: str
    built: str | None  # None: the build's fingerprint has no such field
    here: str | None  # None: this host's has none
    breaking: bool

    def line(self) -> str:
        """One line naming the field and both sides, e.g. `cpu.isa: build has avx512f, this host lacks it`."""
        if self.built is not None and self.here is not None and self.name in FLAG_LISTS:
            built, here = set(self.built.split(",")), set(self.here.split(","))
            parts = []
            if lacks := sorted(built - here):
                parts.append(f"build has {','.join(lacks)}, this host lacks {'it' if len(lacks) == 1 else 'them'}")
            if extra := sorted(here - built):
                parts.append(f"this host also has {','.join(extra)}, the build did not")
            return f"{self.name}: " + "; ".join(parts)
        verb = "sets" if self.name.startswith("env.") else "has"
        if self.built is None:
            return f"{self.name}: this host {verb} {self.here!r}, the build did not"
        if self.here is None:
            return f"{self.name}: build {verb} {self.built!r}, this host does not"
        return f"{self.name}: build {verb} {self.built!r}, this host {self.here!r}"
