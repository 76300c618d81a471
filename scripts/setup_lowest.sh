#!/usr/bin/env bash
# .venv-lowest: neffbuild with exactly the lowest versions it declares (core + s3, no torch), for
# tests/test_dependencies.py. The index may lack a floor's exact wheel: then this fails, loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pins=$("$PY" scripts/lower_bounds.py)
if [ ! -x .venv-lowest/bin/python ]; then
  "$PY" -m venv .venv-lowest
fi
# shellcheck disable=SC2086  # one pin per word
.venv-lowest/bin/python -m pip install --quiet --disable-pip-version-check $pins
.venv-lowest/bin/python -m pip install --quiet --disable-pip-version-check --no-deps .
