"""``esi-sidecar install`` / ``uninstall``: the service from pip (issue 26, item 2).

Every test runs with ``--root`` or ``--print``, so systemctl is never called (with
``--root`` the command says so and skips it): no systemd as PID 1 is needed. The unit it
writes is the one install.sh writes for the same executable (install.sh runs here on a
staging root, as in test_deploy.py), and ``systemd-analyze verify`` passes on it when
systemd-analyze is installed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import test_deploy
from daemon_harness import fetch_json
from deploy_support import unit_directives
from test_deploy import (
    EXPIRES_AT,
    FAST_PIP,
    SYSTEMD_PATH,
    BootedSystemd,
    clean_environ,
    copy_checkout,
    free_port,
    reuse_venv,
    run_install,
)

from sidecar.cli import main
from sidecar.host.home_paths import HomePathError, folders_to_read, in_home
from sidecar.host.install_service import ENV_FILE, UNIT_FILE, unit_text

REPO = Path(__file__).resolve().parents[2]
ENV_EXAMPLE = REPO / "deploy" / "esi-sidecar.env.example"
UNIT_SOURCE = REPO / "deploy" / "esi-sidecar.service"
SCRIPT = Path(sys.executable).parent / "esi-sidecar"  # this venv's console script
booted_systemd = test_deploy.booted_systemd  # the fixture: systemd as PID 1 of namespaces


def under(root: Path, absolute: str) -> Path:
    return root / absolute.lstrip("/")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_print_shows_the_unit_with_the_running_executable(tmp_path: Path) -> None:
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} is not installed")
    result = subprocess.run([str(SCRIPT), "install", "--print", "--root", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"\nExecStart={SCRIPT.resolve()} serve\n" in result.stdout
    assert "WantedBy=multi-user.target" in result.stdout
    assert f"# {under(tmp_path, ENV_FILE)} (mode 600)" in result.stdout
    assert list(tmp_path.iterdir()) == []  # --print writes nothing


def test_root_writes_the_unit_and_the_env_file_and_keeps_an_existing_env_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    executable = "/usr/local/bin/esi-sidecar"
    assert main(["install", "--root", str(tmp_path), "--executable", executable]) == 0
    out = capsys.readouterr().out
    assert "systemctl not called" in out  # --root never calls systemctl
    unit = under(tmp_path, UNIT_FILE)
    env_file = under(tmp_path, ENV_FILE)
    assert unit.read_text() == unit_text(executable)
    assert f"\nExecStart={executable} serve\n" in unit.read_text()
    assert mode(unit) == 0o644
    assert env_file.read_text() == ENV_EXAMPLE.read_text()
    assert mode(env_file) == 0o600
    assert mode(env_file.parent) == 0o700
    # A second install keeps the settings a user wrote and rewrites the unit.
    env_file.write_text("ESI_SIDECAR_REGION=cn-shanghai\n")
    unit.write_text("stale\n")
    assert main(["install", "--root", str(tmp_path), "--executable", executable]) == 0
    assert "kept:" in capsys.readouterr().out
    assert env_file.read_text() == "ESI_SIDECAR_REGION=cn-shanghai\n"
    assert unit.read_text() == unit_text(executable)


def test_uninstall_removes_the_unit_and_purge_the_env_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--root", str(tmp_path), "--executable", "/usr/bin/esi-sidecar"]) == 0
    assert main(["uninstall", "--root", str(tmp_path)]) == 0
    assert not under(tmp_path, UNIT_FILE).exists()
    assert under(tmp_path, ENV_FILE).exists()
    assert "kept:" in capsys.readouterr().out
    assert main(["install", "--remove", "--purge", "--root", str(tmp_path)]) == 0
    assert not under(tmp_path, ENV_FILE).parent.exists()
    assert main(["uninstall", "--purge", "--root", str(tmp_path)]) == 0  # nothing left: fine


def test_print_always_shows_the_unit_and_says_on_stderr_why_it_could_not_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An esi-sidecar in a home that is not there (nothing to make readable): --print
    still shows the unit, exit 0, and says on stderr what is wrong (issue 39, item 2)."""
    missing = "/home/alice/.local/bin/esi-sidecar"
    assert main(["install", "--print", "--executable", missing]) == 0
    said = capsys.readouterr()
    assert f"\nExecStart={missing} serve\n" in said.out
    assert "warning: /home/alice/.local/bin: No such file or directory" in said.err
    # A script outside the homes whose interpreter is inside one and cannot run.
    script = tmp_path / "esi-sidecar"
    script.write_text("#!/root/.local/pipx/venvs/esi-sidecar/bin/python\n")
    assert main(["install", "--print", "--executable", str(script)]) == 0
    said = capsys.readouterr()
    assert f"\nExecStart={script} serve\n" in said.out
    assert "cannot run /root/.local/pipx/venvs/esi-sidecar/bin/python" in said.err
    with pytest.raises(HomePathError, match="No such file"):
        folders_to_read(missing)  # what stops an install (exit 2) before it writes


