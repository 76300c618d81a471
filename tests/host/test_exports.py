"""Exports: what a release may put in a serving process's environment, read back by a real bash and
by systemd's own env-file parser."""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild.descriptors import BACKENDS, INDUCTOR, NEURON
from neffbuild.documents.records import FileEntry, Release, ReleaseUnit
from neffbuild.errors import InputError, IntegrityError
from neffbuild.hashing import hash_bytes
from neffbuild.host.exports import env_file_text, exports_for, shell_lines
from neffbuild.store import open_store
from neffbuild.store.local import LocalStore
from tests.host.test_pull import publish_files
from tests.storekit import publish_release_of, write_files
from tests.tcpproxy import TcpProxy

HOSTILE_VALUES = {
    "TORCHINDUCTOR_A": 'it\'s $(touch PWNED) `touch PWNED` "quoted" \\ back\\slash',
    "TORCHINDUCTOR_B": "  leading and trailing blanks\t ",
    "TORCHINDUCTOR_C": "# not a comment; ; & | > < * ? [x] ~ !",
    "TORCHINDUCTOR_D": "",
    "TORCHINDUCTOR_E": "ünïcödé ✓ 漢字 \U0001f600",
    "TORCHINDUCTOR_F": "a=b=c,d:e/f.g@h%i+j-k_l",
    "TORCHINDUCTOR_G": "'",
    "TORCHINDUCTOR_H": "''\"\"'\\''",
}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", create=True)


def release(**changes) -> Release:
    fields: dict = {
        "name": "m", "manifest_digest": "0" * 32, "backend": "inductor", "cache_env": "TORCHINDUCTOR_CACHE_DIR",
        "env": {"OMP_NUM_THREADS": "2"}, "fingerprint": {}, "units": (ReleaseUnit(unit_id="m/1", key="1" * 32),),
        "files": (FileEntry(path="a.so", size=1, digest="2" * 32, blake3="3" * 64),),
    }  # fmt: skip
    return Release(**{**fields, **changes})


def forge_release(store: LocalStore, raw: dict) -> str:
    """Store release JSON exactly as given (a hostile store's), under its content id."""
    data = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    release_id = hash_bytes(data)
    store.put_doc("releases", release_id, data)
    return release_id


def bash(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)


def read_back_by_bash(env_file: Path) -> dict[str, str]:
    """What `set -a; source FILE` exports, in an otherwise empty environment."""
    done = subprocess.run(
        ["env", "-i", "bash", "-c", 'set -a; source "$1"; env -0', "-", str(env_file)], capture_output=True, check=True
    )
    return dict(item.split("=", 1) for item in done.stdout.decode().split("\0") if item)


def systemd_library() -> ctypes.CDLL:
    found = sorted(
        glob.glob("/usr/lib/*/systemd/libsystemd-shared-*.so") + glob.glob("/usr/lib/systemd/libsystemd-shared-*.so")
    )
    if not found:
        pytest.skip("systemd's shared library is not installed here")
    return ctypes.CDLL(found[-1])


def read_back_by_systemd(env_file: Path) -> dict[str, str]:
    """The file as a unit's EnvironmentFile= reads it: systemd's own code (libsystemd-shared),
    the two calls src/core/execute.c makes: load_env_file, then strv_env_clean_with_callback
    (which drops invalid assignments)."""
    lib = systemd_library()
    entries = ctypes.POINTER(ctypes.c_char_p)()
    assert lib.load_env_file(None, str(env_file).encode(), ctypes.byref(entries)) == 0, (
        "systemd could not load the file"
    )
    lib.strv_env_clean_with_callback.restype = ctypes.POINTER(ctypes.c_char_p)
    entries = lib.strv_env_clean_with_callback(entries, None, None)
    found, i = {}, 0
    while entries and entries[i] is not None:
        name, value = entries[i].decode().split("=", 1)
        found[name] = value
        i += 1
    lib.strv_free(entries)
    return found


