"""`neffbuild doctor --neuron-selfcheck`: skips cleanly without torch_neuronx; its checks run real
probe processes (torchrun included) against a stand-in torch_neuronx that sets the environment
at import as 0.1.0 does, so each can be seen to pass and to fail."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neffbuild.backends.neuron import NeuronBackend
from neffbuild.host.selfcheck import (
    NAMES,
    check_eager_ops,
    check_import_defaults,
    check_lock_dir,
    check_platform,
    check_read_only,
    check_tp_keys,
    check_venv_paths,
    neuron_selfcheck,
    run_probe,
)
from tests.backends.test_neuron import DOUBLE_ENV, TESTS, _has_torch_neuronx, fake_torch_neuronx


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


def with_double(
    tmp_path: Path, product: str = "trn2.48xlarge", fake: dict[str, str] | None = None, **double: str
) -> tuple[NeuronBackend, dict[str, str]]:
    """The stand-in torch_neuronx, the test double as the compiler (tests/neuron_double.py; double:
    its NEFFBUILD_DOUBLE_* switches) and a DMI product name."""
    package = fake_torch_neuronx(tmp_path / "site", **(fake or {}))
    path = os.pathsep.join([str(package.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        **DOUBLE_ENV,
        "PYTHONPATH": path,
        **{f"NEFFBUILD_DOUBLE_{k.upper()}": v for k, v in double.items()},
    }
    dmi = tmp_path / "product_name"
    dmi.write_text(product + "\n")
    return NeuronBackend(env=env, package_dir=lambda name: package, product_name_file=dmi), env


@pytest.mark.slow  # the whole self-check: about a dozen fresh processes (110 s here)
def test_every_check_passes_against_the_double_on_a_good_host(tmp_path):
    backend, env = with_double(tmp_path)
    report = neuron_selfcheck(env=env, work_dir=tmp_path, backend=backend)
    assert [c.name for c in report.checks] == list(NAMES)
    # The torchrun ranks of "tp keys" read this machine's DMI, not the injected file; that check
    # passes with one DMI for both in its own test above.
    assert [c for c in report.checks if c.status != "pass" and c.name != "tp keys"] == [], report.checks


def test_the_platform_check_compares_dmi_with_the_runtimes_own_answer(tmp_path):
    backend, env = with_double(tmp_path / "a", product="trn1.32xlarge")  # the runtime says trn2
    check = check_platform(backend, env, run_probe)
    assert check.status == "fail" and "neuron.target 'trn1' (DMI), runtime 'trn2'" in check.detail, check
    backend, env = with_double(tmp_path / "b", fake={"lnc": "1"})  # a trn2 the runtime runs at 1 logical core
    check = check_platform(backend, env, run_probe)
    assert check.status == "fail" and "neuron.lnc '2' (DMI), runtime '1'" in check.detail, check


def test_the_venv_paths_check_fails_without_counted_compiles_or_on_an_unknown_layout(tmp_path):
    _, env = with_double(tmp_path / "a", uncounted="1")
    check = check_venv_paths(tmp_path / "a" / "w", env, run_probe)
    assert check.status == "fail" and "counted 0 compiles" in check.detail, check
    _, env = with_double(tmp_path / "b", layout="flat")
    check = check_venv_paths(tmp_path / "b" / "w", env, run_probe)
    assert check.status == "fail" and "the bundler does not know" in check.detail and ".neff" in check.detail, check


def test_the_eager_check_runs_an_op_with_fallback_off_and_sees_what_it_wrote(tmp_path):
    _, env = with_double(tmp_path / "a", fail_op="Linear")  # would run on CPU, silently, in a server
    check = check_eager_ops(tmp_path / "a" / "w", env, run_probe)
    assert check.status == "fail" and "Operation Linear failed to execute on Neuron" in check.detail, check
    _, env = with_double(tmp_path / "b", layout="none")  # a wheel that caches eager ops elsewhere
    check = check_eager_ops(tmp_path / "b" / "w", env, run_probe)
    assert check.status == "fail" and "wrote 0 files" in check.detail, check


def test_the_read_only_check_sees_a_write_even_as_root(tmp_path):
    _, env = with_double(tmp_path, touch_on_hit="1")  # a hit that writes beside its entry
    check = check_read_only(tmp_path / "w", env, run_probe)
    assert check.status == "fail" and ".neff.hit" in check.detail, check


def test_the_lock_dir_check_covers_the_unset_default_and_an_unmakeable_dir(tmp_path):
    _, env = with_double(tmp_path / "a", local_default="tmpdir")  # unset follows $TMPDIR
    check = check_lock_dir(tmp_path / "a" / "w", env, run_probe)
    assert check.status == "fail" and "$TMPDIR/local_cache, not /tmp/local_cache" in check.detail, check
    _, env = with_double(tmp_path / "b", local_optional="1")  # starts without its lock dir
    check = check_lock_dir(tmp_path / "b" / "w", env, run_probe)
    assert check.status == "fail" and "still served" in check.detail, check
