#!/usr/bin/env bash
# The main job on the embedded default (a local directory store, no server):
# make the tiny pipeline, build the tiny manifest, pull it into a fresh cache dir at another
# path, replay it with zero compiles, and print cold vs warm time to first image per shape.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh compile
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
nb=".venv/bin/neffbuild"
demo=".neffbuild/demo"
rm -rf "$demo" && mkdir -p "$demo"

echo "== 1. the tiny FLUX.2-klein pipeline (random weights, made offline)"
.venv/bin/python scripts/make_tiny_pipeline.py .neffbuild/models/tiny-flux2-klein

echo "== 2. plan"
$nb plan manifests/tiny-flux2-klein.toml

echo "== 3. build: warmup-compile every shape in a fresh process and cache dir, publish"
$nb build manifests/tiny-flux2-klein.toml --store "$demo/store" --json > "$demo/build.json"

echo "== 4. pull into a new cache dir at another path (a fresh host would do this at boot)"
$nb pull tiny-flux2-klein --store "$demo/store" --cache-dir "$demo/host-b/cache" | tee "$demo/env.sh"

echo "== 5. replay every shape in a fresh process against the pulled cache"
status=0
$nb verify manifests/tiny-flux2-klein.toml --cache-dir "$demo/host-b/cache" --replay --json > "$demo/replay.json" || status=$?

.venv/bin/python scripts/demo_summary.py "$demo/build.json" "$demo/replay.json"
exit $status
