"""Stored documents: strict decoding (they arrive from the network) and stable content ids."""

from __future__ import annotations

import dataclasses
import json
import pickle
import unicodedata
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild.documents import fields, records
from neffbuild.documents.bundles import BundleRecord, Timings
from neffbuild.documents.records import (
    RELEASE_FORMAT_1,
    FileEntry,
    Release,
    ReleaseUnit,
    TagEvent,
    TagRecord,
    dump,
    parse,
    to_json,
    unit_key,
)
from neffbuild.errors import IntegrityError
from neffbuild.names import reserved_problem

DIGEST = "0123456789abcdef0123456789abcdef"


def release(**changes: object) -> Release:
    fields: dict = {
        "name": "m", "manifest_digest": DIGEST, "backend": "inductor", "cache_env": "TORCHINDUCTOR_CACHE_DIR",
        "env": {"OMP_NUM_THREADS": "2"}, "fingerprint": {"torch": "2.13.0"},
        "units": (ReleaseUnit(unit_id="m/1x1x1", key=DIGEST),),
        "files": (FileEntry(path="ab/c.so", size=3, digest=DIGEST, blake3="5" * 64),),
    }  # fmt: skip
    return Release(**{**fields, **changes})


def test_round_trip_keeps_the_document_and_its_id() -> None:
    doc = release()
    back = parse(Release, dump(doc), "r.json")
    assert back == doc and back.release_id == doc.release_id


def test_release_id_is_the_digest_of_canonical_json() -> None:
    # Pinned: a change here would rename every release ever published (and re-upload them).
    doc = release()
    assert dump(doc).startswith(b'{"backend":"inductor","cache_env"')
    # (Format 2 first carried SHA-256, on unreleased main only; with BLAKE3 its ids are these.)
    assert doc.release_id == "95595e47ee4105d8b3040b146a3277af"
    assert doc.release_id != release(env={"OMP_NUM_THREADS": "4"}).release_id
    # A version 1 release (no BLAKE3 in its entries) keeps the id it was published under.
    old = release(format=RELEASE_FORMAT_1, files=(FileEntry(path="ab/c.so", size=3, digest=DIGEST),))
    assert b"blake3" not in dump(old)
    assert old.release_id == "a952b154162ab4dce815aca7b35846dc"
    assert parse(Release, dump(old), "r.json") == old


def test_version_2_documents_need_every_blake3_and_version_1_none() -> None:
    doc = to_json(release())
    del doc["files"][0]["blake3"]
    with pytest.raises(IntegrityError, match=r"files\.0\.blake3: required in format 'neffbuild.release/2'"):
        parse(Release, json.dumps(doc).encode(), "r.json")
    doc["files"][0]["blake3"] = "Z" * 64
    with pytest.raises(IntegrityError, match="not a 64-digit lowercase hex BLAKE3"):
        parse(Release, json.dumps(doc).encode(), "r.json")
    # The SHA-256 entries of unreleased builds of format 2 are refused, not read as unsigned.
    doc["files"][0]["sha256"] = doc["files"][0].pop("blake3")
    with pytest.raises(IntegrityError, match=r"files\.0\.sha256: unknown field"):
        parse(Release, json.dumps(doc).encode(), "r.json")
    assert release().signable and not release(format=RELEASE_FORMAT_1).signable


def test_unit_key_formula_is_pinned() -> None:
    # A change here would rename every bundle ever published: every host would miss once.
    assert unit_key({"shape": {"height": 128}}, {"torch": "2.13.0"}) == "24eebb42ab4fb9308c430e9be1fe0989"
    assert unit_key({"shape": {"height": 128}}, {"torch": "2.13.1"}) != "24eebb42ab4fb9308c430e9be1fe0989"