def test_an_interpreter_under_a_home_is_bound_in_read_only(tmp_path: Path) -> None:
    """pyenv, conda, and any venv made from them (this test's own venv on a pyenv
    Python): the unit hides the homes but the interpreter's prefix, read-only, and
    systemd-analyze verify accepts it (issue 39, item 2)."""
    base = os.path.realpath(sys.base_prefix)
    if not in_home(base + "/"):
        pytest.skip(f"this test's Python ({base}) is not under a home folder")
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} is not installed")
    result = subprocess.run([str(SCRIPT), "install", "--unit-only", "--print"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    directives = unit_directives(result.stdout)
    assert directives["Service.ProtectHome"] == ["tmpfs"]
    assert base in directives["Service.BindReadOnlyPaths"]
    assert all(in_home(path + "/") for path in directives["Service.BindReadOnlyPaths"])
    assert f"keeps {base}" in result.stderr  # said, on stderr, not in the unit's text
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    root = tmp_path / "root"
    under(root, ENV_FILE).parent.mkdir(parents=True)
    under(root, ENV_FILE).write_text("")
    under(root, UNIT_FILE).parent.mkdir(parents=True)
    under(root, UNIT_FILE).write_text(result.stdout)
    checked = verify(analyze, root)
    assert checked.returncode == 0 and "esi-sidecar.service" not in checked.stderr, (
        checked.stderr)


def test_install_sh_takes_an_interpreter_under_a_home(tmp_path: Path) -> None:
    """install.sh no longer stops at a pyenv or conda Python (its unit keeps the folder
    readable); its dry run says what it would do, and never "not installed"."""
    base = os.path.realpath(sys._base_executable)  # type: ignore[attr-defined]
    if not in_home(base):
        pytest.skip(f"this test's Python ({base}) is not under a home folder")
    checkout = copy_checkout(tmp_path / "checkout")
    result = run_install("--dry-run", "--prefix", str(tmp_path / "prefix"), "--python", base,
                         "--no-start", script=checkout / "install.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not installed" not in result.stdout + result.stderr
    assert "checked by the installed package; a dry run installs none" in result.stdout


def test_the_packaged_unit_is_the_deploy_unit() -> None:
    assert unit_text("/opt/esi-sidecar/bin/esi-sidecar") == UNIT_SOURCE.read_text()
    # Its header names who writes it, whichever way it was installed.
    assert "Installed by install.sh" not in UNIT_SOURCE.read_text()
    assert "Written by `esi-sidecar install` (which\n# install.sh runs)" in UNIT_SOURCE.read_text()


def test_the_unit_is_the_one_install_sh_writes(tmp_path: Path) -> None:
    prefix = "/srv/esi"  # another --prefix: install.sh rewrites ExecStart
    staged = tmp_path / "staged"
    staged.mkdir()
    reuse_venv(under(staged, prefix))
    checkout = copy_checkout(tmp_path / "checkout")
    result = run_install("--root", str(staged), "--prefix", prefix, "--python", sys.executable,
                         "--no-start", *FAST_PIP, script=checkout / "install.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    ours = tmp_path / "ours"
    assert main(["install", "--root", str(ours), "--no-start",
                 "--executable", f"{prefix}/bin/esi-sidecar"]) == 0
    assert under(ours, UNIT_FILE).read_bytes() == under(staged, UNIT_FILE).read_bytes()


def test_a_second_install_leaves_an_unchanged_unit_alone_and_unit_only_writes_the_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    executable = "/usr/local/bin/esi-sidecar"
    only = ["install", "--unit-only", "--root", str(tmp_path), "--executable", executable]
    assert main([*only, "--print"]) == 0
    assert capsys.readouterr().out == unit_text(executable)  # the text alone, for install.sh
    assert list(tmp_path.iterdir()) == []
    assert main(only) == 0
    unit = under(tmp_path, UNIT_FILE)
    assert unit.read_text() == unit_text(executable) and mode(unit) == 0o644
    assert not under(tmp_path, ENV_FILE).exists()  # --unit-only: no env file
    assert "systemctl" not in capsys.readouterr().out  # nor systemctl
    written = unit.stat().st_mtime_ns
    assert main(["install", "--root", str(tmp_path), "--executable", executable]) == 0
    assert f"unchanged: {unit}" in capsys.readouterr().out
    assert unit.stat().st_mtime_ns == written


def test_install_sh_writes_the_unit_through_esi_sidecar_install(tmp_path: Path) -> None:
    """No second source of the unit: with deploy/'s copy gone from the checkout, install.sh
    still writes the package's unit (the venv's esi-sidecar install --unit-only), and a
    dry run afterwards compares against it."""
    prefix = "/srv/esi"
    staged = tmp_path / "staged"
    staged.mkdir()
    reuse_venv(under(staged, prefix))
    checkout = copy_checkout(tmp_path / "checkout")
    (checkout / "deploy" / "esi-sidecar.service").unlink()
    args = ("--root", str(staged), "--prefix", prefix, "--python", sys.executable,
            "--no-start", *FAST_PIP)
    result = run_install(*args, script=checkout / "install.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    unit = under(staged, UNIT_FILE)
    assert f"wrote: {unit} (mode 644)" in result.stdout
    assert unit.read_text() == unit_text(f"{prefix}/bin/esi-sidecar")
    dry = run_install(*args, "--dry-run", script=checkout / "install.sh")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"unchanged: {unit}" in dry.stdout


def test_the_written_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} is not installed")
    assert main(["install", "--root", str(tmp_path), "--executable", str(SCRIPT)]) == 0
    # verify checks that the EnvironmentFile= exists: point it into the root.
    text = under(tmp_path, UNIT_FILE).read_text().replace(
        f"EnvironmentFile={ENV_FILE}", f"EnvironmentFile={under(tmp_path, ENV_FILE)}")
    unit = tmp_path / "esi-sidecar.service"
    unit.write_text(text)
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "esi-sidecar.service" not in result.stderr, result.stderr


def verify(analyze: str, root: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on the unit written under ``root``, its EnvironmentFile=
    pointed into the root (verify checks that it exists)."""
    text = under(root, UNIT_FILE).read_text().replace(
        f"EnvironmentFile={ENV_FILE}", f"EnvironmentFile={under(root, ENV_FILE)}")
    unit = root / "esi-sidecar.service"
    unit.write_text(text)
    return subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)


def test_a_percent_in_the_executable_path_is_not_a_specifier(tmp_path: Path) -> None:
    """systemd expands %h in ExecStart= to a home folder: the path's % is written %%, and
    systemd then runs the file that is there (verify finds it executable). A $ is no
    variable in the executable's name and stays as it is."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    executable = tmp_path / "opt%h$HOME" / "bin" / "esi-sidecar"
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    root = tmp_path / "root"
    assert main(["install", "--root", str(root), "--executable", str(executable)]) == 0
    escaped = str(executable).replace("%h", "%%h")
    assert f"\nExecStart={escaped} serve\n" in under(root, UNIT_FILE).read_text()
    result = verify(analyze, root)
    assert result.returncode == 0 and "esi-sidecar.service" not in result.stderr, result.stderr


@pytest.mark.parametrize("executable", ["bin/esi-sidecar", "-/opt/esi-sidecar",
                                        "/opt/a'b/esi-sidecar", '/opt/a"b/esi-sidecar',
                                        "/opt/a\\x20b/esi-sidecar", "/opt/a\nb/esi-sidecar",
                                        "/opt/a\x7fb/esi-sidecar"])
def test_a_path_systemd_would_split_unquote_or_refuse_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], executable: str
) -> None:
    assert main(["install", "--root", str(tmp_path), f"--executable={executable}"]) == 2
    said = capsys.readouterr().err
    assert "not supported" in said or "must be an absolute path" in said, said
    assert list(tmp_path.iterdir()) == []


def test_install_sh_with_a_percent_in_the_prefix_writes_the_same_unit(tmp_path: Path) -> None:
    """install.sh's unit is the package's (%% in ExecStart=), and the command it shows for a
    start by hand is the real path, with its % as it is."""
    prefix = "/srv/esi%h"
    staged = tmp_path / "staged"
    staged.mkdir()
    reuse_venv(under(staged, prefix))
    checkout = copy_checkout(tmp_path / "checkout")
    result = run_install("--root", str(staged), "--prefix", prefix, "--python", sys.executable,
                         *FAST_PIP, script=checkout / "install.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert under(staged, UNIT_FILE).read_text() == unit_text(f"{prefix}/bin/esi-sidecar")
    assert "\nExecStart=/srv/esi%%h/bin/esi-sidecar serve\n" in unit_text(
        f"{prefix}/bin/esi-sidecar")
    assert f"exec {staged}/srv/esi%h/bin/esi-sidecar serve'" in result.stdout, result.stdout


def test_a_venv_in_a_home_on_a_python_in_roots_home_runs_under_real_systemd(
    booted_systemd: BootedSystemd, tmp_path: Path
) -> None:
    """The issue's host: a venv in a user's home made from a pyenv Python in root's home
    (this test's own base interpreter). Under a real systemd as PID 1 `esi-sidecar
    install` writes a unit that binds just those two folders in, read-only, and the
    service starts, says READY=1 and answers /healthz (issue 39, item 2)."""
    base = os.path.realpath(sys._base_executable)  # type: ignore[attr-defined]
    if not in_home(base):
        pytest.skip(f"this test's Python ({base}) is not under a home folder")
    systemd = booted_systemd
    checkout = copy_checkout(tmp_path / "checkout")
    venv = "/home/alice/esi"
    # A /home of the namespace's own (nothing lands in the host's), and in it a venv that
    # sees this test venv's packages, so pip needs no index (as reuse_venv does).
    steps = [("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/home"),
             (base, "-m", "venv", "--without-pip", venv)]
    for step in steps:
        done = systemd.run(*step)
        assert done.returncode == 0, done.stderr
    shared = systemd.share_test_packages()
    purelib = systemd.run(f"{venv}/bin/python", "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    pth = f"{purelib.stdout.strip()}/zz-test-reuse.pth"
    wrote = systemd.run("sh", "-c", f"printf '%s\\n' \"$1\" > {pth}", "sh", shared)
    assert wrote.returncode == 0, wrote.stderr
    made = systemd.run("bash", str(checkout / "install.sh"), "--venv-only", "--prefix", venv,
                       "--python", base, *FAST_PIP, env={**clean_environ(), "PATH": SYSTEMD_PATH})
    assert made.returncode == 0, made.stdout + made.stderr
    port = free_port()
    settings = (f"ESI_SIDECAR_SOURCE=static\nESI_SIDECAR_EXPIRES_AT={EXPIRES_AT}\n"
                f"ESI_SIDECAR_LISTEN=127.0.0.1:{port}\n")
    wrote = systemd.run("sh", "-c", f"install -d -m 700 /etc/esi-sidecar && umask 077 && "
                        f"printf '{settings}' > {ENV_FILE}")
    assert wrote.returncode == 0, wrote.stderr

    installed = systemd.run(f"{venv}/bin/esi-sidecar", "install")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    unit = unit_directives(systemd.run("cat", UNIT_FILE).stdout)
    assert unit["Service.ProtectHome"] == ["tmpfs"]
    assert sorted(unit["Service.BindReadOnlyPaths"]) == sorted(
        [venv, os.path.realpath(sys.base_prefix)])
    shown = systemd.show("ActiveState", "StatusText", "NRestarts")
    assert shown["ActiveState"] == "active", shown  # READY=1 reached systemd
    assert shown["StatusText"] == "ok" and shown["NRestarts"] == "0"
    health = fetch_json(f"http://127.0.0.1:{port}/healthz")
    assert health is not None and health[0] == 200
    # Every other home stays hidden: the service's /root holds only the bound path.
    main_pid = systemd.show("MainPID")["MainPID"]
    listed = systemd.run("ls", "-A", f"/proc/{main_pid}/root/root")
    assert listed.stdout.split() == [Path(base).relative_to("/root").parts[0]], listed

    removed = systemd.run(f"{venv}/bin/esi-sidecar", "uninstall")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert systemd.show("LoadState")["LoadState"] == "not-found"
