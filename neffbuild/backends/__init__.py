"""Backend registry: the manifest's `backend = "..."` names one of these."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from neffbuild.errors import InputError

if TYPE_CHECKING:  # importing base costs pydantic; pull imports backends.serving only
    from neffbuild.backends.base import Backend


def _inductor() -> Backend:
    from neffbuild.backends.inductor import InductorBackend

    return InductorBackend()


def _neuron() -> Backend:
    from neffbuild.backends.neuron import NeuronBackend

    return NeuronBackend()


_FACTORIES: dict[str, Callable[[], Backend]] = {"inductor": _inductor, "neuron": _neuron}


def get_backend(name: str) -> Backend:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise InputError(f"unknown backend {name!r}", hint=f"use one of {', '.join(sorted(_FACTORIES))}") from None