def mutated(edit) -> bytes:
    raw = json.loads(dump(release()))
    edit(raw)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(extra=1), "at extra: unknown field"),
        (lambda r: r.pop("files"), "at files: field required"),
        (lambda r: r.update(files={}), "at files: expected a list"),
        (lambda r: r["files"][0].update(size="3"), "at files.0.size: expected int, got str"),
        (lambda r: r["files"][0].update(size=True), "at files.0.size: expected int, got bool"),
        (lambda r: r["files"][0].update(size=-1), "at files.0.size: -1 is negative"),
        (lambda r: r["files"][0].update(digest="ABC"), "at files.0.digest: 'ABC' is not a 32-digit"),
        (lambda r: r["files"][0].update(path="../etc/passwd"), "unsafe path '../etc/passwd'"),
        (lambda r: r["files"][0].update(path="/abs"), "unsafe path '/abs'"),
        (lambda r: r["files"][0].update(path="a//b"), "unsafe path 'a//b'"),
        (lambda r: r["env"].update(X=1), "at env.X: expected str, got int"),
        (lambda r: r["units"][0].update(key=None), "at units.0.key: expected str, got NoneType"),
    ],
)
def test_malformed_documents_are_integrity_errors_naming_the_field(edit, message: str) -> None:
    with pytest.raises(IntegrityError) as info:
        parse(Release, mutated(edit), "s3://b/releases/r.json")
    assert info.value.message.startswith("s3://b/releases/r.json: invalid Release")
    assert message in info.value.message


def test_wrong_format_and_broken_json_are_refused() -> None:
    with pytest.raises(IntegrityError, match="format 'neffbuild.release/9'"):
        parse(Release, mutated(lambda r: r.update(format="neffbuild.release/9")), "r.json")
    with pytest.raises(IntegrityError, match="not valid JSON"):
        parse(Release, b'{"name": ', "r.json")
    with pytest.raises(IntegrityError, match="expected an object"):
        parse(TagRecord, b"[]", "t.json")


def test_tag_history_decodes_nested_records_and_defaults() -> None:
    event = TagEvent(release=DIGEST, at="2026-01-01T00:00:00+00:00", by="ci")
    raw = json.loads(dump(TagRecord(name="prod", release=DIGEST, history=(event,))))
    raw.pop("format")  # an absent field with a default takes it... then the format check refuses None
    with pytest.raises(IntegrityError, match="format None"):
        parse(TagRecord, json.dumps(raw).encode(), "t.json")
    raw["format"] = "neffbuild.tag/1"
    tag = parse(TagRecord, json.dumps(raw).encode(), "t.json")
    assert tag.history == (event,) and isinstance(tag.history, tuple)


# ---- what a hostile store could hand pull (issue 9) ---------------------------------------------


def with_files(*files: tuple[str, str]) -> bytes:
    return mutated(lambda r: r.update(files=[{"path": p, "size": 1, "digest": d} for p, d in files]))


