"""A host with trusted keys: signed, fresh, never older releases, refused before anything is
written. Every tamper below is refused with its own message and leaves the cache dir
byte-identical (each test first installs a good release, then snapshots the dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from neffbuild.build.publish import move_tag, publish_release
from neffbuild.build.sign import sign_release
from neffbuild.documents.records import FileEntry, Release, TagRecord, dump, parse
from neffbuild.documents.signing import (
    Signing,
    SigningKey,
    generate_key,
    read_public_key,
    read_signing_key,
    write_key_pair,
)
from neffbuild.errors import IntegrityError, TrustError
from neffbuild.hashing import blake3_bytes, hash_bytes
from neffbuild.host.cachedir import CacheDir
from neffbuild.host.pull import pull
from neffbuild.host.state import CacheState
from neffbuild.host.trust import Trust, trust_from
from neffbuild.store.local import LocalStore
from tests.storekit import publish_release_of, write_files

NOW = datetime.now(UTC)


def fresh(key: SigningKey, days: int = 7) -> Signing:
    return Signing(key, NOW + timedelta(days=days))


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry below root: (mode, bytes of a file)."""
    seen = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        seen[path.relative_to(root).as_posix()] = (st.st_mode, path.read_bytes() if path.is_file() else None)
    return seen


def overwrite(path: Path, data: bytes) -> None:
    """What someone who can write the store does (objects are read-only files)."""
    path.chmod(0o644)
    path.write_bytes(data)


class Fleet:
    """A store with release `one` signed by ci.example-1 and tagged prod (version 1), and a
    cache dir it is installed in (by a pull that trusted that key)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store = LocalStore(tmp / "store", create=True)
        self.src = tmp / "src"
        self.sources = write_files(self.src, {"a/x.so": 3000, "a/y.so": 70_000, "b.neff": 1 << 20}, seed=1)
        self.one = publish_release_of(self.store, self.src, self.sources, name="m")
        self.key = generate_key("ci.example-1")
        (tmp / "keys").mkdir()
        self.pub = write_key_pair(self.key, tmp / "keys" / "ci.example-1")
        move_tag(self.store, "prod", self.one, signing=fresh(self.key))
        self.trust = Trust((read_public_key(self.pub),))
        self.cache = tmp / "cache"
        report = pull(self.store, "prod", self.cache, trust=self.trust)
        assert (report.signed_by, report.tag_signed_by) == ("ci.example-1", "ci.example-1")
        # A tag's signed version is the clock (milliseconds since the epoch), or one above the last.
        assert report.tag_version is not None and report.tag_version >= int(NOW.timestamp() * 1000)
        self.v1 = report.tag_version
        self.before = snapshot(self.cache)

    def release(self, release_id: str) -> Release:
        return parse(Release, self.store.get_doc("releases", release_id) or b"", "r")

    def variant(self, files: tuple[FileEntry, ...]) -> str:
        """Another release of the same bundle, with these files (published, unsigned)."""
        one = self.release(self.one)
        return publish_release(self.store, Release(**{**_fields(one), "files": files, "name": "m2"}))

    def refused(self, error: type[Exception], match: str, ref: str | None = "prod", **changes) -> None:
        with pytest.raises(error, match=match):
            pull(self.store, ref, self.cache, trust=changes.pop("trust", self.trust), **changes)
        assert snapshot(self.cache) == self.before, "a refused pull changed the cache dir"


def _state(cache: Path) -> CacheState:
    """What the cache dir's state records, read as a command reads it."""
    with CacheDir.opened(cache) as opened:
        return opened.read_state()[1]


def _fields(doc: Release) -> dict:
    return {name: getattr(doc, name) for name in doc.__slots__}


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return Fleet(tmp_path)


def test_keys_are_nix_style_files_and_the_private_one_is_private(fleet: Fleet) -> None:
    private = fleet.tmp / "keys" / "ci.example-1"
    assert private.stat().st_mode & 0o777 == 0o600
    assert private.read_text().startswith("ci.example-1:") and fleet.pub.read_text().startswith("ci.example-1:")
    assert read_signing_key(private) == fleet.key
    with pytest.raises(Exception, match="already exists"):
        write_key_pair(generate_key("ci.example-1"), private)