# ---- names and values under eval ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["X=1; touch {marker}; Y", "A\nLD_PRELOAD", "$(touch {marker})", "`touch {marker}`", "", "1ABC", "A B", "A-B"],
)
def test_a_hostile_env_name_never_runs_under_eval_and_is_refused(
    store: LocalStore, tmp_path: Path, cli, name: str
) -> None:
    publish_files(store, {"a.so": b"a"}, tmp_path)
    marker = tmp_path / "PWNED"
    raw = json.loads(store.get_doc("releases", sorted(store.list_docs("releases"))[0]))
    raw["env"] = {name.format(marker=marker): "1", "OMP_NUM_THREADS": "2"}
    release_id = forge_release(store, raw)
    cache = tmp_path / "cache"
    pull = shlex.join(
        [sys.executable, "-m", "neffbuild", "pull", release_id, "--store", str(store.root), "--cache-dir", str(cache)]
    )
    evaluated = bash(f'eval "$({pull})"')
    assert not marker.exists(), evaluated.stderr
    assert "error:" in evaluated.stderr and "not an environment variable name" in evaluated.stderr
    env_file = tmp_path / "neffbuild.env"  # what the runbook's sed once built, with LD_PRELOAD in it
    direct = cli("pull", release_id, "--store", str(store.root), "--cache-dir", str(cache), "--env-file", str(env_file))
    assert direct.returncode == 4 and direct.stdout == "" and "env" in direct.stderr
    assert not cache.exists() and not env_file.exists()  # refused before anything was written


def test_values_are_quoted_so_eval_sets_them_exactly(tmp_path: Path) -> None:
    exports = {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c d"),
        **HOSTILE_VALUES,
        "TORCHINDUCTOR_N": "line\nLD_PRELOAD=/x.so\n",
    }
    script = f"eval {shlex.quote(shell_lines(exports))}\nenv -0"
    done = subprocess.run(["env", "-i", "bash", "-c", script], capture_output=True, cwd=tmp_path, check=True)
    seen = dict(item.split("=", 1) for item in done.stdout.decode().split("\0") if item)
    assert {k: seen.get(k) for k in exports} == exports
    assert "LD_PRELOAD" not in seen and not (tmp_path / "PWNED").exists()


def test_exports_check_names_even_for_a_release_made_in_code(tmp_path: Path) -> None:
    """The document parser refuses bad names; exports_for checks again (defence in depth)."""
    with pytest.raises(IntegrityError, match=r"env name 'X=1; Y' is not a variable name"):
        exports_for(release(env={"X=1; Y": "1"}), tmp_path, "r.json")
    with pytest.raises(IntegrityError, match="NUL"):
        exports_for(release(env={"OMP_NUM_THREADS": "2\x00"}), tmp_path, "r.json")


# ---- what a release may set ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["LD_PRELOAD", "PATH", "PYTHONPATH", "BASH_ENV", "CXX", "TRITON_PTXAS_PATH", "NEURON_CC_FLAGS"]
)
def test_variables_the_backend_does_not_declare_are_refused_unless_allowed(
    store: LocalStore, tmp_path: Path, cli, name: str
) -> None:
    publish_files(store, {"a.so": b"a"}, tmp_path, env={name: "/tmp/evil.so"})  # an inductor release
    cache = tmp_path / "cache"
    refused = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache))
    assert refused.returncode == 4 and refused.stdout == ""
    assert f"env sets {name}, which the inductor backend does not declare" in refused.stderr
    assert f"hint: if this host accepts it, pass --allow-env {name}" in refused.stderr
    assert not cache.exists()
    allowed = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache), "--allow-env", name)
    assert allowed.returncode == 0 and f"export {name}=/tmp/evil.so" in allowed.stdout