OTHER = "f" * 32


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (with_files((".neffbuild/state.json", DIGEST)), "inside .neffbuild/, which pull keeps"),
        (with_files((".neffbuild/pull.lock", DIGEST)), "inside .neffbuild/, which pull keeps"),
        (with_files(("ab/.c.so.123.0123456789.incomplete", DIGEST)), "the shape of pull's temp files"),
        (with_files(("a.so", DIGEST), ("a.so", DIGEST)), "'a.so' is listed twice"),
        (with_files(("a.so", DIGEST), ("a.so", OTHER)), "'a.so' is listed twice, with two digests"),
        (with_files(("a", DIGEST), ("a/b", OTHER)), "'a' is a file and also the directory of 'a/b'"),
        (with_files(("x/a/b/c", DIGEST), ("x/a", OTHER)), "'x/a' is a file and also the directory of 'x/a/b/c'"),
        (with_files(("Kernel.so", DIGEST), ("kernel.so", OTHER)), "differ only in case"),
        (with_files(("A", DIGEST), ("a/b", OTHER)), "'A' is a file and also the directory of 'a/b'"),
        (with_files(("caf\u00e9", DIGEST), ("cafe\u0301", OTHER)), "differ only in case"),  # NFC vs NFD
        (
            with_files(
                ("a\nb", DIGEST),
            ),
            "without control characters",
        ),
        (
            with_files(
                ("x" * 256, DIGEST),
            ),
            "is too long",
        ),
        (
            with_files(
                ("a/" * 600 + "b", DIGEST),
            ),
            "is too long",
        ),
        (mutated(lambda r: r["files"][0].update(size=1 << 63)), "larger than any file"),
        (
            mutated(lambda r: r.update(shared=[{"path": "../x", "kept": DIGEST, "dropped": []}])),
            "at shared.0.path: unsafe path",
        ),
        (mutated(lambda r: r.update(cache_env="")), "at cache_env: '' is not an environment variable name"),
        (
            mutated(lambda r: r["env"].update({"X=1; touch PWNED; Y": "1"})),
            "at env: 'X=1; touch PWNED; Y' is not an environment",
        ),
        (mutated(lambda r: r["env"].update({"A\nLD_PRELOAD": "1"})), "at env: 'A\\nLD_PRELOAD' is not"),
        (mutated(lambda r: r.update(unit=1)), "at unit: unknown field"),
        (mutated(lambda r: r["env"].update({"\ud800": "1"})), r"at env.'\ud800': '\ud800' holds a lone surrogate"),
        (mutated(lambda r: r["env"].update(A="\udfff")), "at env.A: '\\udfff' holds a lone surrogate"),
        (
            mutated(lambda r: r["files"][0].update(path="a\ud800b")),
            "at files.0.path: 'a\\ud800b' holds a lone surrogate",
        ),
        (mutated(lambda r: r.update(name="\udc80")), "at name:"),
    ],
)
def test_paths_that_never_settle_and_hostile_strings_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(IntegrityError) as info:
        parse(Release, data, "s3://b/releases/r.json")
    assert info.value.message.startswith("s3://b/releases/r.json: invalid Release at ")
    assert message in info.value.message
    assert "\n" not in info.value.message and info.value.message.encode("utf-8")  # one printable line


@pytest.mark.parametrize("kind", [Release, BundleRecord, TagRecord])
@pytest.mark.parametrize("depth", [20, 1_000, 100_000])
def test_deep_nesting_is_an_integrity_error_never_a_recursion_error(kind: type, depth: int) -> None:
    data = b'{"format": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(IntegrityError):
        parse(kind, data, "doc.json")
    nested = '{"k":[' * depth + '"x"' + "]}" * depth  # in a free-form field (any JSON is typed right)
    free_form = dump(bundle(unit={"call": "NESTED"})).replace(b'"NESTED"', nested.encode())
    with pytest.raises(IntegrityError, match="at unit.call.k.0.*: nested deeper than 16|nested too deeply"):
        parse(BundleRecord, free_form, "b.json")


def bundle(**changes: object) -> BundleRecord:
    fields: dict = {
        "key": DIGEST, "unit_id": "m/1x1x1", "unit": {"shape": {"height": 128}}, "backend": "inductor",
        "fingerprint": {"torch": "2.13.0"}, "files": (FileEntry(path="ab/c.so", size=3, digest=DIGEST, blake3="5" * 64),),
        "counters": {"hits": 1}, "timings": Timings(), "created_at": "2026-01-01T00:00:00+00:00", "neffbuild_version": "t",
    }  # fmt: skip
    return BundleRecord(**{**fields, **changes})


def test_a_tag_document_must_hold_a_tag_name() -> None:
    raw = json.loads(dump(TagRecord(name="prod", release=DIGEST, history=())))
    raw["name"] = "../../x"
    with pytest.raises(IntegrityError, match="at name: '../../x' is not a tag name"):
        parse(TagRecord, json.dumps(raw).encode(), "t.json")


