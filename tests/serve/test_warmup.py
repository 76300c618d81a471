"""`neffbuild warmup`'s refusals before anything loads (the passing and failing warm-ups on real
compiles are tests/test_serve_loop.py)."""

from __future__ import annotations

from pathlib import Path


def test_a_cache_dir_with_no_pulled_release_is_refused_naming_it(tiny_manifest: Path, tmp_path: Path, cli) -> None:
    ready = tmp_path / "ready.json"
    ready.write_text("{}")
    result = cli("warmup", str(tiny_manifest), "--cache-dir", str(tmp_path), "--readiness-file", str(ready))
    assert result.returncode == 8, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {tmp_path}: no installed release recorded (never pulled, or pulled by an older neffbuild)",
        f"hint: pull a release into it first: neffbuild pull TAG --cache-dir {tmp_path}",
    ]
    assert not ready.exists()  # a readiness file from an earlier start never outlives a failed warm-up


def test_an_unknown_entry_is_refused_listing_the_entries(tiny_manifest: Path, tmp_path: Path, cli) -> None:
    result = cli("warmup", str(tiny_manifest), "--cache-dir", str(tmp_path), "--entry", "zzz")
    assert result.returncode == 2
    assert "no entry 'zzz'" in result.stderr and "its entries: klein" in result.stderr