def test_each_backend_declares_its_compiler_settings() -> None:
    inductor, neuron = INDUCTOR.serving, NEURON.serving
    assert all(
        inductor.declares(n) for n in ("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "OMP_NUM_THREADS", "TORCHDYNAMO_X")
    )
    assert all(
        neuron.declares(n)
        for n in ("NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG", "TORCH_NEURONX_MLIR_ATEN_OPS", "OMP_NUM_THREADS")
    )
    # Exact names, not a prefix: one torch_neuronx does not read needs the host's consent.
    assert not neuron.declares("TORCH_NEURONX_X")
    # Runtime placement is the host's: a release may not pin a host's cores.
    assert not any(neuron.declares(n) for n in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID"))
    assert not any(
        b.declares(n) for b in (inductor, neuron) for n in ("LD_PRELOAD", "PATH", "LD_LIBRARY_PATH", "PYTHONPATH")
    )
    assert not inductor.declares(inductor.cache_env) and not neuron.declares(neuron.cache_env)


@pytest.mark.parametrize(
    "name",
    [
        "TORCH_NEURONX_DEBUG_DIR",  # removed after every graph: a release could point it at any dir
        "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_LOG_FILE", "TORCH_NEURONX_METRICS_DIR", "NEURON_ERROR_DUMP_DIR",
        "TORCH_NEURONX_NEFF_DISABLE_CACHE", "TORCH_NEURONX_DISABLE_NEFF_CACHE",  # every boot would compile
        "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "NEURON_COMPILATION_CACHE_MAX_SIZE_MB",
    ],
)  # fmt: skip
def test_a_neuron_release_needs_the_hosts_allow_for_paths_switches_and_runtime_settings(
    tmp_path: Path, name: str
) -> None:
    neuron = release(
        backend="neuron", cache_env="TORCH_NEURONX_NEFF_CACHE_DIR", env={"NEURON_CC_FLAGS": "-O1", name: "/var/lib/x"}
    )
    with pytest.raises(IntegrityError, match=rf"env sets {name}, which the neuron backend does not declare") as refused:
        exports_for(neuron, tmp_path, "r.json")
    assert refused.value.hint == f"if this host accepts it, pass --allow-env {name} (or list it in NEFFBUILD_ALLOW_ENV)"
    exports = exports_for(neuron, tmp_path, "r.json", allow=(name,))
    assert exports == {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path), "NEURON_CC_FLAGS": "-O1", name: "/var/lib/x"}


def test_the_backends_use_the_declared_cache_variables() -> None:
    from neffbuild.backends import get_backend

    assert {b.name: get_backend(b.name).cache_env for b in BACKENDS} == {b.name: b.serving.cache_env for b in BACKENDS}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"env": {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}},
            "env sets TORCHINDUCTOR_CACHE_DIR, which pull sets to the pulled dir",
        ),
        (
            {"cache_env": "PATH"},
            "cache_env 'PATH' is not the inductor backend's cache variable TORCHINDUCTOR_CACHE_DIR",
        ),
        ({"cache_env": "TORCH_NEURONX_NEFF_CACHE_DIR"}, "is not the inductor backend's cache variable"),
        ({"backend": "nope"}, "backend 'nope' is not one this neffbuild knows"),
    ],
)
def test_the_cache_variable_always_points_at_the_pulled_dir(
    store: LocalStore, tmp_path: Path, cli, changes: dict, message: str
) -> None:
    publish_files(store, {"a.so": b"a"}, tmp_path, **changes)
    result = cli(
        "pull",
        "t",
        "--store",
        str(store.root),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--allow-env",
        "TORCHINDUCTOR_CACHE_DIR",
    )
    assert result.returncode == 4 and message in result.stderr and result.stdout == ""


def test_an_empty_cache_env_is_refused_by_the_document_parser(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, {"a.so": b"a"}, tmp_path, cache_env="")
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 4 and "at cache_env: '' is not an environment variable name" in result.stderr
    assert "export =" not in result.stdout


def test_allow_env_takes_only_variable_names(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, {"a.so": b"a"}, tmp_path)
    result = cli("env", "t", "--store", str(store.root), "--cache-dir", str(tmp_path / "c"), "--allow-env", "A;B")
    assert result.returncode == InputError.exit_code and "--allow-env 'A;B'" in result.stderr


# ---- the env file: systemd and bash read the same environment -----------------------------------


def test_pull_writes_an_env_file_that_systemd_and_bash_read_alike(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, {"a.so": b"a"}, tmp_path, env={**HOSTILE_VALUES, "OMP_NUM_THREADS": "2"})
    cache, env_file = tmp_path / "my cache", tmp_path / "run" / "neffbuild.env"
    env_file.parent.mkdir()
    result = cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache), "--env-file", str(env_file))
    assert result.returncode == 0, result.stderr
    expected = {"TORCHINDUCTOR_CACHE_DIR": str(cache), **HOSTILE_VALUES, "OMP_NUM_THREADS": "2"}
    by_bash = read_back_by_bash(env_file)
    assert {k: by_bash.get(k) for k in expected} == expected
    by_systemd = read_back_by_systemd(env_file)
    assert {k: by_systemd.get(k) for k in expected} == expected
    assert [p.name for p in env_file.parent.iterdir()] == ["neffbuild.env"]  # no temp file left