# ---- fuzz: no input makes a parser crash (issue 9, scope 8) -------------------------------------
# Each parser sees EXAMPLES inputs: raw bytes, arbitrary JSON, and valid documents with one part
# replaced by arbitrary JSON. Every rejection must be an IntegrityError (exit 4), never anything
# else; every document accepted must re-serialise, and its file list must settle in a cache dir.

EXAMPLES = 2_000
PATHS = [
    "a",
    "A",
    "a/b",
    "a/B",
    "a/b/c",
    "b",
    ".neffbuild/s",
    "x/.y.1.2.incomplete",
    "é",
    "e\u0301",
    "../x",
    "a//b",
    "",
]

_lone_surrogate = st.tuples(
    st.text(max_size=3), st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]), st.text(max_size=3)
).map("".join)
_text = st.text(st.characters() | st.sampled_from("\x00\n/\\.$'\""), max_size=8) | _lone_surrogate
_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | _text
    | st.sampled_from(PATHS)
)
_json = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(_text | st.sampled_from(["path", "size", "digest", "format"]), inner, max_size=3)
    ),
    max_leaves=8,
)
_file = st.fixed_dictionaries({
    "path": st.sampled_from(PATHS) | _text,
    "size": st.sampled_from([0, 1, 3]) | st.sampled_from([-1, True, 1.5, 2**63]),
    "digest": st.sampled_from([DIGEST, OTHER]) | st.sampled_from(["x", DIGEST.upper()]),
})  # fmt: skip
_same_kind = {str: _text | st.sampled_from(PATHS), int: st.integers(), float: st.floats(), bool: st.booleans()}

SAMPLES = {
    Release: lambda: json.loads(dump(release())),
    BundleRecord: lambda: json.loads(dump(bundle())),
    TagRecord: lambda: json.loads(
        dump(TagRecord(name="prod", release=DIGEST, history=(TagEvent(release=DIGEST, at="t", by="ci"),)))
    ),
}


def replace_somewhere(doc: Any, data: st.DataObject) -> Any:
    """doc with one value (at a random depth) replaced, mostly by one of its own JSON type (so
    that many mutants pass the type checks and reach the deeper ones), else by any JSON; or a
    key dropped or added."""
    if data.draw(st.integers(0, 7)) == 0 or not isinstance(doc, (dict, list)):
        same = _same_kind.get(type(doc))
        return data.draw(same if same is not None and data.draw(st.booleans()) else _json | st.lists(_file, max_size=4))
    if not doc or data.draw(st.integers(0, 5)) == 0:  # grow: a new key or item
        if isinstance(doc, dict):
            return {
                **doc,
                data.draw(_text | st.sampled_from(["OMP_NUM_THREADS", "TORCHINDUCTOR_X", "path"])): data.draw(_json),
            }
        return [*doc, data.draw(_file | _json)]
    key = data.draw(st.sampled_from(sorted(doc) if isinstance(doc, dict) else list(range(len(doc)))))
    if isinstance(doc, dict) and data.draw(st.integers(0, 9)) == 0:
        return {k: v for k, v in doc.items() if k != key}
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[key] = replace_somewhere(doc[key], data)
    return copy


def check_parse(kind: type, data: bytes) -> None:
    try:
        doc = parse(kind, data, "fuzz.json")
    except IntegrityError as exc:
        assert exc.exit_code == 4 and "\n" not in exc.message
        exc.message.encode("utf-8")  # printable: no lone surrogate reaches the terminal
        return
    assert parse(kind, dump(doc), "again.json") == doc  # what is accepted re-serialises
    files = getattr(doc, "files", ())
    assert all(
        reserved_problem(f.path) is None and ".." not in f.path.split("/") and not f.path.startswith("/") for f in files
    )
    folded = [unicodedata.normalize("NFD", unicodedata.normalize("NFD", f.path).casefold()) for f in files]
    assert len(set(folded)) == len(folded)
    assert not {p.rsplit("/", i)[0] for p in folded for i in range(1, p.count("/") + 1)} & set(folded)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("kind", [Release, BundleRecord, TagRecord])
