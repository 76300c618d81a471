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
