"""`neffbuild doctor`: each check failing on this machine's real filesystems, and passing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.documents.records import FileEntry, Release
from neffbuild.errors import InputError
from neffbuild.host.doctor import (
    HostView,
    check_free_space,
    check_persistent,
    check_writable,
    load_release,
    mount_of,
    not_ready,
    report_json,
    report_lines,
    run_doctor,
)

CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
HERE_FACTS = {"torch": "2.13.0", "torch-neuronx": "absent", "neuronx-cc": "absent", "diffusers": "0.42.1",
              "transformers": "5.0.0", "python": "3.11", "instance.type": "trn2.48xlarge"}  # fmt: skip


def fake_facts(facts: dict[str, str]):
    return lambda backend, env, device: facts


def release(fingerprint: dict[str, str], files=(), env=None) -> Release:
    return Release(
        name="prod", manifest_digest="0" * 32, backend="neuron", cache_env=CACHE_ENV, env=env or {},
        fingerprint=fingerprint, units=(), files=tuple(files),
    )  # fmt: skip


def host_fingerprint(**overrides: str) -> dict[str, str]:
    """What the neuron backend reports for HERE_FACTS with no Neuron variables set."""
    from neffbuild.backends.neuron import NeuronBackend
    from neffbuild.documents.manifest import ModelEntry, ShapeSet

    entry = ModelEntry(
        id="x",
        model="a/b",
        revision="r",
        pipeline="P",
        backend="neuron",
        device="neuron",
        shapes=[ShapeSet(height=16, width=16)],
    )
    return {**NeuronBackend().fingerprint(HERE_FACTS, {}, entry), **overrides}


def by_name(report, name: str):
    return next(c for c in report.checks if c.name == name)


def persistent_host(**kw) -> HostView:
    # pytest's tmp dirs are under /tmp; tests that need a passing location drop that rule.
    return HostView(volatile_dirs=(), module_available=lambda name: True, **kw)


def test_default_backend_is_the_releases_else_the_one_this_host_has(tmp_path):
    neuron_host = HostView(module_available=lambda name: name == "torch_neuronx")
    inductor_host = HostView(module_available=lambda name: name == "torch")
    assert run_doctor(env={}, cache_dir=tmp_path, host=neuron_host).backend == "neuron"
    assert run_doctor(env={}, cache_dir=tmp_path, host=inductor_host).backend == "inductor"
    assert run_doctor(env={}, cache_dir=tmp_path, release=release({}), host=inductor_host).backend == "neuron"
    here = "neuron" if _has_module("torch_neuronx") else "inductor"
    assert run_doctor(env={}, cache_dir=tmp_path).backend == here


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_this_machine_fails_backend_devices_and_default_cache_dir():
    report = run_doctor(env={}, backend="neuron")
    assert report.backend == "neuron" and report.cache_dir == Path("/tmp/neff_cache")
    # What this machine has decides each status: the checks read it, so do we.
    assert by_name(report, "backend").status == ("pass" if _has_module("torch_neuronx") else "fail")
    assert by_name(report, "devices").status == ("pass" if list(Path("/dev").glob("neuron[0-9]*")) else "fail")
    persistent = by_name(report, "persistent")
    assert persistent.status == "fail" and "/tmp" in persistent.detail  # the compiler's default dies at reboot
    assert by_name(report, "versions").status == "skip"
    assert not report.ok
    error = not_ready(report)
    assert error is not None and error.exit_code == 11 and "persistent" in error.message
    text = "\n".join(report_lines(report))
    assert "FAIL  persistent" in text and "fix:" in text
    assert report_json(report)["ok"] is False


def test_a_host_without_torch_neuronx_or_devices_fails_both_with_fixes(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvme0").touch()  # a device node that is not a NeuronCore
    host = HostView(dev_dir=tmp_path / "dev", module_available=lambda name: False)
    report = run_doctor(env={}, cache_dir=tmp_path / "cache", backend="neuron", host=host)
    backend, devices = by_name(report, "backend"), by_name(report, "devices")
    assert backend.status == "fail" and "torch_neuronx" in backend.detail and "torch-neuronx" in backend.fix
    assert devices.status == "fail" and str(tmp_path / "dev") in devices.detail and "neuron-ls" in devices.fix


def test_tmpfs_cache_dir_fails(tmp_path):
    if not Path("/dev/shm").is_dir() or mount_of(Path("/dev/shm"), _mounts())[1] != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    check = check_persistent(Path("/dev/shm/neffbuild-cache"), persistent_host(), CACHE_ENV)
    assert check.status == "fail" and "tmpfs" in check.detail and "/var/cache" in check.fix


def test_dirs_cleared_at_boot_fail_even_on_a_disk(tmp_path):
    check = check_persistent(Path("/var/tmp/neuron-compile-cache"), HostView(), CACHE_ENV)
    assert check.status == "fail" and "/var/tmp" in check.detail


def test_disk_dir_passes(tmp_path):
    check = check_persistent(tmp_path / "not-yet", persistent_host(), CACHE_ENV)
    assert check.status == "pass", check.detail


def test_mount_lookup_takes_the_longest_and_unescapes(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /srv/my\\040cache tmpfs rw 0 0\n")
    host = HostView(mounts=mounts, volatile_dirs=())
    assert check_persistent(Path("/srv/my cache/neff"), host, CACHE_ENV).status == "fail"
    assert check_persistent(Path("/srv/other"), host, CACHE_ENV).status == "pass"


def test_non_writable_dir_fails(tmp_path):
    if os.geteuid() == 0:
        target = Path("/sys/kernel")  # sysfs refuses new files even to root
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o555)
    check = check_writable(target)
    assert check.status == "fail" and "cannot create files" in check.detail and check.fix


def test_missing_dir_is_judged_by_its_parent(tmp_path):
    check = check_writable(tmp_path / "a" / "b")
    assert check.status == "pass" and "does not exist yet" in check.detail
    (tmp_path / "file").write_text("x")
    assert check_writable(tmp_path / "file").status == "fail"


def test_free_space_fails_when_the_release_does_not_fit(tmp_path):
    huge = FileEntry(path="ab/cd/abcd" + "0" * 28 + ".neff", size=1 << 60, digest="0" * 32, blake3="0" * 64)
    check = check_free_space(tmp_path, release({}, files=[huge]), HostView())
    assert check.status == "fail" and "still to pull" in check.detail
    assert check_free_space(tmp_path, None, HostView(min_free_bytes=1 << 60)).status == "fail"
    assert check_free_space(tmp_path, None, HostView(min_free_bytes=1)).status == "pass"


def test_files_already_present_need_no_space(tmp_path):
    size = shutil.disk_usage(tmp_path).free + (1 << 30)  # more than fits
    entry = FileEntry(path="ab/cd/abcd" + "0" * 28 + ".neff", size=size, digest="0" * 32, blake3="0" * 64)
    assert check_free_space(tmp_path, release({}, files=[entry]), HostView()).status == "fail"
    target = tmp_path / entry.path
    target.parent.mkdir(parents=True)
    with target.open("wb") as out:  # sparse: the size matches without using the space
        out.truncate(entry.size)
    assert check_free_space(tmp_path, release({}, files=[entry]), HostView()).status == "pass"


def test_versions_against_a_release_name_each_difference(tmp_path):
    built = host_fingerprint(**{"neuronx-cc": "2.21.33", "torch-neuronx": "2.13.0.1"})
    host = persistent_host(facts=fake_facts(HERE_FACTS))
    report = run_doctor(env={}, cache_dir=tmp_path, release=release(built), host=host)
    versions = by_name(report, "versions")
    assert versions.status == "fail"
    assert (
        "neuronx-cc: build has '2.21.33', this host 'absent'" in versions.detail and "torch-neuronx" in versions.detail
    )
    same = run_doctor(env={}, cache_dir=tmp_path, release=release(host_fingerprint()), host=host)
    assert by_name(same, "versions").status == "pass"


def test_release_env_is_what_the_server_runs_with(tmp_path):
    built = host_fingerprint(**{"neuron.cc_flags": "--model-type=transformer"})
    rel = release(built, env={"NEURON_CC_FLAGS": "--model-type=transformer"})
    host = persistent_host(facts=fake_facts(HERE_FACTS))
    assert by_name(run_doctor(env={}, cache_dir=tmp_path, release=rel, host=host), "versions").status == "pass"
    extra = {"TORCH_NEURONX_ENABLE_NKI_SDPA": "0"}
    check = by_name(run_doctor(env=extra, cache_dir=tmp_path, release=rel, host=host), "versions")
    assert (
        check.status == "fail"
        and "env.TORCH_NEURONX_ENABLE_NKI_SDPA: this host sets '0', the build did not" in check.detail
    )


def test_informational_differences_pass_and_are_named(tmp_path):
    rel = release(host_fingerprint(**{"neuronx-cc.bin": "/opt/venv/bin/neuronx-cc"}))
    check = by_name(
        run_doctor(env={}, cache_dir=tmp_path, release=rel, host=persistent_host(facts=fake_facts(HERE_FACTS))),
        "versions",
    )
    assert (
        check.status == "pass"
        and "informational: neuronx-cc.bin: build has '/opt/venv/bin/neuronx-cc', this host 'absent'" in check.detail
    )
    # Another diffusers moves the source locations the NEFF key hashes: breaking for neuron.
    moved = release(host_fingerprint(diffusers="0.41.0"))
    assert (
        by_name(
            run_doctor(env={}, cache_dir=tmp_path, release=moved, host=persistent_host(facts=fake_facts(HERE_FACTS))),
            "versions",
        ).status
        == "fail"
    )


def test_all_pass_on_a_good_host(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "neuron0").touch()
    host = persistent_host(dev_dir=tmp_path / "dev", facts=fake_facts(HERE_FACTS))
    report = run_doctor(env={CACHE_ENV: str(tmp_path / "cache")}, release=release(host_fingerprint()), host=host)
    assert report.ok, report_lines(report)
    assert (
        report.cache_dir == tmp_path / "cache"
        and [c.status for c in report.checks if c.name != "compiler config"] == ["pass"] * 8
    )
    assert [c.status for c in report.checks if c.name == "compiler config"] == ["skip"]  # neuron records none


def test_release_from_a_file_or_a_store(tmp_path):
    from neffbuild.documents.records import dump

    rel = release(host_fingerprint())
    path = tmp_path / "release.json"
    path.write_bytes(dump(rel))
    assert load_release(str(path), None, {}) == rel
    with pytest.raises(InputError, match="not a release file"):
        load_release("prod", None, {})


def test_backend_must_match_the_release(tmp_path):
    with pytest.raises(InputError, match="built with neuron"):
        run_doctor(env={}, cache_dir=tmp_path, backend="inductor", release=release({}))


def _mounts() -> list[tuple[str, str]]:
    from neffbuild.host.doctor import _read_mounts

    return _read_mounts(Path("/proc/mounts"))


def test_cli_doctor_exits_non_zero_and_prints_json(cli):
    result = cli("doctor", "--json", "--cache-dir", "/dev/shm/neffbuild-doctor-test")
    doc = json.loads(result.stdout)
    assert result.returncode == 11 and doc["ok"] is False
    assert {c["name"]: c["status"] for c in doc["checks"]}["persistent"] == "fail"
    text = cli("doctor", "--cache-dir", "/dev/shm/neffbuild-doctor-test")
    assert text.returncode == 11 and "FAIL  persistent" in text.stdout and "fix:" in text.stdout


def test_the_neuron_lock_dir_must_be_creatable_even_for_a_read_only_cache(tmp_path):
    host = persistent_host(facts=fake_facts(HERE_FACTS))
    unwritable = {
        "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": "/sys/kernel/neuron-locks"
    }  # sysfs: no new files, even for root
    check = by_name(run_doctor(env=unwritable, cache_dir=tmp_path, backend="neuron", host=host), "lock dir")
    assert check.status == "fail" and "/sys/kernel/neuron-locks" in check.detail and "fails without it" in check.detail
    assert "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR" in check.fix
    ok = by_name(
        run_doctor(
            env={"TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(tmp_path / "locks")},
            cache_dir=tmp_path,
            backend="neuron",
            host=host,
        ),
        "lock dir",
    )
    assert ok.status == "pass" and str(tmp_path / "locks") in ok.detail
    # Unset or empty: upstream's literal default, not $TMPDIR.
    default = by_name(
        run_doctor(
            env={"TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": "", "TMPDIR": str(tmp_path)},
            cache_dir=tmp_path,
            backend="neuron",
            host=host,
        ),
        "lock dir",
    )
    # Set but empty: the C++ path's default, the Python path's working directory (cache_utils.py:13-15).
    assert default.status == "fail" and "/tmp/local_cache" in default.detail and "working directory" in default.detail
    unset = by_name(
        run_doctor(env={"TMPDIR": str(tmp_path)}, cache_dir=tmp_path, backend="neuron", host=host), "lock dir"
    )
    assert "/tmp/local_cache" in unset.detail and str(tmp_path) not in unset.detail
    assert by_name(run_doctor(env={}, cache_dir=tmp_path, backend="inductor", host=host), "lock dir").status == "skip"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TORCH_NEURONX_NEFF_DISABLE_CACHE", "1"),  # the disk cache, C++ and Python paths
        ("TORCH_NEURONX_NEFF_DISABLE_CACHE", "True"),  # the Python path: case-insensitive, also yes
        ("TORCH_NEURONX_DISABLE_NEFF_CACHE", "yes"),  # the other spelling: the Python in-memory caches
    ],
)
def test_a_host_env_that_turns_the_neuron_cache_off_fails(tmp_path, name, value):
    host = persistent_host(facts=fake_facts(HERE_FACTS))
    check = by_name(run_doctor(env={name: value}, cache_dir=tmp_path, backend="neuron", host=host), "cache on")
    assert check.status == "fail" and f"{name}={value}" in check.detail and name in check.fix
    # "0" leaves it on.
    on = by_name(run_doctor(env={name: "0"}, cache_dir=tmp_path, backend="neuron", host=host), "cache on")
    assert on.status == "pass"
    assert by_name(run_doctor(env={}, cache_dir=tmp_path, backend="inductor", host=host), "cache on").status == "skip"


def test_compiler_config_hashes_are_recomputed_in_the_serving_environment() -> None:
    """torch reads CI at import into its functorch config, which AOTAutograd's key hashes: doctor
    recomputes the hashes in a fresh torch started with the serving environment (real torch)."""
    from dataclasses import replace

    from neffbuild.host.doctor import check_compiler_config, serving_config_hashes

    base = {k: v for k, v in os.environ.items() if k not in ("CI", "AOT_PARTITIONER_DEBUG")}
    built = serving_config_hashes(base)
    keyed = {"torch._inductor.config:save_config_portable", "torch._functorch.config:save_config"}
    assert set(built) == {*keyed, "torch_key"}
    inductor = replace(release({}), backend="inductor", compiler_keys=dict(built))
    assert check_compiler_config(inductor, base, HostView()).status == "pass"
    failed = check_compiler_config(inductor, {**base, "CI": "1"}, HostView())
    assert failed.status == "fail" and failed.detail.startswith("differs from the build: torch._functorch.config")
    assert "status" in failed.fix
    assert check_compiler_config(release({}), base, HostView()).status == "skip"  # built before them
    # Hashes another neffbuild recorded (get_hash(), which followed the working directory) are not compared.
    older = replace(inductor, compiler_keys={"torch._inductor.config": "0" * 32, "torch._functorch.config": "1" * 32})
    assert check_compiler_config(older, base, HostView()).status == "skip"


def test_compiler_config_hashes_do_not_follow_the_working_directory(tmp_path: Path) -> None:
    """torch resolves xpu.cutlass_dir against the working directory: a build run in one directory
    and a doctor in another must still agree (real torch, two processes)."""
    code = "import json; from neffbuild.backends.envreads import compiler_config_hashes as h; print(json.dumps(h()))"
    seen = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path / name, capture_output=True, text=True, check=True
        )
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert seen[0] == seen[1] and len(seen[0]) == 3, seen
