"""The cache dir's state file is input nobody here wrote: decoded strictly, never a permission.

Each test starts from a real state, written by a real pull, then edits it as someone with write
access to the cache dir could: wrong types in every field, export names that are shell commands,
loader variables with the release id recomputed so that the edit is self-consistent.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild import ensure_cache
from neffbuild.documents.fields import Columns, column
from neffbuild.documents.records import Release, dump, parse, trusted_release
from neffbuild.errors import IntegrityError, StateCorrupt
from neffbuild.hashing import canonical_json, hash_bytes
from neffbuild.host.pull import pull
from neffbuild.host.state import STATE_FORMAT, Vouched, encode_state, holds_release, parse_state, release_in
from neffbuild.store.local import LocalStore
from tests.procs import without_override
from tests.statekit import as_v2, recorded_files
from tests.storekit import publish_release_of, write_files

STATE = Path(".neffbuild") / "state.json"


@pytest.fixture
def installed(tmp_path: Path) -> tuple[LocalStore, Path, dict[str, Any]]:
    """(store, cache dir, the state document) after a real pull of tag `t`."""
    store = LocalStore(tmp_path / "store", create=True)
    sources = write_files(tmp_path / "src", {"ab/one.so": 3000, "cd/two.bin": 5000, "three.json": 700})
    publish_release_of(store, tmp_path / "src", sources, tag="t")
    cache = tmp_path / "cache"
    pull(store, "t", cache)
    return store, cache, json.loads((cache / STATE).read_bytes())


def write_state(cache: Path, doc: Any, *, rehash: bool = True) -> None:
    """doc as the cache dir's state; rehash: recompute the release id over an edited release, as
    anyone can (XXH3 is no signature)."""
    if (
        rehash
        and isinstance(doc, dict)
        and isinstance(doc.get("installed"), dict)
        and isinstance(doc["installed"].get("release"), dict)
    ):
        doc["installed"]["release_id"] = hash_bytes(canonical_json(doc["installed"]["release"]))
    (cache / STATE).write_text(json.dumps(doc))


def neffbuild(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neffbuild", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False, timeout=120
    )  # fmt: skip


def gone(tmp_path: Path) -> str:
    return str(tmp_path / "no-such-store")  # unreachable: exit 3, which --allow-stale falls back from


# ---- acceptance: what a hand-written state could do before ---------------------------------------


@pytest.mark.parametrize("shell", ["bash", "dash"])
def test_an_export_name_that_is_a_command_never_runs_under_eval(installed, tmp_path: Path, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    _, cache, doc = installed
    marker = tmp_path / "touched"
    name = f"X;touch {marker};Y"
    doc["installed"]["exports"][name] = "1"
    doc["installed"]["release"]["env"][name] = "1"
    write_state(cache, doc)
    result = neffbuild("pull", "t", "--store", gone(tmp_path), "--cache-dir", str(cache), "--allow-stale")
    evaluated = subprocess.run(
        [shell, "-c", 'eval "$1"; echo "rc=$?"', shell, result.stdout], capture_output=True, text=True, check=False
    )
    assert not marker.exists(), evaluated
    assert result.returncode == StateCorrupt.exit_code and result.stdout == ""
    assert f"error: {cache.resolve() / STATE}: installed.exports: " in result.stderr, result.stderr
    assert "is not an environment variable name" in result.stderr
    assert "hint: " in result.stderr and "Traceback" not in result.stderr


def loader_state(cache: Path, doc: dict[str, Any]) -> None:
    """LD_PRELOAD in the installed release's env and in what the state says pull exported, the
    release id recomputed: a state that decodes, and claims the host accepted LD_PRELOAD."""
    doc["installed"]["release"]["env"]["LD_PRELOAD"] = "/tmp/evil.so"
    doc["installed"]["exports"]["LD_PRELOAD"] = "/tmp/evil.so"
    write_state(cache, doc)
    assert parse_state((cache / STATE).read_bytes()).problem is None


def test_a_state_cannot_grant_loader_variables_to_env_or_env_file(installed, tmp_path: Path) -> None:
    _, cache, doc = installed
    loader_state(cache, doc)
    env_file = tmp_path / "serving.env"
    for extra in ((), ("--env-file", str(env_file))):
        refused = neffbuild("env", "--cache-dir", str(cache), *extra)
        assert refused.returncode == IntegrityError.exit_code and "LD_PRELOAD" not in refused.stdout
        assert "env sets LD_PRELOAD" in refused.stderr and "--allow-env LD_PRELOAD" in refused.stderr
    assert not env_file.exists()
    for allow in (["--allow-env", "LD_PRELOAD"], []):
        allowed = neffbuild(
            "env",
            "--cache-dir",
            str(cache),
            "--env-file",
            str(env_file),
            *allow,
            env={} if allow else {"NEFFBUILD_ALLOW_ENV": "OTHER, LD_PRELOAD"},
        )
        assert allowed.returncode == 0, allowed.stderr
        assert (
            "export LD_PRELOAD=/tmp/evil.so\n" in allowed.stdout and "LD_PRELOAD=/tmp/evil.so\n" in env_file.read_text()
        )


def test_a_state_cannot_grant_loader_variables_to_a_stale_pull(installed, tmp_path: Path) -> None:
    _, cache, doc = installed
    loader_state(cache, doc)
    env_file = tmp_path / "serving.env"
    args = (
        "pull",
        "t",
        "--store",
        gone(tmp_path),
        "--cache-dir",
        str(cache),
        "--allow-stale",
        "--env-file",
        str(env_file),
    )
    refused = neffbuild(*args)
    assert refused.returncode == IntegrityError.exit_code and refused.stdout == "" and not env_file.exists()
    assert "env sets LD_PRELOAD" in refused.stderr
    allowed = neffbuild(*args, "--allow-env", "LD_PRELOAD")
    assert allowed.returncode == 0 and "export LD_PRELOAD=/tmp/evil.so\n" in allowed.stdout


def test_a_state_cannot_grant_loader_variables_to_ensure_cache(installed, tmp_path: Path) -> None:
    _, cache, doc = installed
    loader_state(cache, doc)
    with pytest.raises(IntegrityError, match="env sets LD_PRELOAD"):
        ensure_cache("t", store=gone(tmp_path), cache_dir=cache, allow_stale=True, host_check=False, env={})
    report = ensure_cache(
        "t", store=gone(tmp_path), cache_dir=cache, allow_stale=True, host_check=False, env={}, allow_env=["LD_PRELOAD"]
    )
    assert report.stale and report.exports["LD_PRELOAD"] == "/tmp/evil.so"


def test_apply_exports_checks_again_what_it_applies(installed, tmp_path: Path) -> None:
    from dataclasses import replace

    from neffbuild import apply_exports

    store, cache, _ = installed
    report = ensure_cache("t", store=store, cache_dir=cache, host_check=False, env={})
    environ: dict[str, str] = {}
    apply_exports(report, environ)
    assert environ == dict(report.exports)
    for exports in ({"LD_PRELOAD": "/x.so"}, {"A;B": "1"}, {"A": "\x00"}):
        with pytest.raises(IntegrityError):
            apply_exports(replace(report, exports=exports), {})
    apply_exports(replace(report, exports={"LD_PRELOAD": "/x.so"}, allowed=("LD_PRELOAD",)), environ)
    assert environ["LD_PRELOAD"] == "/x.so"


# ---- wrong types in every field: a corrupt state, never exit 1 -----------------------------------

_WRONG = [None, True, 7, -1, 2.5, "text", [], ["x"], {}, {"k": "v"}]


def mutations(doc: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(path, a value of another type) for every field and element of doc."""
    for key, value in doc.items() if isinstance(doc, dict) else enumerate(doc):
        here = (*path, key)
        for wrong in _WRONG:
            if type(wrong) is not type(value):
                yield here, wrong
        if isinstance(value, (dict, list)) and value:
            yield from mutations(value, here)