@FUZZ
@given(data=st.data())
def test_fuzz_documents_parse_or_are_refused_as_integrity_errors(kind: type, data: st.DataObject) -> None:
    shape = data.draw(st.sampled_from(["mutated", "mutated", "files", "json", "bytes"]))
    if shape == "bytes":
        raw = data.draw(st.binary(max_size=200))
    else:
        if shape == "json":
            doc = data.draw(_json)
        else:
            doc = SAMPLES[kind]()
            if shape == "files" and "files" in doc:
                doc["files"] = data.draw(st.lists(_file, max_size=5))
            else:
                doc = replace_somewhere(doc, data)
        raw = json.dumps(doc, allow_nan=True).encode()  # ensure_ascii: lone surrogates as \ud800
    check_parse(kind, raw)


# ---- a file list is decoded a column at a time: the same verdicts as entry by entry --------------

_NAMES = st.sampled_from(
    ["a", "ab", ".", "..", "...", ".a", "a.", "", ".neffbuild", ".neffbuildx", ".x.1.2.incomplete", "a\\b",
     "a\nb", "a\x7fb", "é", "x" * 255, "x" * 256, "A", "AB"]
)  # fmt: skip
_PATHS = st.lists(_NAMES, min_size=1, max_size=4).map("/".join) | st.sampled_from(["/a", "a/", "a//b", "y" * 1025])
_ENTRY = st.fixed_dictionaries(
    {
        "path": _PATHS,
        "size": st.sampled_from([0, 3, 1 << 63, -1, True, 2.0]),
        "digest": st.sampled_from([DIGEST, DIGEST.upper(), DIGEST[:-1], 5]),
        "blake3": st.sampled_from(["", "5" * 64, "5" * 63, None]),
    }
)
_GOOD = st.fixed_dictionaries(
    {
        "path": st.lists(st.sampled_from(["a", "b.c", "..d", "x" * 255]), min_size=1, max_size=3).map("/".join),
        "size": st.integers(0, (1 << 63) - 1),
        "digest": st.just(DIGEST),
        "blake3": st.sampled_from(["", "5" * 64]),
    }
)


