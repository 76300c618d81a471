"""neffbuild.ensure_cache / apply_exports: pulling in-process for serving code."""

from __future__ import annotations

import ast
import gc
import inspect
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import neffbuild
from neffbuild.errors import EnvironmentMismatch, NotFoundError, StoreError
from neffbuild.retry import Policy
from neffbuild.store.local import LocalStore
from tests.conftest import ROOT
from tests.storekit import publish_release_of, write_files


@pytest.fixture
def published(tmp_path: Path) -> tuple[str, str]:
    """(store URL, release id) of a small release tagged `prod`, built for this host."""
    url = str(tmp_path / "store")
    store = LocalStore(Path(url), create=True)
    sources = write_files(tmp_path / "src", {f"d{i}/f{i}.bin": 100 + i for i in range(12)})
    return url, publish_release_of(store, tmp_path / "src", sources, name="prod", tag="prod")


def test_ensure_cache_pulls_in_process_silently_and_leaves_the_environment_alone(
    published, tmp_path: Path, capsys
) -> None:
    url, release_id = published
    cache = tmp_path / "cache"
    environ_before, frozen_before = dict(os.environ), gc.get_freeze_count()
    report = neffbuild.ensure_cache("prod", store=url, cache_dir=cache)
    assert report.release_id == release_id and not report.stale and report.host_checked
    assert report.files_fetched == report.files_total == 12
    assert report.exports == {"TORCHINDUCTOR_CACHE_DIR": str(cache.resolve())}
    assert all((cache / f"d{i}/f{i}.bin").stat().st_size == 100 + i for i in range(12))
    assert capsys.readouterr() == ("", "")
    assert dict(os.environ) == environ_before and gc.get_freeze_count() == frozen_before

    again = neffbuild.ensure_cache("prod", store=LocalStore(Path(url)), cache_dir=str(cache))  # an open Store too
    assert again.files_fetched == 0 and again.bytes_fetched == 0 and again.exports == report.exports
    assert capsys.readouterr() == ("", "")


def test_apply_exports_sets_the_variables_into_the_given_mapping(published, tmp_path: Path) -> None:
    url, _ = published
    report = neffbuild.ensure_cache("prod", store=url, cache_dir=tmp_path / "cache")
    before, environ = dict(os.environ), {"PATH": "/bin"}
    neffbuild.apply_exports(report, environ)
    assert environ == {"PATH": "/bin", "TORCHINDUCTOR_CACHE_DIR": str((tmp_path / "cache").resolve())}
    assert dict(os.environ) == before  # only the mapping given


def test_errors_are_typed(published, tmp_path: Path) -> None:
    url, _ = published
    with pytest.raises(NotFoundError, match="nope"):
        neffbuild.ensure_cache("nope", store=url, cache_dir=tmp_path / "cache")
    with pytest.raises(StoreError):
        neffbuild.ensure_cache("prod", store=str(tmp_path / "no-store"), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_timeout_already_past_is_a_store_error_before_anything_is_written(published, tmp_path: Path) -> None:
    url, _ = published
    with pytest.raises(StoreError, match="deadline"):
        neffbuild.ensure_cache("prod", store=url, cache_dir=tmp_path / "cache", timeout=0)
    assert not (tmp_path / "cache").exists()


def test_allow_stale_keeps_the_installed_release_when_the_store_is_gone(published, tmp_path: Path) -> None:
    url, release_id = published
    cache = tmp_path / "cache"
    first = neffbuild.ensure_cache("prod", store=url, cache_dir=cache)
    os.rename(url, tmp_path / "moved")  # the store's mount is gone
    with pytest.raises(StoreError):
        neffbuild.ensure_cache("prod", store=url, cache_dir=cache)
    stale = neffbuild.ensure_cache("prod", store=url, cache_dir=cache, allow_stale=True)
    assert stale.stale and stale.release_id == release_id and stale.exports == first.exports
    assert "no neffbuild store" in (stale.stale_reason or "") and stale.installed_at
    with pytest.raises(StoreError):  # another tag than the one installed does not fall back
        neffbuild.ensure_cache("other", store=url, cache_dir=cache, allow_stale=True)
    # The host check needs no store, and a mismatch is never booted, stale or not.
    with pytest.raises(EnvironmentMismatch, match="ATEN_CPU_CAPABILITY"):
        neffbuild.ensure_cache(
            "prod", store=url, cache_dir=cache, allow_stale=True, env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}
        )


