"""neffbuild.serve.guard on a small real compile (a Linear through the same call wrapper prepare
puts around a component): events for compiles while installed, none after; fail mode refuses
before compiling and restores the stance; bad arguments fail at start-up in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neffbuild.backends.components import recorded
from neffbuild.errors import DiskError, InputError, UnlistedShape
from neffbuild.serve import guard
from neffbuild.serve.guard import call_size


@pytest.fixture
def linear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    compiled = recorded("transformer", torch.compile(torch.nn.Linear(4, 4), fullgraph=True, dynamic=False))
    compiled(torch.randn(2, 4))  # the warm-up: compiled before any guard
    yield compiled
    torch._dynamo.reset()


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_record_appends_one_event_per_compile_while_installed(linear, tiny_manifest: Path, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    with guard(tiny_manifest, mode="record", events=events):
        linear(torch.randn(2, 4))  # a hit: no event
        assert _events(events) == []
        linear(torch.randn(3, 4))
    linear(torch.randn(5, 4))  # uninstalled: not recorded
    [event] = _events(events)
    assert event["component"] == "transformer" and event["inputs"] == ["float32[3, 4]"]
    assert event["entry"] == "klein" and event["mode"] == "record" and event["neffbuild_event"] == 1
    assert event["compile_s"] > 0 and event["counters"].get("stats.unique_graphs", 0) >= 1
    assert event["call"] == {}  # no pipeline call around it
    assert event["fingerprint"]["backend"] == "inductor"


def test_fail_refuses_before_compiling_and_uninstall_restores_the_stance(
    linear, tiny_manifest: Path, tmp_path: Path
) -> None:
    events = tmp_path / "events.jsonl"
    with guard(tiny_manifest, mode="fail", events=events):
        linear(torch.randn(2, 4))  # compiled during warm-up: served
        with pytest.raises(UnlistedShape, match=r"transformer of model\[klein\] at an unrecovered size") as caught:
            linear(torch.randn(7, 4))
    assert caught.value.exit_code == 17 and "128x128x1, 128x256x1" in str(caught.value)
    [event] = _events(events)
    assert event["refused"] is True and event["compiles"] == 0 and event["inputs"] == ["float32[7, 4]"]
    assert torch._dynamo.eval_frame._stance.stance == "default"
    linear(torch.randn(7, 4))  # compiles again once the guard is gone


def test_the_call_size_is_read_from_the_pipelines_call_frame(tiny_manifest: Path) -> None:
    from neffbuild.documents.manifest import load_manifest

    entry = load_manifest(tiny_manifest).manifest.models[0]

    class Flux2KleinPipeline:  # the entry's pipeline class, by name
        def __call__(self, height=None, width=None, num_images_per_prompt=1):
            height = height or 1024  # diffusers resolves its defaults into locals
            return (lambda: call_size(entry))()

    assert Flux2KleinPipeline()(width=256, num_images_per_prompt=2) == {"height": 1024, "width": 256, "batch": 2}
    assert call_size(entry) == {}


def test_bad_mode_and_unwritable_events_fail_at_start_up(tiny_manifest: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="guard mode 'strict' is not one of record, warn, fail"):
        guard(tiny_manifest, mode="strict")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"guard mode 'record' needs events=PATH"):
        guard(tiny_manifest)
    with pytest.raises(DiskError, match=r"events file .*/missing/events.jsonl: No such file or directory"):
        guard(tiny_manifest, events=tmp_path / "missing" / "events.jsonl")


def test_warn_logs_one_line_per_compile_and_records_it(
    linear, tiny_manifest: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events = tmp_path / "events.jsonl"
    with caplog.at_level("WARNING", logger="neffbuild.serve.guard"), guard(tiny_manifest, mode="warn", events=events):
        linear(torch.randn(2, 4))
        linear(torch.randn(6, 4))
    [record] = [r for r in caplog.records if r.name == "neffbuild.serve.guard"]
    assert record.getMessage().startswith("compiled while serving: transformer of model[klein] at an unrecovered size")
    assert "float32[6, 4]" in record.getMessage()
    assert [e["mode"] for e in _events(events)] == ["warn"]


def test_a_call_no_package_covers_is_one_refused_event_in_every_mode(tiny_manifest: Path, tmp_path: Path) -> None:
    # The real loader prepare installs for artifact 'package' (a Linear stands in for the loaded
    # package: test_artifacts.py serves real ones under the guard).
    from neffbuild.backends.artifacts import PackageLoader, signature_digest
    from neffbuild.documents.manifest import load_manifest

    entry = load_manifest(tiny_manifest).manifest.models[0]
    served = torch.randn(2, 4)
    runners = {signature_digest((served,), {}): torch.nn.Linear(4, 4)}
    loader = recorded("transformer", PackageLoader(entry, "transformer", runners))
    for mode in ("record", "warn", "fail"):
        events = tmp_path / f"{mode}.jsonl"
        with guard(tiny_manifest, mode=mode, events=events):
            loader(served)  # a package serves it: a hit, no event
            with pytest.raises(UnlistedShape, match=r"transformer of model\[klein\] .*no AOTInductor package"):
                loader(torch.randn(3, 4))
        with pytest.raises(UnlistedShape):
            loader(torch.randn(3, 4))  # uninstalled: refused all the same, not recorded
        [event] = _events(events)
        assert event["refused"] is True and event["artifact"] == "package" and event["mode"] == mode
        assert event["component"] == "transformer" and event["inputs"] == ["float32[3, 4]"] and event["compiles"] == 0