def mutated(doc: Any, path: tuple[str | int, ...], value: Any) -> Any:
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def test_every_wrong_type_in_every_field_is_a_corrupt_state_naming_the_field(installed) -> None:
    _, _cache, doc = installed
    free_form = ("unit",)  # a unit's own fields are free-form JSON: any value is one
    seen = 0
    for path, value in mutations(doc):
        edited = mutated(doc, path, value)
        if (
            isinstance(edited.get("installed"), dict)
            and isinstance(edited["installed"].get("release"), dict)
            and path[1:2] != ("release_id",)
        ):
            edited["installed"]["release_id"] = hash_bytes(canonical_json(edited["installed"]["release"]))
        state = parse_state(json.dumps(edited).encode())
        if any(part in free_form for part in path[:-1]) and path[-1] != "unit":
            continue
        if path[1:2] == ("units",) and path[3:4] == ("paths",) and len(path) == 5 and value == "text":
            # Format /4: a unit's path is an index into the release's files, or a path it does not list.
            assert state.problem is None and state.installed is not None and "text" in state.installed.units[0].paths
            continue
        if path[0] == "mtimes" and len(path) == 2 and value is None:  # not recorded: hashed again
            assert state.problem is None and len(state.files) == len(doc["mtimes"]) - 1
            continue
        seen += 1
        assert state.problem is not None, (path, value)
        assert state.installed is None and state.files == {}
        named = ".".join(str(p) for p in path[1:3] if isinstance(p, str))
        assert path[0] in state.problem or named.split(".")[0] in state.problem, (path, state.problem)
    assert seen > 200