def test_past_the_deadline_falls_back_to_the_installed_release_with_allow_stale(published, tmp_path: Path) -> None:
    url, release_id = published
    cache = tmp_path / "cache"
    neffbuild.ensure_cache("prod", store=url, cache_dir=cache)
    stale = neffbuild.ensure_cache("prod", store=url, cache_dir=cache, timeout=0, allow_stale=True)
    assert stale.stale and stale.release_id == release_id and "deadline" in (stale.stale_reason or "")


def test_importing_neffbuild_imports_no_core_module() -> None:
    code = "import sys, neffbuild; print(sorted(m for m in sys.modules if m.startswith('neffbuild')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['neffbuild']"


# ---- the signature: every keyword docs/hosts.md documents, typed, and nothing else ----------------


def documented_keywords() -> dict[str, object]:
    """The keywords after cache_dir in docs/hosts.md's `ensure_cache(...)` line, with their defaults."""
    text = (ROOT / "docs" / "hosts.md").read_text()
    found = re.search(r"`ensure_cache\(ref, \*, store, cache_dir, ([^`]*)\)`", text)
    assert found, "docs/hosts.md no longer shows ensure_cache's signature"
    call = ast.parse(f"f({found.group(1)})", mode="eval").body
    assert isinstance(call, ast.Call)
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}


def test_every_documented_keyword_is_an_option_with_its_documented_default() -> None:
    from neffbuild.api import EnsureCacheOptions, _Ensure

    documented = documented_keywords()
    assert set(documented) == {
        "timeout", "allow_stale", "allow_expired", "host_check", "env", "verify", "allow_env", "policy", "trusted_keys", "release"
    }  # fmt: skip
    assert set(EnsureCacheOptions.__optional_keys__) == set(documented) and not EnsureCacheOptions.__required_keys__
    assert {f.name: f.default for f in fields(_Ensure)} == documented
    explicit = inspect.signature(neffbuild.ensure_cache).parameters
    assert [(p.name, p.kind) for p in explicit.values()] == [
        ("ref", inspect.Parameter.POSITIONAL_OR_KEYWORD), ("store", inspect.Parameter.KEYWORD_ONLY),
        ("cache_dir", inspect.Parameter.KEYWORD_ONLY), ("options", inspect.Parameter.VAR_KEYWORD),
    ]  # fmt: skip


def test_every_documented_keyword_still_works(published, tmp_path: Path) -> None:
    url, release_id = published
    cache = tmp_path / "cache"
    for name, default in documented_keywords().items():  # each alone, at its documented default
        report = neffbuild.ensure_cache("prod", store=url, cache_dir=cache, **{name: default})
        assert report.release_id == release_id and not report.stale
    report = neffbuild.ensure_cache(  # all at once, none at its default
        ref="prod", store=LocalStore(Path(url)), cache_dir=str(cache), timeout=60.0, allow_stale=True,
        host_check=False, env=dict(os.environ), verify="full", allow_env=("NEFFBUILD_TEST_VAR",), policy=Policy(attempts=2),
    )  # fmt: skip
    assert report.release_id == release_id and not report.host_checked and report.files_fetched == 0
    assert "NEFFBUILD_TEST_VAR" in report.allowed
    with pytest.raises(ValueError, match="verify must be one of"):  # values are still checked where they were
        neffbuild.ensure_cache("prod", store=url, cache_dir=cache, verify="sometimes")  # type: ignore[typeddict-item]


def test_an_unknown_keyword_is_a_type_error_naming_the_closest_one(published, tmp_path: Path) -> None:
    url, _ = published
    with pytest.raises(TypeError, match=r"^ensure_cache\(\) got an unexpected keyword argument 'alow_stale' \(did you mean 'allow_stale'\?\)$"):  # fmt: skip
        neffbuild.ensure_cache("prod", store=url, cache_dir=tmp_path / "cache", alow_stale=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        neffbuild.ensure_cache("prod", store=url, cache_dir=tmp_path / "cache", zzz=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):  # the store and the cache dir stay keyword-only
        neffbuild.ensure_cache("prod", url, tmp_path / "cache")  # type: ignore[misc]
    assert not (tmp_path / "cache").exists()
