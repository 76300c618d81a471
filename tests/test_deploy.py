"""deploy/: the systemd units pass `systemd-analyze verify`, the scripts parse, and the container
entrypoint serves with the exports of the release it pulled (issue 12, item 9)."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.store.local import LocalStore
from tests.host.test_pull import FILES, publish_files

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNITS = ("neffbuild-pull.service", "image-server.service")
VENV_BIN = "/opt/neffbuild/venv/bin/"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((DEPLOY / name).read_text())
    return parser


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    # verify requires ExecStart's binary to exist: point the units at this interpreter's bin dir.
    here = Path(sys.executable).parent
    assert (here / "neffbuild").is_file() and (here / "python").is_file()
    for name in UNITS:
        text = (DEPLOY / name).read_text()
        assert VENV_BIN in text
        (tmp_path / name).write_text(text.replace(VENV_BIN, f"{here}/"))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--generators=no", *(f"./{n}" for n in UNITS)],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    # Unknown keys and bad values are only warnings (exit 0): the output must be empty too.
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_a_broken_unit_fails_verify(tmp_path: Path) -> None:
    """The check above can fail: a missing binary, or a key systemd does not know."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    text = (DEPLOY / UNITS[0]).read_text()
    (tmp_path / "missing.service").write_text(text)
    (tmp_path / "typo.service").write_text(
        text.replace(VENV_BIN, f"{Path(sys.executable).parent}/").replace("RemainAfterExit=", "RemainAfterExits=")
    )
    for name, expected in (("missing.service", "is not executable"), ("typo.service", "Unknown key")):
        done = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", "--generators=no", f"./{name}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
        )
        assert expected in done.stderr


def test_the_pull_unit_runs_once_before_the_server_with_the_store_in_its_own_env_file() -> None:
    pull, server = unit("neffbuild-pull.service"), unit("image-server.service")
    assert pull["Service"]["Type"] == "oneshot" and pull["Service"]["RemainAfterExit"] == "yes"
    assert pull["Unit"]["After"] == pull["Unit"]["Wants"] == "network-online.target"
    assert pull["Unit"]["Before"] == "image-server.service" and pull["Install"]["RequiredBy"] == "image-server.service"
    assert pull["Service"]["EnvironmentFile"] == "/etc/neffbuild/pull.env"
    exec_start = pull["Service"]["ExecStart"].split()
    assert exec_start[:2] == [f"{VENV_BIN}neffbuild", "pull"]
    env_file = exec_start[exec_start.index("--env-file") + 1]
    assert server["Service"]["EnvironmentFile"] == env_file and env_file.startswith(
        f"/run/{pull['Service']['RuntimeDirectory']}/"
    )
    assert server["Unit"]["Requires"] == server["Unit"]["After"] == "neffbuild-pull.service"
    # Each name the unit expands is one pull.env.example sets.
    example = (DEPLOY / "pull.env.example").read_text()
    for word in exec_start:
        if word.startswith("${"):
            assert f"\n{word[2:-1]}=" in f"\n{example}"