def assert_edit_is_corrupt(doc: dict[str, Any], edit: Any, problem: str) -> None:
    """doc edited, its release id recomputed over the edited release (as anyone can), reads as a
    corrupt state whose problem says problem."""
    edited = copy.deepcopy(doc)
    edit(edited)
    edited["installed"]["release_id"] = hash_bytes(
        json.dumps(edited["installed"]["release"], sort_keys=True, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"
        )
    )
    state = parse_state(json.dumps(edited).encode())
    assert state.problem is not None and problem in state.problem, (problem, state.problem)
    assert state.installed is None and state.files == {}


def test_paths_outside_the_installed_release_are_still_checked(installed) -> None:
    # The release's own paths are checked once, with it; a path only the units or the hash cache
    # list is checked on its own, so an edit cannot slip an unsafe one past the parse.
    _, _, doc = installed
    doc = as_v2(doc)  # format /2 listed each path in the units and the table too (/4 below)
    for edit, problem in (
        (lambda d: d["installed"]["units"][0]["paths"].append("../escape.so"), "installed.units: unsafe path"),
        (lambda d: d["files"].update({"../escape.so": [1, 1, "0" * 32]}), "files: unsafe path"),
        (lambda d: d["installed"]["release"].update({"name": "\ud800"}), "lone surrogate"),
        (lambda d: d["files"].update({"a\ud800": [1, 1, "0" * 32]}), "lone surrogate"),
    ):
        assert_edit_is_corrupt(doc, edit, problem)


def test_commands_on_a_corrupt_state_exit_with_its_code_and_pull_repairs_it(installed, tmp_path: Path) -> None:
    """A sample of the mutations through each command, as processes: exit 13 naming the state
    file (or, for pull with its store, a repair), never exit 1."""
    store, cache, doc = installed
    samples = list(mutations(doc))[::37]
    assert len(samples) > 8
    for path, value in samples:
        edited = mutated(doc, path, value)
        for command in (
            ("env", "--cache-dir", str(cache)),
            ("status", "--cache-dir", str(cache)),
            ("pull", "t", "--store", gone(tmp_path), "--cache-dir", str(cache), "--allow-stale"),
            ("gc", "--cache-dir", str(cache), "--dry-run"),
        ):
            # The release id recomputed (unless it is the edit): an edit inside the release reaches
            # the field's own check, not only the id's.
            write_state(cache, copy.deepcopy(edited), rehash=path[1:2] != ("release_id",))
            if parse_state((cache / STATE).read_bytes()).problem is None:
                continue  # e.g. a value in a free-form field
            result = neffbuild(*command)
            assert result.returncode == StateCorrupt.exit_code, (path, value, command, result.stderr)
            assert str(cache.resolve() / STATE) in result.stderr and "Traceback" not in result.stderr
        write_state(cache, edited, rehash=path[1:2] != ("release_id",))
        repaired = neffbuild("pull", "t", "--store", str(store.root), "--cache-dir", str(cache), "--json")
        assert repaired.returncode == 0, repaired.stderr
        report = json.loads(repaired.stdout)
        assert report["files_fetched"] == 0 and report["files_rehashed"] == 3
        assert parse_state((cache / STATE).read_bytes()).installed is not None


