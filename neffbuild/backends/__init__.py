"""The backends: the manifest's `backend = "..."` names one of neffbuild/descriptors.py's BACKENDS,
whose `implementation` is the class here that compiles for it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from neffbuild import descriptors
from neffbuild.errors import InputError

if TYPE_CHECKING:  # importing base costs pydantic; pull reads the descriptors only
    from neffbuild.backends.base import Backend


def get_backend(name: str) -> Backend:
    described = descriptors.find(name)
    if described is None:
        raise InputError(f"unknown backend {name!r}", hint=f"use one of {', '.join(sorted(descriptors.names()))}")
    module, _, cls = described.implementation.partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)()
    return backend