def test_a_failed_pull_is_retried_after_a_jittered_bounded_delay_and_exit_3_is_retried(tmp_path: Path) -> None:
    """systemd restarts the pull on failure (a oneshot may: only Restart=always/on-success are
    refused for it), not on exits a retry cannot mend, at most StartLimitBurst times an hour;
    each failure waits RestartSec plus a random draw (ExecStopPost), run here with a stand-in
    `sleep` that prints what it was asked to wait."""
    pull = unit("neffbuild-pull.service")
    service = pull["Service"]
    assert service["Type"] == "oneshot" and service["Restart"] == "on-failure" and service["RestartSec"] == "15s"
    prevented = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert 3 not in prevented and 9 not in prevented and {2, 4, 7, 8, 10, 13, 16} <= prevented
    assert (pull["Unit"]["StartLimitIntervalSec"], pull["Unit"]["StartLimitBurst"]) == ("1h", "4")
    assert "Exit 3:" in (DEPLOY / "neffbuild-pull.service").read_text()  # the comments say what exit 3 means
    command = service["ExecStopPost"]
    assert command.startswith("/bin/sh -c '") and command.endswith("'")
    script = (
        command.removeprefix("/bin/sh -c '").removesuffix("'").replace("$$", "$")
    )  # systemd's escape of a literal $
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "sleep").write_text('#!/bin/sh\necho "$1"\n')
    (stand_in / "sleep").chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_in}:{os.environ['PATH']}"}

    def after(result: str) -> str:
        done = subprocess.run(
            ["/bin/sh", "-c", script],
            env={**env, "SERVICE_RESULT": result},
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert after("success") == ""  # a plain stop waits for nothing
    delays = [int(after("exit-code")) for _ in range(12)]
    assert all(0 <= d <= 30 for d in delays) and len(set(delays)) > 1, delays


def test_the_server_reads_the_pulled_cache_read_only_but_for_the_dirs_its_compiler_writes_on_a_hit() -> None:
    from neffbuild.servingenv import INDUCTOR

    service = unit("image-server.service")["Service"]
    example = dict(
        line.split("=", 1) for line in (DEPLOY / "pull.env.example").read_text().splitlines() if line[:1].isalpha()
    )
    cache_dir = example["NEFFBUILD_CACHE_DIR"]
    assert service["ReadOnlyPaths"] == cache_dir
    assert service["ReadWritePaths"].split() == [f"{cache_dir}/{name}" for name in INDUCTOR.writable]


@pytest.mark.parametrize("script", ["entrypoint.sh"])
def test_the_shell_scripts_parse(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(DEPLOY / script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert os.access(DEPLOY / script, os.X_OK)


def test_the_entrypoint_pulls_then_execs_the_server_with_the_exports_and_without_the_credentials(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store", create=True)
    publish_files(store, FILES, tmp_path, tag="prod")
    cache = tmp_path / "cache"
    neffbuild = tmp_path / "neffbuild"  # this interpreter, as pull compares it with the build's
    neffbuild.write_text(f'#!/bin/sh\nexec {sys.executable} -m neffbuild "$@"\n')
    neffbuild.chmod(0o755)
    env = {
        **os.environ,
        "NEFFBUILD_STORE": str(store.root), "NEFFBUILD_RELEASE": "prod", "NEFFBUILD_CACHE_DIR": str(cache),
        "NEFFBUILD_ENV_FILE": str(tmp_path / "serving.env"), "NEFFBUILD_BIN": str(neffbuild),
        "AWS_SECRET_ACCESS_KEY": "secret", "OMP_NUM_THREADS": "7",
    }  # fmt: skip
    server = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    done = subprocess.run(
        [str(DEPLOY / "entrypoint.sh"), *server], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert (
        seen["TORCHINDUCTOR_CACHE_DIR"] == str(cache.resolve()) and seen["OMP_NUM_THREADS"] == "2"
    )  # the release's, not ours
    assert "NEFFBUILD_STORE" not in seen and "AWS_SECRET_ACCESS_KEY" not in seen
    assert all((cache / rel).read_bytes() == data for rel, data in FILES.items())
    missing = subprocess.run(
        [str(DEPLOY / "entrypoint.sh"), "true"],
        env={**env, "NEFFBUILD_RELEASE": "nope"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 8 and "nope" in missing.stderr


def _names(env_text: str) -> set[str]:
    return {line.split("=", 1)[0] for line in env_text.splitlines() if line and not line.startswith("#")}


def test_the_cloud_init_user_data_writes_the_pull_env_and_starts_both_units() -> None:
    yaml = pytest.importorskip("yaml")
    text = (DEPLOY / "cloud-init.yaml").read_text()
    assert text.startswith("#cloud-config\n")  # cloud-init ignores user data without it
    doc = yaml.safe_load(text)
    (env,) = [
        f for f in doc["write_files"] if f["path"] == unit("neffbuild-pull.service")["Service"]["EnvironmentFile"]
    ]
    assert env["permissions"] == "0600" and _names(env["content"]) == _names((DEPLOY / "pull.env.example").read_text())
    enable = next(cmd for cmd in doc["runcmd"] if cmd[:2] == ["systemctl", "enable"])
    assert set(UNITS) <= set(enable)