def test_a_corrupt_state_on_a_read_only_cache_dir_is_said_as_such(installed, tmp_path: Path) -> None:
    store, cache, doc = installed
    doc = as_v2(doc)
    doc["files"] = []
    write_state(cache, doc)
    for top, dirs, files in os.walk(cache):
        for name in [*dirs, *files]:
            Path(top, name).chmod(Path(top, name).stat().st_mode & ~0o222)
    cache.chmod(0o555)
    result = without_override(
        [sys.executable, "-m", "neffbuild", "pull", "t", "--store", str(store.root), "--cache-dir", str(cache)]
    )
    assert result.returncode == StateCorrupt.exit_code, result.stderr
    assert (
        f"{cache.resolve() / STATE}: files: expected an object" in result.stderr
        and "cannot be rewritten" in result.stderr
    )


def test_symlinked_foreign_and_newer_state_files(installed, tmp_path: Path) -> None:
    _, cache, doc = installed
    (cache / STATE).unlink()
    (cache / STATE).symlink_to(tmp_path / "elsewhere.json")
    result = neffbuild("env", "--cache-dir", str(cache))
    assert result.returncode == StateCorrupt.exit_code and "a symbolic link" in result.stderr
    (cache / STATE).unlink()
    (cache / STATE).mkdir()
    assert neffbuild("env", "--cache-dir", str(cache)).returncode == StateCorrupt.exit_code
    (cache / STATE).rmdir()
    write_state(cache, {**doc, "format": "neffbuild.cache-state/9"})
    newer = neffbuild("env", "--cache-dir", str(cache))
    assert newer.returncode == 8 and "no installed release recorded" in newer.stderr  # not ours to judge, not corrupt
    write_state(cache, {**doc, "format": 2})
    assert neffbuild("env", "--cache-dir", str(cache)).returncode == StateCorrupt.exit_code


# ---- property tests: the decoder on arbitrary JSON and on mutations of a real state ---------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_fields = st.sampled_from(
    ["format", "installed", "files", "release_id", "tag", "store", "installed_at", "exports", "units", "release"]
)


@settings(max_examples=1_500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    raw=_json
    | st.dictionaries(_fields, _json, max_size=4)
    | st.fixed_dictionaries(
        {"format": st.just(STATE_FORMAT), "installed": st.dictionaries(_fields, _json), "files": _json}
    )
)
def test_the_decoder_on_arbitrary_json_says_corrupt_or_decodes(raw: Any) -> None:
    state = parse_state(json.dumps(raw).encode())
    assert state.problem is None or (state.installed is None and state.files == {} and "\n" not in state.problem)


