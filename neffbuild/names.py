"""Names that become store keys or file names: tags, release ids, bundle keys, and the paths a
cache dir reserves for neffbuild itself.

They arrive from the command line and from stored documents, so each is checked before it is
joined into a key or a path: a tag `../../x` must not address a file above the store root, and a
release must not name a file that pull keeps for itself (its state, its temp files).
"""

from __future__ import annotations

import re

from neffbuild.errors import InputError
from neffbuild.hashing import is_digest

TAG_MAX = 128
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

STATE_DIR = ".neffbuild"  # inside the cache dir: pull's state and lock (compilers ignore it)
TRUSTED_KEYS_ENV = "NEFFBUILD_TRUSTED_KEYS"  # a host's trusted public keys (host/trust.py)
INCOMPLETE_SUFFIX = ".incomplete"  # named temp files are `.<name>.<pid>.<random>.incomplete`


def key_problem(name: str) -> str | None:
    """Why name cannot be one segment of a store key (a document's name), or None."""
    if not _TAG.fullmatch(name) or len(name) > TAG_MAX:
        return f"{name!r} is not a name: letters, digits, '.', '_', '-', starting with a letter or digit, at most {TAG_MAX}"
    return None


def tag_problem(name: str) -> str | None:
    """Why name cannot be a tag, or None. A 32-hex name would read as a release id."""
    if (problem := key_problem(name)) is not None:
        return problem.replace("is not a name", "is not a tag name")
    if is_digest(name):
        return f"{name!r} is not a tag name: 32 hex digits are a release id"
    return None


def check_tag(name: str, what: str = "tag") -> str:
    if (problem := tag_problem(name)) is not None:
        raise InputError(f"{what}: {problem}", hint="tags are names like `prod` or `flux2-klein.v3`")
    return name


def check_digest(value: str, what: str) -> str:
    if not is_digest(value):
        raise InputError(
            f"{what}: {value!r} is not a 32-hex-digit id", hint="copy the id from `neffbuild tag` or `build --json`"
        )
    return value


def is_temp_name(name: str) -> bool:
    """The shape of pull's named temp files: a release may not use it (pull deletes those)."""
    return name.startswith(".") and name.endswith(INCOMPLETE_SUFFIX)


def reserved_problem(path: str) -> str | None:
    """Why a release may not write this cache path, or None (path is already normalised)."""
    if not path.startswith(STATE_DIR) and INCOMPLETE_SUFFIX not in path:
        return None  # the common case, decided without splitting
    parts = path.split("/")
    if parts[0] == STATE_DIR:
        return f"{path!r} is inside {STATE_DIR}/, which pull keeps for its state and lock"
    if any(is_temp_name(p) for p in parts):
        return f"{path!r} has the shape of pull's temp files (.*{INCOMPLETE_SUFFIX}), which pull deletes"
    return None
