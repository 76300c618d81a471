#!/usr/bin/env bash
# Create .venv with neffbuild and what its compile side needs on these machines.
# torch is pinned here (not in pyproject) so this repo's machines take the CPU wheel on disk;
# users of the package bring their own torch (e.g. the one torch-neuronx needs).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-compile}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  "torch==2.13.0" "diffusers==0.42.1" -e ".[${extras}]"