def test_the_release_signature_is_an_in_toto_statement_in_dsse(fleet: Fleet) -> None:
    import base64

    envelope = json.loads((fleet.store.root / f"signatures/{fleet.one}.ci.example-1.json").read_bytes())
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    assert envelope["signatures"][0]["keyid"] == "ci.example-1"
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    data = fleet.store.get_doc("releases", fleet.one) or b""
    assert statement["subject"] == [{"name": fleet.one, "digest": {"blake3": blake3_bytes(data)}}]
    resources = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert resources == {f.path: f.blake3 for f in fleet.release(fleet.one).files}
    assert hash_bytes(data) == fleet.one  # signing left the release (and its id) as it was


def test_state_records_the_accepted_version_and_a_no_op_pull_stays_a_no_op(fleet: Fleet) -> None:
    assert _state(fleet.cache).accepted == {"prod": fleet.v1}
    pull(fleet.store, "prod", fleet.cache, trust=fleet.trust)
    assert snapshot(fleet.cache) == fleet.before


def test_a_tampered_release_is_refused(fleet: Fleet) -> None:
    # The same document in other bytes: its XXH3 id still matches (it re-encodes to it), its BLAKE3 does not.
    path = fleet.store.root / f"releases/{fleet.one}.json"
    overwrite(path, json.dumps(json.loads(path.read_bytes()), indent=1).encode())
    fleet.refused(TrustError, "its BLAKE3 is not the one tag 'prod''s signed statement names")
    fleet.refused(TrustError, "the release signature vouches for .* not these bytes", None, trust=_pinned(fleet))


def _pinned(fleet: Fleet, release_id: str | None = None) -> Trust:
    return Trust(fleet.trust.keys, pin=release_id or fleet.one)