@pytest.mark.s3
def test_the_env_file_is_the_pulled_releases_when_the_tag_moves_mid_pull(
    s3_url: str, s3_env: dict[str, str], s3_server, tmp_path: Path, cli
) -> None:  # fmt: skip
    store = open_store(s3_url, create=True, env=s3_env)
    old = publish_release_of(store, tmp_path / "old", write_files(tmp_path / "old", {"big.bin": 2 << 20, "a.so": 3000}),
                             name="old", tag="prod", env={"OMP_NUM_THREADS": "2"})  # fmt: skip
    cache, env_file = tmp_path / "cache", tmp_path / "neffbuild.env"
    upstream = int(s3_server.endpoint.rsplit(":", 1)[1])
    # Blob bodies trickle through the proxy (2 MiB in about 1.6 s): the pull is fetching when the tag moves.
    with TcpProxy(upstream, mode="trickle", paths=("/blobs/", "/packs/"), trickle=(128 << 10, 0.1)) as proxy:
        command = [
            sys.executable, "-m", "neffbuild", "pull", "prod", "--store", s3_url, "--cache-dir", str(cache),
            "--env-file", str(env_file), "--json", "--no-host-check",
        ]  # fmt: skip
        env = {**os.environ, **s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        pulling = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not any(m == "GET" and ("/blobs/" in p or "/packs/" in p) for m, p, _ in list(proxy.seen)):
            assert pulling.poll() is None and time.monotonic() < deadline, pulling.stderr and pulling.stderr.read()
            time.sleep(0.02)
        new = publish_release_of(store, tmp_path / "new", write_files(tmp_path / "new", {"b.so": 1000}),
                                 name="new", tag="prod", env={"OMP_NUM_THREADS": "64"})  # fmt: skip
        assert pulling.poll() is None  # the tag moved while the pull was still fetching
        out, err = pulling.communicate(timeout=120)
    assert pulling.returncode == 0, err
    assert json.loads(out)["release_id"] == old != new
    expected = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "2"}
    assert {k: read_back_by_bash(env_file).get(k) for k in expected} == expected
    by_env = cli("env", "--cache-dir", str(cache), "--env-file", str(tmp_path / "again.env"))
    assert by_env.returncode == 0, by_env.stderr
    assert (tmp_path / "again.env").read_text() == env_file.read_text()


def test_env_command_writes_the_same_env_file(store: LocalStore, tmp_path: Path, cli) -> None:
    publish_files(store, {"a.so": b"a"}, tmp_path)
    cache = tmp_path / "cache"
    by_pull, by_env = tmp_path / "pull.env", tmp_path / "env.env"
    assert (
        cli("pull", "t", "--store", str(store.root), "--cache-dir", str(cache), "--env-file", str(by_pull)).returncode
        == 0
    )
    assert (
        cli("env", "t", "--store", str(store.root), "--cache-dir", str(cache), "--env-file", str(by_env)).returncode
        == 0
    )
    assert by_pull.read_text() == by_env.read_text() == f"TORCHINDUCTOR_CACHE_DIR={cache}\nOMP_NUM_THREADS=2\n"


@pytest.mark.parametrize(
    "value", ["line\nbreak", "carriage\rreturn", "bell\x07", "\ufdd0", "\ufffe", "\U0010ffff", "bom\ufeff"]
)
def test_values_systemd_would_drop_are_refused_for_the_env_file(tmp_path: Path, value: str) -> None:
    with pytest.raises(IntegrityError, match="TORCHINDUCTOR_X: the value holds"):
        env_file_text({"TORCHINDUCTOR_X": value})


