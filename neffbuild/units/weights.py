"""A local model's weights as one digest, for the units whose compiled output holds them.

Most compiled results take the weights as inputs: the same graphs serve any weights, and a local
model is keyed by its config files alone (plan.model_identity). Two kinds of unit bake the values
in: an AOTInductor package (artifact = "package": the weights are the package's constants) and an
Inductor recipe with `freezing` (parameters folded into the kernels as constants). For those, two
directories with the same configs but other weights must not share a key: the second would be
told "hit" and serve the first one's weights (a package) or miss at serving while status said hit.

Hashing multi-GB weights on every plan would undo the no-op build, so digests are remembered by
each file's (size, mtime_ns, inode) in a small JSON file beside the plan cache (the way dvc and git's
index trust stat data): a rewritten file changes its mtime or inode and is hashed again. A corrupt
memo is ignored (logged) and rewritten.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neffbuild.documents.compile_recipe import ResolvedRecipe
from neffbuild.formats import FORMATS, writes
from neffbuild.fs.atomic import write_atomic
from neffbuild.hashing import canonical_json, hash_bytes, hash_file

log = logging.getLogger(__name__)

MEMO = "weights.json"
_KIND = "weights memo"  # a cache: an unknown format is hashed again, never an error


def bakes_weights(recipes: list[ResolvedRecipe]) -> bool:
    """Whether a compiled result of these recipes holds the weights' values (see the module doc)."""
    return any(r.artifact == "package" or bool(r.inductor.get("freezing")) for r in recipes)


def weights_digest(root: Path, is_config: Callable[[Path], bool], memo_dir: Path | None) -> str:
    """One digest of every file under root that is not a config file (by path and content)."""
    memo = _read_memo(memo_dir)
    parts, changed = [], False
    for path in sorted(root.rglob("*")):
        if not path.is_file() or is_config(path):
            continue
        st = path.stat()
        where, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
        known = memo.get(where)
        if not (isinstance(known, list) and len(known) == 4 and known[:3] == stamp):
            known = [*stamp, hash_file(path, crypto=False).hex]
            memo[where], changed = known, True
        parts.append([path.relative_to(root).as_posix(), st.st_size, known[3]])
    if changed and memo_dir is not None:
        _write_memo(memo_dir, memo)
    return hash_bytes(canonical_json(parts))


def _read_memo(memo_dir: Path | None) -> dict[str, Any]:
    if memo_dir is None:
        return {}
    path = memo_dir / MEMO
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("weights memo %s unreadable (%s): hashing the weights again", path, exc)
        return {}
    if (
        not isinstance(doc, dict)
        or doc.get("format") not in FORMATS[_KIND].reads
        or not isinstance(doc.get("files"), dict)
    ):
        log.warning("weights memo %s is not a %s document: hashing the weights again", path, writes(_KIND))
        return {}
    return dict(doc["files"])


def _write_memo(memo_dir: Path, memo: dict[str, Any]) -> None:
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(memo_dir / MEMO, canonical_json({"format": writes(_KIND), "files": memo}))
    except OSError as exc:  # a memo is a speed-up: planning goes on without it
        log.warning("weights memo: cannot write %s (%s)", memo_dir / MEMO, exc)