def test_a_tampered_bundle_is_refused(fleet: Fleet) -> None:
    unit = fleet.release(fleet.one).units[0]
    path = fleet.store.root / f"bundles/{unit.key}.json"
    doc = json.loads(path.read_bytes())
    doc["fingerprint"]["torch"] = "9.9.9"  # the key (its name) kept, what a host check reads changed
    overwrite(path, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    fleet.refused(TrustError, f"the bundle of {unit.unit_id} is not the one signed")


def test_a_blob_whose_xxh3_matches_but_blake3_does_not_is_refused_while_written(fleet: Fleet) -> None:
    # An XXH3 collision, as the pull sees one: the signed release lists for b.neff the XXH3 of the
    # bytes the store serves but the BLAKE3 of the bytes CI built.
    one = fleet.release(fleet.one)
    forged = bytes(b ^ 0xFF for b in (fleet.src / "b.neff").read_bytes())
    (fleet.tmp / "forged").write_bytes(forged)
    fleet.store.put_blob(hash_bytes(forged), fleet.tmp / "forged")
    files = tuple(
        FileEntry(f.path, f.size, hash_bytes(forged), f.blake3) if f.path == "b.neff" else f for f in one.files
    )
    two = fleet.variant(files)
    move_tag(fleet.store, "prod", two, signing=fresh(fleet.key))
    fleet.refused(IntegrityError, f"has the release's xxh3 {hash_bytes(forged)} but blake3 {blake3_bytes(forged)}")
    # Nothing was recorded: the tag's version 2 was not accepted.
    assert _state(fleet.cache).accepted == {"prod": fleet.v1}


def test_a_tampered_signature_is_refused(fleet: Fleet) -> None:
    path = fleet.store.root / f"signatures/{fleet.one}.ci.example-1.json"
    envelope = json.loads(path.read_bytes())
    sig = bytearray(__import__("base64").b64decode(envelope["signatures"][0]["sig"]))
    sig[0] ^= 1
    envelope["signatures"][0]["sig"] = __import__("base64").b64encode(bytes(sig)).decode()
    overwrite(path, json.dumps(envelope).encode())
    fleet.refused(TrustError, "signature by 'ci.example-1' does not verify with the trusted key of that name")


def test_a_tampered_tag_statement_is_refused(fleet: Fleet) -> None:
    # Someone who can write tags points prod at another (even a signed) release, keeping the statement.
    two = fleet.variant(fleet.release(fleet.one).files[:2])
    sign_release(fleet.store, two, fleet.key)
    current = fleet.store.read_tag("prod")
    assert current is not None
    tag = parse(TagRecord, current[0], "t")
    forged = TagRecord(tag.name, two, tag.history, tag.format, tag.statement)
    assert fleet.store.swap_tag("prod", dump(forged), current[1])
    fleet.refused(TrustError, f"points at {two}, but its signed statement says tag 'prod' -> {fleet.one}")


def test_a_wrong_key_is_refused_naming_the_keys_expected_and_found(fleet: Fleet) -> None:
    other = generate_key("ci.other-1")
    fleet.refused(
        TrustError, "signed by 'ci.example-1', none of them trusted \\(trusted: 'ci.other-1'\\)",
        trust=Trust((other.public,)),
    )  # fmt: skip
    fleet.refused(
        TrustError, f"release {fleet.one} is signed by 'ci.example-1', none of them trusted",
        trust=Trust((other.public,), pin=fleet.one),
    )  # fmt: skip
    # A key of the trusted name that is not the trusted key: its signatures do not verify.
    impostor = generate_key("ci.example-1")
    move_tag(fleet.store, "prod", fleet.one, signing=fresh(impostor))
    fleet.refused(TrustError, "does not verify with the trusted key of that name")


def test_a_missing_signature_is_refused_when_keys_are_trusted(fleet: Fleet) -> None:
    two = fleet.variant(fleet.release(fleet.one).files[:2])
    fleet.refused(
        TrustError, f"release {two} in .* is not signed \\(trusted keys: 'ci.example-1'\\)", trust=_pinned(fleet, two)
    )
    move_tag(fleet.store, "prod", two)  # an unsigned move
    fleet.refused(TrustError, "tag 'prod' has no signed statement")


def test_an_expired_tag_statement_is_refused(fleet: Fleet) -> None:
    move_tag(fleet.store, "prod", fleet.one, signing=Signing(fleet.key, NOW - timedelta(minutes=1)))
    fleet.refused(TrustError, "the signed statement of tag 'prod' expired at")


def test_a_lower_version_after_a_higher_one_is_refused(fleet: Fleet) -> None:
    old = fleet.store.read_tag("prod")
    assert old is not None
    two = fleet.variant(fleet.release(fleet.one).files[:2])
    move_tag(fleet.store, "prod", two, signing=fresh(fleet.key))
    report = pull(fleet.store, "prod", fleet.cache, trust=fleet.trust)
    v2 = report.tag_version
    assert report.release_id == two and v2 is not None and v2 > fleet.v1
    assert _state(fleet.cache).accepted == {"prod": v2}
    fleet.before = snapshot(fleet.cache)
    # The tag writer restores the old, validly signed and unexpired, statement: a rollback.
    now = fleet.store.read_tag("prod")
    assert now is not None and fleet.store.swap_tag("prod", old[0], now[1])
    fleet.refused(
        TrustError,
        f"statement version {fleet.v1} is lower than {v2}, the highest this cache dir accepted: a rollback",
    )


def test_rotation_with_two_trusted_keys(fleet: Fleet) -> None:
    new = generate_key("ci.example-2")
    new_pub = write_key_pair(new, fleet.tmp / "keys" / "ci.example-2")
    both = trust_from([], {"NEFFBUILD_TRUSTED_KEYS": f"{fleet.pub},{new_pub}"})
    assert both is not None
    two = fleet.variant(fleet.release(fleet.one).files[:2])
    move_tag(fleet.store, "prod", two, signing=fresh(new))
    report = pull(fleet.store, "prod", fleet.cache, trust=both)
    # The new key cannot verify the old key's statement: its version comes from the clock, not below it.
    assert (report.release_id, report.signed_by) == (two, "ci.example-2") and report.tag_version >= fleet.v1
    # The old key's release still serves while both are trusted; once retired, only the new one.
    assert pull(fleet.store, None, fleet.cache, trust=Trust(both.keys, pin=fleet.one)).signed_by == "ci.example-1"
    fleet.before = snapshot(fleet.cache)
    fleet.refused(
        TrustError, "signed by 'ci.example-1', none of them trusted", None, trust=Trust(both.keys[1:], pin=fleet.one)
    )


def test_a_pinned_release_skips_the_tag(fleet: Fleet) -> None:
    move_tag(fleet.store, "prod", fleet.one, signing=Signing(fleet.key, NOW - timedelta(minutes=1)))  # expired
    two = fleet.variant(fleet.release(fleet.one).files[:2])
    sign_release(fleet.store, two, fleet.key)
    report = pull(fleet.store, None, fleet.cache, trust=_pinned(fleet, two))
    assert (report.release_id, report.tag, report.tag_version, report.signed_by) == (two, None, None, "ci.example-1")
    assert _state(fleet.cache).accepted == {"prod": fleet.v1}  # no tag read, none recorded


def test_without_trusted_keys_nothing_changes(fleet: Fleet) -> None:
    move_tag(fleet.store, "plain", fleet.one)
    report = pull(fleet.store, "plain", fleet.cache)
    assert report.signed_by is None and report.files_fetched == 0


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "neffbuild", *args], capture_output=True, text=True, env=full, check=False
    )