@pytest.mark.parametrize("raw", ["A='\ufdd0'\n", "A='\ufffe'\n"])
def test_systemd_refuses_what_the_env_file_refuses(tmp_path: Path, raw: str) -> None:
    """Why those values are refused: systemd itself will not load a file holding a noncharacter."""
    env_file = tmp_path / "raw.env"
    env_file.write_text(raw + "B='ok'\n", encoding="utf-8")
    lib = systemd_library()
    entries = ctypes.POINTER(ctypes.c_char_p)()
    assert lib.load_env_file(None, str(env_file).encode(), ctypes.byref(entries)) < 0


# Any text a document can carry (no lone surrogate), weighted towards what quoting, systemd's
# parser or a terminal treats specially: C0 and C1 controls, noncharacters, BOM, bidi, separators.
_value = st.text(
    st.characters(blacklist_categories=("Cs",))
    | st.sampled_from("\t'\"\\ #;$`\x00\x07\x1b\r\n\x7f\x85\x9b\xa0\u2028\u202e\ufdd0\ufeff\ufffe\U0010ffff"),
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(_value, min_size=1, max_size=8))
def test_every_value_the_env_file_takes_reads_back_identically_by_systemd_bash_and_eval(
    tmp_path: Path, values: list[str]
) -> None:
    """The validator is the only filter: what env_file_text accepts, systemd's EnvironmentFile=,
    bash's `source` and `eval` of the shell form (pull's stdout) all read back exactly."""
    exports = {}
    for i, value in enumerate(values):
        try:
            env_file_text({"TORCHINDUCTOR_X": value})
        except IntegrityError:
            continue  # refused, with a clear error, never written
        exports[f"TORCHINDUCTOR_V{i}"] = value
    if not exports:
        return
    env_file = tmp_path / "fuzz.env"
    env_file.write_text(env_file_text(exports), encoding="utf-8")
    by_eval = subprocess.run(
        ["env", "-i", "bash", "-c", 'eval "$1"; env -0', "-", shell_lines(exports)], capture_output=True, check=True
    )
    evaluated = dict(item.split("=", 1) for item in by_eval.stdout.decode().split("\0") if item)
    assert {k: read_back_by_systemd(env_file).get(k) for k in exports} == exports
    assert {k: read_back_by_bash(env_file).get(k) for k in exports} == exports
    assert {k: evaluated.get(k) for k in exports} == exports


def test_an_export_too_large_for_any_process_is_refused_before_pull_writes(tmp_path: Path) -> None:
    """Linux starts no process whose environment holds a NAME=value string over 128 KiB: such a
    release was pulled and exported, and then nothing could start. The limit is the kernel's."""
    import errno

    from tests.storekit import publish_release_of, write_files

    EXPORT_MAX = 128 << 10  # Linux's MAX_ARG_STRLEN (32 pages), shown just below

    name = "MY_SETTING"
    fits = "x" * (EXPORT_MAX - len(name) - 2)  # NAME=value and its NUL: exactly the limit
    assert subprocess.run(["/bin/true"], env={name: fits}, check=False).returncode == 0
    with pytest.raises(OSError) as refused:
        subprocess.run(["/bin/true"], env={name: fits + "x"}, check=False)
    assert refused.value.errno == errno.E2BIG
    store = LocalStore(tmp_path / "store", create=True)
    src = tmp_path / "src"
    publish_release_of(store, src, write_files(src, {"a.bin": 10}), name="m", tag="big", env={name: fits + "x"})
    publish_release_of(store, src, write_files(src, {"a.bin": 10}), name="n", tag="fits", env={name: fits})
    cache = tmp_path / "cache"
    base = ["pull", "--store", store.url, "--cache-dir", str(cache), "--allow-env", name, "--no-host-check"]
    pulled = subprocess.run(
        [sys.executable, "-m", "neffbuild", *base, "big"], capture_output=True, text=True, check=False
    )
    assert pulled.returncode == 4, pulled.stderr
    assert f"env.{name} is {EXPORT_MAX + 1} bytes, over the {EXPORT_MAX}" in pulled.stderr
    assert not cache.exists()
    pulled = subprocess.run(
        [sys.executable, "-m", "neffbuild", *base, "fits"], capture_output=True, text=True, check=False
    )
    assert pulled.returncode == 0, pulled.stderr