@st.composite
def _file_lists(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Mostly good entries, at times one that may be anything (so both roads are taken)."""
    files = draw(st.lists(_GOOD, max_size=5))
    odd = draw(st.none() | _ENTRY)
    if odd is not None:
        files.insert(draw(st.integers(0, len(files))), odd)
    return files


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(_file_lists())
def test_a_file_list_decodes_a_column_at_a_time_exactly_as_entry_by_entry(files: list[dict[str, Any]]) -> None:
    # The column check may take the fast road only where every entry passes one by one; where one
    # does not, the list is refused as before, naming that entry.
    def decoded(decode: Any) -> object:
        try:
            return decode()
        except records._Invalid as exc:
            return (exc.loc, exc.msg)

    by_column = decoded(lambda: records._file_entries(files, ("files",)))
    one_by_one = decoded(lambda: tuple(records._file_entry(v, ("files", i)) for i, v in enumerate(files)))
    assert by_column == one_by_one


def test_file_entries_from_columns_are_the_entries_the_dataclass_makes() -> None:
    # Built without a call of FileEntry per entry: equal, hashed, shown and frozen as FileEntry's own.
    columns = (["a/b", "c"], [3, 0], [DIGEST, "f" * 32], ["5" * 64, ""])
    built, made = fields.from_columns(FileEntry, *columns), tuple(map(FileEntry, *columns))
    assert built == made and type(built) is tuple and [type(e) for e in built] == [FileEntry, FileEntry]
    assert [repr(e) for e in built] == [repr(e) for e in made] and hash(built) == hash(made)
    assert dataclasses.replace(built[0], size=4) == FileEntry("a/b", 4, DIGEST, "5" * 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built[0].size = 5  # type: ignore[misc]
    assert fields.from_columns(FileEntry, [], [], [], []) == ()
    for odd in (columns[:3], (*columns[:3], ["5" * 64])):
        with pytest.raises(ValueError, match="one column per field"):
            fields.from_columns(FileEntry, *odd)


def test_columns_are_the_tuple_they_hold_built_only_where_an_item_is_read() -> None:
    columns = (["a/b", "c", "d"], [3, 0, 7], [DIGEST, "f" * 32, DIGEST], ["5" * 64, "", ""])
    held, made = fields.Columns(FileEntry, *columns), tuple(map(FileEntry, *columns))
    assert fields.column(held, "size") == [3, 0, 7] and len(held) == 3
    assert held._built is None  # nothing built for its length or a column
    assert held == made and made == held and held == fields.Columns(FileEntry, *columns) and held != list(made)
    assert hash(held) == hash(made) and repr(held) == repr(made) and pickle.loads(pickle.dumps(held)) == made
    assert held[1] == made[1] and held[-1] == made[-1] and held[1:] == made[1:] and list(held) == list(made)
    assert FileEntry("c", 0, "f" * 32, "") in held and held.index(made[2]) == 2 and held.count(made[0]) == 1
    assert fields.column(made, "path") == ["a/b", "c", "d"]
    for odd in (columns[:3], (*columns[:3], ["5" * 64])):
        with pytest.raises(ValueError, match="one column per field"):
            fields.Columns(FileEntry, *odd)
    release_held = release(files=held)
    assert to_json(release_held) == to_json(release(files=made)) and release_held.total_size == 10


@settings(max_examples=300)
@given(st.lists(st.lists(st.sampled_from(["a", "A", "b", "é", "É", "c.d"]), min_size=1, max_size=3).map("/".join)))
def test_distinct_paths_decided_by_sets_says_what_the_entry_walk_says(paths: list[str]) -> None:
    files = tuple(FileEntry(path=p, size=1, digest=DIGEST) for p in paths)
    assert fields.distinct_paths(files) == fields._why_not_distinct(files)


def test_a_list_of_strings_decodes_at_once_with_the_same_verdicts() -> None:
    """tuple[str, ...] fields (a unit's 10,000s of paths in the cache state) are taken whole
    when every item is an ASCII str; anything else is decoded item by item, naming the item."""
    from neffbuild.documents.records import SharedPath, decode_doc

    ok = decode_doc(SharedPath, {"path": "a/b", "kept": DIGEST, "dropped": ["x", "é", "y"]}, "d")
    assert ok.dropped == ("x", "é", "y") and type(ok.dropped) is tuple
    for dropped, problem in (
        (["x", 1], "dropped.1: expected str, got int"),
        (["x", "\ud800"], "dropped.1: "),
        (["x", True], "dropped.1: expected str, got bool"),
    ):
        with pytest.raises(IntegrityError, match=problem):
            decode_doc(SharedPath, {"path": "a/b", "kept": DIGEST, "dropped": dropped}, "d")


@dataclasses.dataclass(frozen=True, slots=True)
class _Table:
    table: dict[str, object]


def test_a_table_of_json_values_decodes_at_once_with_the_same_verdicts() -> None:
    """dict[str, object] fields (a cache state's 10,000-entry file table) are taken whole where
    every key is ASCII; a key with a lone surrogate is still refused, naming it."""
    from neffbuild.documents.records import decode_doc

    table = {"a/b": [1, 2, "x"], "c": None}
    ok = decode_doc(_Table, {"table": table}, "d")
    assert ok.table == table and ok.table is not table
    assert decode_doc(_Table, {"table": {"é": 1}}, "d").table == {"é": 1}
    with pytest.raises(IntegrityError, match=r"table\.'a\\ud800': 'a\\ud800' holds a lone surrogate"):
        decode_doc(_Table, {"table": {"b": 1, "a\ud800": 2}}, "d")
    with pytest.raises(IntegrityError, match="table: expected an object, got list"):
        decode_doc(_Table, {"table": [1]}, "d")