def test_cli_keygen_sign_pull_status_and_refusals(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    release_id = publish_release_of(store, tmp_path / "src", write_files(tmp_path / "src", {"a.so": 100}), name="m")
    made = _cli("keygen", "ci.example-1", str(tmp_path / "ci.key"))
    assert made.returncode == 0, made.stderr
    signed = _cli(
        "tag", "prod", release_id, "--store", store.url, "--sign-key", str(tmp_path / "ci.key"), "--expires", "7d"
    )
    assert signed.returncode == 0, signed.stderr
    pub = str(tmp_path / "ci.key.pub")
    cache = str(tmp_path / "cache")
    pulled = _cli(
        "pull", "prod", "--store", store.url, "--cache-dir", cache, "--trusted-key", pub, "--json", "--no-host-check"
    )
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["signed_by"] == "ci.example-1"
    shown = _cli("status", "--store", store.url, "--cache-dir", cache, "--json", env={"NEFFBUILD_TRUSTED_KEYS": pub})
    signed_view = json.loads(shown.stdout)["signed"]
    assert (signed_view["signed_by"], signed_view["tag"]) == ("ci.example-1", "prod")
    assert signed_view["tag_version"] >= int(datetime.now(UTC).timestamp() * 1000) - 60_000
    assert signed_view["tag_expires"] > datetime.now(UTC).isoformat()
    # An untrusted key: exit 16, one line naming both keys, nothing written.
    _cli("keygen", "ci.other-1", str(tmp_path / "other.key"))
    before = snapshot(tmp_path / "cache")
    refused = _cli(
        "pull", "prod", "--store", store.url, "--cache-dir", cache, "--trusted-key", str(tmp_path / "other.key.pub")
    )
    assert refused.returncode == 16
    assert "signed by 'ci.example-1', none of them trusted (trusted: 'ci.other-1')" in refused.stderr
    assert snapshot(tmp_path / "cache") == before
    pinned = _cli(
        "pull",
        "--release",
        release_id,
        "--store",
        store.url,
        "--cache-dir",
        cache,
        "--trusted-key",
        pub,
        "--no-host-check",
    )
    assert pinned.returncode == 0, pinned.stderr


@pytest.mark.s3
def test_a_read_only_identity_pulls_and_is_refused_on_publish_and_tag(
    s3_url: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    # The boot reader's policy (docs/security.md): GetObject and ListBucket, nothing else.
    from neffbuild.build.push import push
    from neffbuild.store import open_store
    from tests.s3server import READER_KEY, READER_SECRET

    local = LocalStore(tmp_path / "local", create=True)
    release_id = publish_release_of(local, tmp_path / "src", write_files(tmp_path / "src", {"a.so": 5000}), name="m")
    key = generate_key("ci.example-1")
    (tmp_path / "keys").mkdir()
    pub = write_key_pair(key, tmp_path / "keys" / "ci")
    move_tag(local, "prod", release_id, signing=fresh(key))
    push("prod", local, open_store(s3_url, create=True, env=s3_env), signing=fresh(key))  # CI, as the writer
    reader = {**s3_env, "AWS_ACCESS_KEY_ID": READER_KEY, "AWS_SECRET_ACCESS_KEY": READER_SECRET}
    cache = str(tmp_path / "cache")
    pulled = _cli(
        "pull", "prod", "--store", s3_url, "--cache-dir", cache, "--trusted-key", str(pub), "--json", "--no-host-check",
        env=reader,
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["signed_by"] == "ci.example-1"
    other = publish_release_of(local, tmp_path / "src2", write_files(tmp_path / "src2", {"b.so": 10}), name="m2")
    published = _cli("push", other, "--from", str(local.root), "--to", s3_url, env=reader)
    assert published.returncode == 3, published.stderr
    assert f"{s3_url}: this identity may not write to the store (access denied" in published.stderr
    moved = _cli("tag", "canary", release_id, "--store", s3_url, env=reader)
    assert moved.returncode == 3, moved.stderr
    assert f"{s3_url}: this identity may not write to the store" in moved.stderr
    assert len(published.stderr.strip().splitlines()) <= 2 and len(moved.stderr.strip().splitlines()) <= 2


def test_ensure_cache_takes_trusted_keys_from_its_argument_or_the_environment(fleet: Fleet) -> None:
    from neffbuild.api import ensure_cache

    other = generate_key("ci.other-1")
    other_pub = write_key_pair(other, fleet.tmp / "keys" / "other")
    report = ensure_cache("prod", store=fleet.store, cache_dir=fleet.cache, trusted_keys=[fleet.pub], host_check=False)
    assert report.signed_by == "ci.example-1"
    with pytest.raises(TrustError, match="none of them trusted \\(trusted: 'ci.other-1'\\)"):
        ensure_cache("prod", store=fleet.store, cache_dir=fleet.cache, env={"NEFFBUILD_TRUSTED_KEYS": str(other_pub)})
    pinned = ensure_cache(
        "ignored",
        store=fleet.store,
        cache_dir=fleet.cache,
        trusted_keys=[fleet.pub],
        release=fleet.one,
        host_check=False,
    )
    assert (pinned.release_id, pinned.tag) == (fleet.one, None)
    assert _state(fleet.cache).accepted == {"prod": fleet.v1}


@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_trusted_keys_variable_refuses_instead_of_turning_verification_off(fleet: Fleet, value: str) -> None:
    move_tag(fleet.store, "plain", fleet.one)  # unsigned: served only if verification is off
    cache = fleet.tmp / "fresh"
    refused = _cli(
        "pull", "plain", "--store", fleet.store.url, "--cache-dir", str(cache), "--no-host-check",
        env={"NEFFBUILD_TRUSTED_KEYS": value},
    )  # fmt: skip
    assert refused.returncode == 16, refused.stderr
    assert "NEFFBUILD_TRUSTED_KEYS is set but names no public key file" in refused.stderr
    assert "hint: list the trusted public key files" in refused.stderr
    assert not cache.exists()
    from neffbuild.api import ensure_cache

    with pytest.raises(TrustError, match="names no public key file"):
        ensure_cache("plain", store=fleet.store, cache_dir=cache, env={"NEFFBUILD_TRUSTED_KEYS": value})
    # Unset, nothing changes: the host trusts whoever can write the store (docs/security.md).
    pulled = _cli("pull", "plain", "--store", fleet.store.url, "--cache-dir", str(cache), "--no-host-check")
    assert pulled.returncode == 0, pulled.stderr


def test_a_stale_boot_refuses_an_expired_tag_statement_unless_allowed(fleet: Fleet) -> None:
    """A network attacker who keeps the store unreachable cannot freeze a host past the expiry
    the signer set: the state records it, and a stale boot under trusted keys checks it."""
    import time

    # Before its expiry a stale boot goes on: shown on a second host whose statement lasts an
    # hour, so no step of this test races the short expiry below (a CLI start under load is seconds).
    lasting = fleet.tmp / "lasting"
    move_tag(fleet.store, "prod", fleet.one, signing=Signing(fleet.key, datetime.now(UTC) + timedelta(hours=1)))
    pull(fleet.store, "prod", lasting, trust=fleet.trust)
    soon = datetime.now(UTC) + timedelta(seconds=3)
    move_tag(fleet.store, "prod", fleet.one, signing=Signing(fleet.key, soon))
    report = pull(fleet.store, "prod", fleet.cache, trust=fleet.trust)
    stale = ["--store", str(fleet.tmp / "unreachable"), "--allow-stale", "--no-host-check", "--json"]
    boot = ["pull", "prod", "--cache-dir", str(fleet.cache), *stale]
    fresh_boot = _cli("pull", "prod", "--cache-dir", str(lasting), *stale, "--trusted-key", str(fleet.pub))
    assert fresh_boot.returncode == 0 and json.loads(fresh_boot.stdout)["stale"], fresh_boot.stderr
    time.sleep(max(0.0, (datetime.fromisoformat(report.tag_expires) - datetime.now(UTC)).total_seconds()) + 0.2)
    before = snapshot(fleet.cache)
    refused = _cli(*boot, "--trusted-key", str(fleet.pub))
    assert refused.returncode == 16, refused.stderr
    assert f"signed statement of tag 'prod' that the installed release was accepted under expired at {soon.isoformat(timespec='seconds')}" in refused.stderr  # fmt: skip
    assert "--allow-expired" in refused.stderr
    assert snapshot(fleet.cache) == before
    allowed = _cli(*boot, "--trusted-key", str(fleet.pub), "--allow-expired")
    assert allowed.returncode == 0 and json.loads(allowed.stdout)["stale"], allowed.stderr
    # Without trusted keys there is no statement to expire: a stale boot is as before.
    assert _cli(*boot).returncode == 0
    state = _state(fleet.cache)  # what the stale boot read
    assert state.expires == {"prod": report.tag_expires} and report.tag_expires == soon.isoformat(timespec="seconds")


def test_a_reset_tag_history_does_not_lower_the_next_signed_version(fleet: Fleet) -> None:
    """Whoever can write tags resets the tag (a short history, no statement): CI's next signed
    version must stay above what hosts accepted, or hosts refuse the legitimate release."""
    for _ in range(4):
        move_tag(fleet.store, "prod", fleet.one, signing=fresh(fleet.key))
    accepted = pull(fleet.store, "prod", fleet.cache, trust=fleet.trust).tag_version
    assert accepted is not None and accepted >= fleet.v1 + 4
    now = fleet.store.read_tag("prod")
    assert now is not None
    reset = TagRecord(name="prod", release=fleet.one, history=parse(TagRecord, now[0], "t").history[:1])
    assert fleet.store.swap_tag("prod", dump(reset), now[1])
    two = fleet.variant(fleet.release(fleet.one).files[:2])
    signed = move_tag(fleet.store, "prod", two, signing=fresh(fleet.key))
    report = pull(fleet.store, "prod", fleet.cache, trust=fleet.trust)
    assert report.release_id == two and report.tag_version is not None and report.tag_version > accepted
    assert signed.release == two


def test_a_planted_infinite_version_is_not_counted_and_the_tag_is_signed_above_it(fleet: Fleet) -> None:
    """A tag writer plants a statement (its own key) whose version is Infinity: `neffbuild tag
    --sign-key` once exited 1 on it. It is not CI's statement, so it does not count."""
    from neffbuild.documents.signing import sign_statement, tag_statement

    attacker = generate_key("ci.example-1")  # the same name, another key
    release = fleet.store.get_doc("releases", fleet.one) or b""
    statement = tag_statement("prod", fleet.one, blake3_bytes(release), 1, NOW + timedelta(days=1))
    statement["predicate"]["version"] = float("inf")
    now = fleet.store.read_tag("prod")
    assert now is not None
    planted = parse(TagRecord, now[0], "t")
    planted = TagRecord(
        name="prod", release=fleet.one, history=planted.history, format=planted.format,
        statement=sign_statement(statement, attacker),
    )  # fmt: skip
    assert b"Infinity" in __import__("base64").b64decode(planted.statement.payload)
    assert fleet.store.swap_tag("prod", dump(planted), now[1])
    key_file = fleet.tmp / "keys" / "ci.key"
    key_file.write_text(fleet.key.text() + "\n")
    key_file.chmod(0o600)
    tagged = _cli("tag", "prod", fleet.one, "--store", fleet.store.url, "--sign-key", str(key_file))
    assert tagged.returncode == 0, tagged.stderr
    report = pull(fleet.store, "prod", fleet.cache, trust=fleet.trust)
    assert report.tag_version is not None and report.tag_version > fleet.v1