@pytest.fixture(scope="module")
def real_state(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("real-state")
    store = LocalStore(root / "store", create=True)
    sources = write_files(root / "src", {"ab/one.so": 300, "cd/two.bin": 500})
    publish_release_of(store, root / "src", sources, tag="t")
    pull(store, "t", root / "cache")
    return json.loads((root / "cache" / STATE).read_bytes())


@settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_decoder_on_mutations_of_a_real_state_says_corrupt_or_decodes(
    real_state: dict[str, Any], data: st.DataObject
) -> None:
    paths = [path for path, _ in mutations(real_state)]
    doc = real_state
    for _ in range(data.draw(st.integers(1, 3))):
        path, value = data.draw(st.sampled_from(paths)), data.draw(_json)
        try:
            doc = mutated(doc, path, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation took that path away
    if (
        data.draw(st.booleans())
        and isinstance(doc.get("installed"), dict)
        and isinstance(doc["installed"].get("release"), dict)
    ):
        doc["installed"]["release_id"] = hash_bytes(canonical_json(doc["installed"]["release"]))
    state = parse_state(json.dumps(doc).encode())
    if state.problem is None:
        assert state.version == 4 and state.installed is not None
        assert all(type(v[0]) is int and type(v[1]) is int and isinstance(v[2], str) for v in state.files.values())
    else:
        with pytest.raises(StateCorrupt):
            state.trusted(Path("state.json"))


@pytest.mark.parametrize("verify", ["fast", "full"])
def test_an_edited_unit_fingerprint_in_the_state_repairs_itself_instead_of_refusing_forever(
    tmp_path: Path, verify: str
) -> None:
    """installed.units[].fingerprint is not bound to the unit's key: an edit there made every
    pull exit 7 (--verify full too). The bundles in the store say what the keys name."""
    store = LocalStore(tmp_path / "store", create=True)
    publish_release_of(store, tmp_path / "src", write_files(tmp_path / "src", {"a.so": 100}), name="m", tag="prod")
    cache = tmp_path / "cache"
    pull(store, "prod", cache, host_env=os.environ)
    state_file = cache / ".neffbuild" / "state.json"
    good = json.loads(state_file.read_bytes())
    edited = copy.deepcopy(good)
    edited["installed"]["units"][0]["fingerprint"]["torch"] = "0.0.0-edited"
    state_file.write_bytes(json.dumps(edited).encode())
    assert parse_state(state_file.read_bytes()).problem is None  # well-formed: only its meaning is wrong
    pulled = subprocess.run(
        [sys.executable, "-m", "neffbuild", "pull", "prod", "--store", store.url, "--cache-dir", str(cache), "--verify", verify],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(state_file.read_bytes())["installed"]["units"] == good["installed"]["units"]


# ---- the no-op pull's fast path: a release held exactly as the store serves it ------------------


def store_release_bytes(store: LocalStore, doc: dict[str, Any]) -> bytes:
    data = store.get_doc("releases", doc["installed"]["release_id"])
    assert data is not None
    return data


def test_a_release_held_as_the_store_serves_it_reads_as_the_strict_parse(installed) -> None:
    store, cache, doc = installed
    data = (cache / STATE).read_bytes()
    served = store_release_bytes(store, doc)
    found = release_in(data)
    assert found is not None and found[0] == doc["installed"]["release_id"] and data[found[1] : found[2]] == served
    assert holds_release(data, found, found[0], served) and not holds_release(data, found, found[0], served[:-1])
    assert not holds_release(data, found, "0" * 32, served)
    release = trusted_release(served)
    assert release is not None
    vouched = parse_state(data, Vouched(doc["installed"]["release_id"], served, release))
    assert vouched == parse_state(data) and vouched.problem is None
    assert vouched.installed is not None and vouched.installed.release is release  # not decoded again


def test_a_tampered_or_unvouched_release_in_the_state_is_parsed_strictly(installed) -> None:
    """Only bytes equal to the store's are taken as vouched; an edit (even self-consistent, its id
    recomputed), a second release key, or other bytes take the strict parse, with its verdict."""
    store, cache, doc = installed
    served = store_release_bytes(store, doc)
    release = trusted_release(served)
    assert release is not None
    unsafe = copy.deepcopy(doc)
    unsafe["installed"]["release"]["files"][0]["path"] = "../escape.so"
    write_state(cache, unsafe)
    edited = (cache / STATE).read_bytes()
    recomputed = unsafe["installed"]["release_id"]
    for data, vouched in (
        (edited, Vouched(doc["installed"]["release_id"], served, release)),  # not the store's bytes
        (edited, Vouched(recomputed, served, release)),  # the edit's id, but other bytes
        (json.dumps(unsafe, sort_keys=True, separators=(",", ":")).encode(), Vouched(recomputed, served, release)),
    ):
        state = parse_state(data, vouched)
        assert state.problem is not None and "unsafe path" in state.problem, state.problem
        assert state.installed is None
    # The store's bytes where encode_state puts them, but a later "release" key the JSON parse keeps:
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doubled = canonical.replace(b',"release_id":"', b',"release":' + json.dumps(unsafe["installed"]["release"]).encode() + b',"release_id":"', 1)  # fmt: skip
    state = parse_state(doubled, Vouched(doc["installed"]["release_id"], served, release))
    assert state == parse_state(doubled) and state.problem is not None


def test_trusted_release_is_the_strict_parse_or_none(installed) -> None:
    store, _, doc = installed
    served = store_release_bytes(store, doc)
    trusted, strict = trusted_release(served), parse(Release, served, "r")
    assert trusted == strict and strict == trusted and dump(trusted) == dump(strict) == served
    # Its files are columns until one is read: counted, sized and shown as the strict parse's.
    assert type(trusted.files) is Columns and len(trusted.files) == len(strict.files) > 0
    assert trusted.total_size == strict.total_size and repr(trusted) == repr(strict)
    assert column(trusted.files, "path") == [f.path for f in strict.files] == list(column(strict.files, "path"))
    raw = json.loads(served)
    for edit in (
        lambda r: r.update(format="neffbuild.release/1"),
        lambda r: r["files"][0].pop("blake3"),
        lambda r: r["files"].append("x"),
        lambda r: r.update(env={"1BAD": "x"}),  # every field but the file list is still checked
        lambda r: r.update(files={}),
    ):
        edited = copy.deepcopy(raw)
        edit(edited)
        assert trusted_release(json.dumps(edited).encode()) is None
    assert trusted_release(b"[") is None and trusted_release(b"[]") is None


# Written by e6d1870's own pull (the last commit writing format /2 with each path in the release,
# the units and the file table): a tag `prod` of three files pulled into /tmp/fx/cache. One edit
# since: the writing venv's prefix in the fingerprint is /opt/venv (it named a dir of the machine
# that wrote it), and the release id is the edited release's hash, as the state requires.
FIXTURE_E6D1870 = Path(__file__).parent.parent / "fixtures" / "formats" / "e6d1870" / "state.json"


def test_a_state_written_by_an_earlier_pull_reads_as_its_release_installed(tmp_path: Path) -> None:
    data = FIXTURE_E6D1870.read_bytes()
    state = parse_state(data)
    assert state.problem is None and state.version == 2 and state.installed is not None
    assert (state.release_id, state.tag) == ("80bd1b210869d4e33eaf4d2572329c1e", "prod")
    assert sorted(state.files) == ["a.bin", "sub/b.bin", "sub/c.bin"]
    assert [u.paths for u in state.installed.units] == [("a.bin", "sub/b.bin", "sub/c.bin")]
    assert state.files["sub/b.bin"][0] == 20 and state.installed.exports["OMP_NUM_THREADS"] == "2"
    # As a cache dir's state: `env` answers from it, with no store.
    (tmp_path / "cache" / ".neffbuild").mkdir(parents=True)
    shutil.copy(FIXTURE_E6D1870, tmp_path / "cache" / ".neffbuild" / "state.json")
    env = subprocess.run(
        [sys.executable, "-m", "neffbuild", "env", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert env.returncode == 0, env.stderr
    assert "OMP_NUM_THREADS=2" in env.stdout and f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'cache'}" in env.stdout


# ---- format /4: each path once -------------------------------------------------------------------


def test_format_4_round_trips_and_reads_as_the_same_state_as_format_2(installed) -> None:
    store, cache, doc = installed
    assert doc["format"] == STATE_FORMAT == "neffbuild.cache-state/4" and "files" not in doc
    data = (cache / STATE).read_bytes()
    state, old = parse_state(data), parse_state(json.dumps(as_v2(doc)).encode())
    assert state.problem is None and state.version == 4 and old.version == 2
    assert (state.installed, dict(state.files)) == (old.installed, old.files) and state.files == old.files
    assert state.installed is not None
    assert encode_state(state.installed, state.files) == data  # the same bytes again
    assert encode_state(state.installed, old.files) == data
    served = store_release_bytes(store, doc)
    release = trusted_release(served)
    assert release is not None
    assert parse_state(data, Vouched(doc["installed"]["release_id"], served, release)) == state


def test_format_4_is_read_as_strictly(installed) -> None:
    _, _, doc = installed
    count = len(doc["mtimes"])
    for edit, problem in (
        (lambda d: d["mtimes"].append(1), f"mtimes: expected a list of {count} mtimes"),
        (lambda d: d["mtimes"].pop(), "mtimes: expected a list"),
        (lambda d: d["mtimes"].__setitem__(0, "1"), "mtimes: expected a list"),
        (lambda d: d["mtimes"].__setitem__(0, True), "mtimes: expected a list"),
        (lambda d: d["mtimes"].__setitem__(0, 1.5), "mtimes: expected a list"),
        (lambda d: d.update(mtimes={}), "mtimes: expected a list"),
        (lambda d: d.pop("mtimes"), "mtimes"),
        (lambda d: d.update(files={}), "files"),  # /2's table is no field of /4
        (lambda d: d["installed"]["units"][0]["paths"].append(count), "installed.units.0.paths: '3' is no file"),
        (lambda d: d["installed"]["units"][0]["paths"].append(-1), "installed.units.0.paths: '-1' is no file"),
        (lambda d: d["installed"]["units"][0]["paths"].append(True), "installed.units.0.paths: 'True' is no file"),
        (lambda d: d["installed"]["units"][0]["paths"].append(None), "installed.units.0.paths: 'None' is no file"),
        (lambda d: d["installed"]["units"][0]["paths"].append("../escape.so"), "installed.units: unsafe path"),
        (lambda d: d["installed"]["units"][0]["paths"].append("a\ud800"), "lone surrogate"),
        (lambda d: d["installed"]["release"].update({"name": "\ud800"}), "lone surrogate"),
        (lambda d: d["installed"]["release"]["files"][0].update(path="../escape.so"), "unsafe path"),
    ):
        assert_edit_is_corrupt(doc, edit, problem)
    unrecorded = copy.deepcopy(doc)
    unrecorded["mtimes"][0] = None  # a file not recorded: hashed again, not corrupt
    state = parse_state(json.dumps(unrecorded).encode())
    assert state.problem is None and len(state.files) == count - 1
    assert recorded_files(unrecorded) == {p: list(v) for p, v in state.files.items()}


def test_an_earlier_format_is_rewritten_as_format_4_by_the_next_pull_once(installed) -> None:
    store, cache, doc = installed
    for earlier in (as_v2(doc), json.loads(FIXTURE_E6D1870.read_bytes())):
        (cache / STATE).write_text(json.dumps(earlier))
        report = pull(store, "t", cache)
        assert report.files_fetched == 0
        rewritten = (cache / STATE).read_bytes()
        assert json.loads(rewritten)["format"] == STATE_FORMAT
        pull(store, "t", cache)
        assert (cache / STATE).read_bytes() == rewritten  # a no-op writes nothing
    assert recorded_files(json.loads(rewritten)).keys() == recorded_files(doc).keys()


@pytest.mark.parametrize("form", ["4", "2"])
def test_a_no_op_finds_every_change_whatever_the_format(installed, tmp_path: Path, form: str) -> None:
    """The column-wise comparison (format /4) and the per-file one (/2) give one verdict."""
    store, cache, doc = installed
    for change, fetched, rehashed in (
        (lambda: (cache / "ab" / "one.so").unlink(), 1, 0),
        (lambda: os.utime(cache / "cd" / "two.bin", ns=(1, 1)), 0, 1),
        (lambda: (cache / "three.json").write_bytes(b"x" * 700), 1, 1),  # same size, other bytes
        (lambda: (cache / "three.json").write_bytes(b"x"), 1, 0),
        (lambda: None, 0, 0),
    ):
        state = doc if form == "4" else as_v2(doc)
        pull(store, "t", cache, verify="full")
        state = json.loads((cache / STATE).read_bytes())
        (cache / STATE).write_text(json.dumps(state if form == "4" else as_v2(state)))
        change()
        report = pull(store, "t", cache)
        assert (report.files_fetched, report.files_rehashed) == (fetched, rehashed), change
