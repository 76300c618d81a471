"""`neffbuild doctor --neuron-selfcheck`: skips cleanly without torch_neuronx; its checks run real
probe processes (torchrun included) against a stand-in torch_neuronx that sets the environment
at import as 0.1.0 does, so each can be seen to pass and to fail."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neffbuild.backends.neuron import NeuronBackend
from neffbuild.host.selfcheck import NAMES, check_import_defaults, check_tp_keys, neuron_selfcheck, run_probe
from tests.backends.test_neuron import _has_torch_neuronx, fake_torch_neuronx


def with_fake(tmp_path: Path, **kw: str) -> tuple[NeuronBackend, dict[str, str]]:
    package = fake_torch_neuronx(tmp_path / "site", **kw)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])}
    return NeuronBackend(env=env, package_dir=lambda name: package), env


def test_the_selfcheck_skips_every_check_without_torch_neuronx(cli, tmp_path):
    if _has_torch_neuronx():
        pytest.skip("torch-neuronx is installed here: the self-check runs for real")
    report = neuron_selfcheck(env=dict(os.environ), work_dir=tmp_path)
    assert (
        [c.name for c in report.checks] == list(NAMES) and {c.status for c in report.checks} == {"skip"} and report.ok
    )
    assert list(tmp_path.iterdir()) == []  # nothing compiled, nothing left
    done = cli("doctor", "--neuron-selfcheck")
    assert (
        done.returncode == 0
        and done.stdout.count("SKIP") == len(NAMES)
        and "torch_neuronx is not importable" in done.stdout
        and "nothing checked: every check was skipped" in done.stdout
        and "ready" not in done.stdout
    )


def test_a_tp_units_planned_and_rank_fingerprints_agree_with_the_import_defaults_applied(tmp_path):
    backend, env = with_fake(tmp_path)
    check = check_tp_keys(backend, env, run_probe)  # two real ranks under torchrun, each after its import
    assert check.status == "pass" and "plan and 2 ranks agree" in check.detail, check


def test_a_wheel_with_another_keyed_default_fails_the_tp_check_naming_it(tmp_path):
    backend, env = with_fake(tmp_path, TORCH_NEURONX_MLIR_ATEN_OPS="0")
    check = check_tp_keys(backend, env, run_probe)
    assert (
        check.status == "fail"
        and "env.TORCH_NEURONX_MLIR_ATEN_OPS" in check.detail
        and "ranks {0: '0', 1: '0'}" in check.detail
    )


def test_the_import_defaults_check_reads_the_wheels_sync_mode(tmp_path):
    backend, env = with_fake(tmp_path / "release")
    passed = check_import_defaults(backend, env, run_probe)
    assert passed.status == "pass" and "NEURON_LAUNCH_BLOCKING=1" in passed.detail and "<64 hex>" in passed.detail
    # A DEV _build_config.py whose import still writes "1": the backend would key the wrong layout.
    backend, env = with_fake(tmp_path / "dev", build_type="DEV", NEURON_LAUNCH_BLOCKING="1")
    failed = check_import_defaults(backend, env, run_probe)
    assert failed.status == "fail" and "expects NEURON_LAUNCH_BLOCKING=0" in failed.detail and failed.fix
