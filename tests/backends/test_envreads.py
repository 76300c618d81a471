"""The worker's record of what the compiler read from the environment, in a real interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from neffbuild.backends.envreads import UNSET, host_differences, not_keyed, value_digest

SCRIPT = """
import json, os, subprocess, sys
from neffbuild.backends import envreads
recorder = envreads.install()
assert envreads.install() is recorder and envreads.recorder() is recorder
dict(os.environ); {**os.environ}; list(os.environ.items()); os.environ.copy()  # copies read no setting
copied = set(recorder.read)
os.getenv("CI"); "FOO_UNSET" in os.environ; os.environ["SECRET_SETTING"]; os.environ.get("X", "d")
os.environ["WRITTEN"] = "1"  # a write reaches the real environment (children see it)
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['WRITTEN'])"], capture_output=True, text=True)
print(json.dumps({"copied": sorted(copied), "recorded": recorder.recorded(), "child": child.stdout.strip()}))
"""


def test_reads_are_recorded_by_name_with_a_digest_and_copies_are_not() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FOO_UNSET", "X")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
        env={**env, "SECRET_SETTING": "hunter2"},
    )  # fmt: skip
    got = json.loads(out.stdout)
    assert got["copied"] == [] and got["child"] == "1"
    assert got["recorded"] == {
        "CI": UNSET, "FOO_UNSET": UNSET, "SECRET_SETTING": value_digest("SECRET_SETTING", "hunter2"), "X": UNSET,
    }  # fmt: skip
    assert "hunter2" not in out.stdout


def test_a_host_is_compared_on_exactly_the_recorded_names() -> None:
    recorded = {"CI": UNSET, "AOT_PARTITIONER_DEBUG": value_digest("AOT_PARTITIONER_DEBUG", "1"), "HOME": UNSET}
    assert host_differences(recorded, {"AOT_PARTITIONER_DEBUG": "1", "HOME": "/root", "OTHER": "x"}) == []
    assert host_differences(recorded, {"CI": "true"}) == [
        ("AOT_PARTITIONER_DEBUG", recorded["AOT_PARTITIONER_DEBUG"], None),
        ("CI", UNSET, "true"),
    ]
    assert host_differences(recorded, {"CI": "", "AOT_PARTITIONER_DEBUG": "2"})[0][2] == "2"
    assert not_keyed("HOME") and not_keyed("NEFFBUILD_STORE") and not_keyed("CI") is None


def test_the_compile_pools_settings_reach_no_key_of_the_compiler_nor_of_status() -> None:
    """How many processes Inductor compiles in, and how it starts them, are left out of its own
    cache key: the config hashes a real torch computes agree, and status compares neither."""
    code = "import json; from neffbuild.backends.envreads import compiler_config_hashes as h; print(json.dumps(h()))"
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    seen = []
    for threads, start in (("1", "subprocess"), ("2", "fork")):
        env = {**base, "TORCHINDUCTOR_COMPILE_THREADS": threads, "TORCHINDUCTOR_WORKER_START": start}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert seen[0] == seen[1] and "torch._inductor.config:save_config_portable" in seen[0], seen
    recorded = {"TORCHINDUCTOR_COMPILE_THREADS": value_digest("TORCHINDUCTOR_COMPILE_THREADS", "1")}
    assert host_differences(recorded, {"TORCHINDUCTOR_COMPILE_THREADS": "2"}) == []
    keyed = {"TORCHINDUCTOR_MAX_AUTOTUNE": value_digest("TORCHINDUCTOR_MAX_AUTOTUNE", "1")}  # a setting that is keyed
    assert host_differences(keyed, {}) == [("TORCHINDUCTOR_MAX_AUTOTUNE", keyed["TORCHINDUCTOR_MAX_AUTOTUNE"], None)]
