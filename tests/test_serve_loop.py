"""The serve-time loop on real components: a release of one shape pulled, warmed up and served
under the guard in a fresh process; a request at an unlisted shape recorded; `suggest` turns the
event into the manifest that covers it; a rebuilt release replays both shapes with 0 compiles.

Shares the session's real build (conftest `built`: its first release holds one shape, its second
both): the one compile here is the serving process's, for the unlisted shape, and one more for the
warm-up that must fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_manifest

pytestmark = pytest.mark.slow

# A server as the README writes one: exports first, then prepare, warmup, guard.
SERVER = r"""
import json, os, sys
exports, manifest, model, events, ready = sys.argv[1:6]
os.environ.update(json.loads(exports))
import torch, diffusers
import neffbuild.serve as serve
from neffbuild.errors import UnlistedShape

pipe = diffusers.Flux2KleinPipeline.from_pretrained(model, torch_dtype=torch.float32)
pipe = serve.prepare(pipe, manifest)
report = serve.warmup(pipe, manifest, readiness_file=ready)
out = {"warmup": [[s.shape, s.compiles] for s in report.shapes], "ready": os.path.exists(ready)}

def call(width):
    with torch.inference_mode():
        pipe(prompt="a photo of a cat", height=128, width=width, num_inference_steps=2, max_sequence_length=64,
             text_encoder_out_layers=[1], output_type="pt")

def lines():
    return sum(1 for line in open(events) if line.strip())

with serve.guard(manifest, mode="record", events=events, pipe=pipe):
    call(128)
    out["events_after_listed"] = lines()
    call(256)
    out["events_after_unlisted"] = lines()
with serve.guard(manifest, mode="fail", events=events, pipe=pipe):
    call(256)  # compiled a moment ago in this process: nothing to refuse
    try:
        call(192)
        out["refused"] = None
    except UnlistedShape as exc:
        out["refused"] = str(exc)
out["events_at_end"] = lines()
print("RESULT " + json.dumps(out))
"""


def _exports(cli, cache: Path) -> dict[str, str]:
    result = cli("env", "--cache-dir", str(cache), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _pull(cli, store: Path, ref: str, cache: Path) -> None:
    result = cli("pull", ref, "--store", str(store), "--cache-dir", str(cache), "--json")
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def served(built, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, cli) -> dict:
    """The one-shape release pulled and served by a fresh process under the guard."""
    root = tmp_path_factory.mktemp("serve-loop")
    manifest = write_manifest(root / "one-shape.toml", tiny_model, widths=(128,))
    cache = root / "cache"
    _pull(cli, built.path, built.first_build["release_id"], cache)
    events, ready = root / "events.jsonl", root / "ready.json"
    args = [json.dumps(_exports(cli, cache)), str(manifest), str(tiny_model), str(events), str(ready)]
    run = subprocess.run(
        [sys.executable, "-c", SERVER, *args], capture_output=True, text=True, cwd=ROOT, env={**os.environ}
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {"result": result, "manifest": manifest, "events": events, "cache": cache, "root": root}


def test_warmup_passes_and_the_guard_records_only_the_unlisted_shape(served: dict) -> None:
    result = served["result"]
    assert result["warmup"] == [["128x128x1", 0]]
    assert result["ready"] is True
    assert result["events_after_listed"] == 0
    assert result["events_after_unlisted"] == 1
    [event] = [json.loads(line) for line in served["events"].read_text().splitlines()[:1]]
    assert event["call"] == {"height": 128, "width": 256, "batch": 1}
    assert event["component"] == "transformer" and event["entry"] == "klein" and event["mode"] == "record"
    assert event["compiles"] > 0 and event["compile_s"] > 0
    assert event["inputs"] and event["fingerprint"]["torch"]


def test_fail_mode_refuses_an_unlisted_shape_before_compiling_and_names_it(served: dict) -> None:
    result = served["result"]
    refused = result["refused"]
    assert refused and "128x192x1" in refused and "model[klein]" in refused and "128x128x1" in refused
    # the refusal is recorded too, as a compile that never ran
    last = json.loads(served["events"].read_text().splitlines()[-1])
    assert last["refused"] is True and last["call"]["width"] == 192 and last["compiles"] == 0
    assert result["events_at_end"] == 2


def test_suggest_covers_the_event_and_the_rebuilt_release_replays_both_shapes(
    served: dict, built, tmp_path: Path, cli
) -> None:
    manifest = tmp_path / "suggested.toml"
    manifest.write_text(served["manifest"].read_text())
    recorded = tmp_path / "record.jsonl"  # the record-mode event only: the refused 192 is another test's
    recorded.write_text(served["events"].read_text().splitlines()[0] + "\n")
    result = cli("suggest", str(manifest), str(recorded), "--write")
    assert result.returncode == 0, result.stderr
    plan = cli("plan", str(manifest), "--json")
    assert plan.returncode == 0, plan.stderr
    labels = sorted(u["unit_id"] for u in json.loads(plan.stdout)["units"])
    assert labels == ["klein/128x128x1", "klein/128x256x1"]
    # Into a copy: the shared store's tag history is other tests' (both workers read it).
    store = tmp_path / "store"
    shutil.copytree(built.path, store)
    build = cli("build", str(manifest), "--store", str(store), "--json")
    assert build.returncode == 0, build.stderr
    cache = tmp_path / "cache"
    _pull(cli, store, json.loads(build.stdout)["release_id"], cache)
    replay = cli("verify", str(manifest), "--cache-dir", str(cache), "--replay", "--json")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    report = json.loads(replay.stdout)
    assert report["misses"] == 0 and len(report["units"]) == 2
    ready = tmp_path / "ready.json"  # and the script-less readiness check passes on it
    warm = cli("warmup", str(manifest), "--cache-dir", str(cache), "--readiness-file", str(ready), "--json")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    [entry] = json.loads(warm.stdout)["entries"]
    assert [(s["shape"], s["compiles"]) for s in entry["shapes"]] == [("128x128x1", 0), ("128x256x1", 0)]
    assert json.loads(ready.read_text())["entries"][0]["ok"] is True


def test_warmup_against_a_cache_dir_missing_a_shape_fails_naming_it(
    built, tiny_model: Path, tmp_path: Path, cli
) -> None:
    two = write_manifest(tmp_path / "two-shapes.toml", tiny_model)
    cache = tmp_path / "cache"  # the one-shape release: 128x256x1's files are not in it
    _pull(cli, built.path, built.first_build["release_id"], cache)
    ready = tmp_path / "ready.json"
    ready.write_text("{}")  # a readiness file from an earlier start must not survive a failed warm-up
    result = cli("warmup", str(two), "--cache-dir", str(cache), "--readiness-file", str(ready))
    assert result.returncode == 6, result.stdout + result.stderr
    assert "128x256x1" in result.stderr and "128x128x1" not in result.stderr.split("compiled at", 1)[1]
    assert not ready.exists()
