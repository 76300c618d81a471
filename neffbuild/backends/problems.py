"""What a backend finds wrong with a manifest entry or this host before any worker starts.

A module of its own: a pull's host check imports the backends, and finds no such problem (each
frozen dataclass costs the import that builds it about 0.5-0.8 ms)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """Something found before any worker starts: the entry's field, what is wrong, how to fix it."""

    field: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
