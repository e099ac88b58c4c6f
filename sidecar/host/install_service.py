"""``esi-sidecar install`` / ``uninstall``: put the packaged systemd unit and env file in place.

The unit and the env example ship in the wheel (``sidecar/host/deploy_files``, copies of
deploy/ made by the build), so ``pipx install 'esi-sidecar[server]'`` followed by
``sudo esi-sidecar install`` sets up the service with no checkout (issue 26, item 2).
deploy/esi-sidecar.service stays the one source of the unit, and this module the one
place that writes it: install.sh runs ``<venv>/bin/esi-sidecar install --unit-only`` after
it made the venv (it writes its own env file from its flags and starts the service).

An ``esi-sidecar`` run by an interpreter under a home folder (pyenv, conda, a venv made
from them) gets a unit that keeps just those folders readable (:mod:`home_paths`).

Standard library only. With ``--root DIR`` every path is written under DIR and systemctl
is never called (tests, image builds); ``--print`` writes nothing and always shows the
unit, a problem with it said on stderr.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from sidecar.host.home_paths import HomePathError, folders_to_read

__all__ = ["ENV_FILE", "UNIT_FILE", "add_install_commands", "exec_word", "find_executable",
           "unit_text"]

UNIT_NAME = "esi-sidecar.service"
UNIT_FILE = "/etc/systemd/system/esi-sidecar.service"
ENV_FILE = "/etc/esi-sidecar/esi-sidecar.env"
# The ExecStart of deploy/esi-sidecar.service: install.sh's default --prefix.
PACKAGED_EXEC = "/opt/esi-sidecar/bin/esi-sidecar"
EXIT_FAILED = 1
EXIT_USAGE = 2
PROTECT_HOME = "ProtectHome=yes\n"


class InstallError(Exception):
    """A host or a request the install cannot go on with (exit 2)."""


def packaged_file(name: str) -> str:
    """A file of deploy_files/ as text (inside the wheel, or the checkout's link)."""
    return (resources.files("sidecar.host") / "deploy_files" / name).read_text(encoding="utf-8")


def exec_word(executable: str) -> str:
    """``executable`` as the first word of ``ExecStart=``: systemd expands ``%``
    specifiers there (``%h`` is a home folder), so each ``%`` is written ``%%``; a path
    that is not absolute, or has a blank, a control character, a quote or a backslash
    (systemd splits, unquotes or refuses such a name), is an InstallError."""
    if not executable.startswith("/"):
        raise InstallError(f"{executable!r}: the executable must be an absolute path")
    if any(char.isspace() or not char.isprintable() or char in "\\'\"" for char in executable):
        raise InstallError(f"{executable!r}: an ExecStart path with blanks, control "
                           "characters, quotes or backslashes is not supported")
    return executable.replace("%", "%%")


def bind_word(folder: str) -> str:
    """``folder`` as a word of ``BindReadOnlyPaths=``: ``%`` written ``%%``; a blank, a
    quote, a backslash or a ``:`` (systemd's separators) is an InstallError."""
    if any(char.isspace() or not char.isprintable() or char in "\\'\":" for char in folder):
        raise InstallError(f"{folder!r}: a folder with blanks, control characters, quotes, "
                           "backslashes or colons cannot be bound into the unit's sandbox")
    return folder.replace("%", "%%")


def _readable_block(folders: Sequence[str]) -> str:
    return ("# esi-sidecar runs from under a home: the homes are an empty read-only tmpfs\n"
            "# with only the folders it needs bound in, read-only.\n"
            "ProtectHome=tmpfs\n"
            + "".join(f"BindReadOnlyPaths={bind_word(folder)}\n" for folder in folders))


def unit_text(executable: str, readable: Sequence[str] = ()) -> str:
    """The packaged unit with ExecStart naming ``executable`` (:func:`exec_word`):
    install.sh's ``$prefix/bin/esi-sidecar`` in place of the packaged /opt/esi-sidecar.
    ``readable``: folders under a home the service must read (``ProtectHome=tmpfs`` and a
    ``BindReadOnlyPaths=`` each, in place of ``ProtectHome=yes``)."""
    word = exec_word(executable)
    lines = packaged_file("esi-sidecar.service").splitlines(keepends=True)
    if f"ExecStart={PACKAGED_EXEC} serve\n" not in lines or PROTECT_HOME not in lines:
        raise InstallError(  # pragma: no cover - the packaged unit is tested
            f"the packaged unit lacks ExecStart={PACKAGED_EXEC} or {PROTECT_HOME.strip()}")
    for index, line in enumerate(lines):
        if line.startswith(f"ExecStart={PACKAGED_EXEC}"):
            lines[index] = f"ExecStart={word}{line[len('ExecStart=' + PACKAGED_EXEC):]}"
        elif line == PROTECT_HOME and readable:
            lines[index] = _readable_block(readable)
    return "".join(lines)


def find_executable(argv0: Optional[str] = None) -> str:
    """The ``esi-sidecar`` being run (pipx and ``uv tool`` link it from a bin folder), as
    an absolute path with links resolved; else the one on PATH."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    candidates = [argv0] if Path(argv0).name == "esi-sidecar" else []
    on_path = shutil.which("esi-sidecar")
    if on_path:
        candidates.append(on_path)
    for candidate in candidates:
        path = Path(candidate).resolve()
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise InstallError("no esi-sidecar executable found: give --executable PATH")


def _under(root: Optional[str], absolute: str) -> Path:
    return Path(root) / absolute.lstrip("/") if root else Path(absolute)


def _systemctl(*args: str) -> None:
    print(f"run: systemctl {' '.join(args)}")
    subprocess.run(["systemctl", *args], check=True)


def _can_call_systemctl(args: Any) -> bool:
    if args.root:
        print(f"staging root {args.root}: systemctl not called")
        return False
    if not Path("/run/systemd/system").is_dir():
        print("systemd is not running on this host (no /run/systemd/system): "
              "systemctl not called")
        return False
    return True


def _check_may_write(args: Any) -> None:
    if not args.root and not args.print and os.geteuid() != 0:
        raise InstallError("run as root (sudo esi-sidecar ...), or stage with --root DIR")


def _write(path: Path, text: str, mode: int) -> bool:
    """Give ``path`` this text and mode; a file that has both is left alone (a second
    install changes nothing, not even the mtime). True when it wrote."""
    try:
        if path.read_text(encoding="utf-8") == text and (path.stat().st_mode & 0o7777) == mode:
            print(f"unchanged: {path}")
            return False
    except (OSError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(temporary, mode)  # the umask does not narrow what systemd needs to read
    os.replace(temporary, path)
    print(f"wrote: {path} (mode {mode:o})")
    return True


def _folders_to_read(args: Any, executable: str) -> list[str]:
    """What the unit must keep readable under a home (never with --root: the paths there
    are not the host's). A problem stops an install; --print shows the unit and warns."""
    if args.root:
        return []
    try:
        folders = folders_to_read(executable)
    except HomePathError as exc:
        if not args.print:
            raise InstallError(str(exc)) from exc
        print(f"esi-sidecar {args.command}: warning: {exc}; the service would not start with "
              "the unit below", file=sys.stderr)
        return []
    if folders:
        print(f"esi-sidecar {args.command}: {executable} runs from under a home folder: the "
              f"unit keeps {', '.join(folders)} readable (read-only) and every other home "
              "hidden", file=sys.stderr)
    return folders


def install(args: Any) -> int:
    _check_may_write(args)
    executable = args.executable or find_executable()
    unit = unit_text(executable, _folders_to_read(args, executable))
    unit_path = _under(args.root, UNIT_FILE)
    env_path = _under(args.root, ENV_FILE)
    env_kept = env_path.exists()
    if args.unit_only:  # install.sh's step: the env file and systemctl are its own
        if args.print:
            print(unit, end="")
        else:
            _write(unit_path, unit, 0o644)
        return 0
    if args.print:
        print(f"# {unit_path}\n{unit}")
        if env_kept:
            print(f"# {env_path}: exists, kept")
        else:
            print(f"# {env_path} (mode 600)\n{packaged_file('esi-sidecar.env.example')}")
        if not args.root:
            print(f"# then: systemctl daemon-reload"
                  f"{'' if args.no_start else '; systemctl enable --now esi-sidecar'}")
        return 0
    _write(unit_path, unit, 0o644)
    if env_kept:
        print(f"kept: {env_path} (exists)")
    else:
        env_path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(env_path.parent, 0o700)  # the file holds credentials
        _write(env_path, packaged_file("esi-sidecar.env.example"), 0o600)
    if _can_call_systemctl(args):
        _systemctl("daemon-reload")
        if args.no_start:
            print("not started (--no-start): systemctl enable --now esi-sidecar")
        else:
            _systemctl("enable", "--now", "esi-sidecar")  # Type=notify: waits for READY=1
            print("service: systemctl status esi-sidecar   logs: journalctl -u esi-sidecar -f")
    print(f"settings: {env_path} (then systemctl restart esi-sidecar)")
    return 0


def uninstall(args: Any) -> int:
    _check_may_write(args)
    unit_path = _under(args.root, UNIT_FILE)
    env_path = _under(args.root, ENV_FILE)
    if args.print:
        print(f"would remove: {unit_path}" + (f", {env_path}" if args.purge else ""))
        return 0
    systemd = _can_call_systemctl(args)
    if systemd and unit_path.exists():
        _systemctl("disable", "--now", "esi-sidecar")
    if unit_path.exists():
        unit_path.unlink()
        print(f"removed: {unit_path}")
    if systemd:
        _systemctl("daemon-reload")
    if args.purge:
        if env_path.exists():
            env_path.unlink()
            print(f"removed: {env_path}")
        if env_path.parent.is_dir() and not any(env_path.parent.iterdir()):
            env_path.parent.rmdir()
    elif env_path.exists():
        print(f"kept: {env_path} (your settings; --purge removes it)")
    return 0


def cmd_install(args: Any) -> int:
    try:
        return uninstall(args) if args.remove else install(args)
    except InstallError as exc:
        print(f"esi-sidecar {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"esi-sidecar {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def add_install_commands(commands: Any) -> None:
    """The ``install`` and ``uninstall`` sub-commands, on the CLI's sub-parsers."""
    for name in ("install", "uninstall"):
        removing = name == "uninstall"
        parser = commands.add_parser(
            name,
            help="remove the systemd service" if removing else
            "install the systemd service (unit and env file) and start it",
            description=(
                f"Run `systemctl disable --now esi-sidecar`, remove {UNIT_FILE} and keep "
                f"{ENV_FILE} (--purge removes it)." if removing else
                f"Write {UNIT_FILE} (ExecStart: this esi-sidecar) and {ENV_FILE} (the "
                "settings example, mode 600; an existing one is kept), then `systemctl "
                "daemon-reload` and `systemctl enable --now esi-sidecar`.")
            + " Exit 0: done; 1: a step failed; 2: usage or a host that cannot run it.",
        )
        parser.add_argument("--print", action="store_true",
                            help="show what would be written or removed; change nothing")
        parser.add_argument("--root", metavar="DIR",
                            help="write under this root prefix and never call systemctl "
                            "(tests, image builds)")
        parser.add_argument("--purge", action="store_true",
                            help="with uninstall: also remove the env file")
        if removing:
            parser.set_defaults(func=cmd_install, remove=True, no_start=False,
                                executable=None, unit_only=False)
            continue
        parser.add_argument("--remove", action="store_true", help="the same as uninstall")
        parser.add_argument("--no-start", action="store_true",
                            help="reload systemd, but do not enable or start the service")
        parser.add_argument("--executable", metavar="PATH",
                            help="the esi-sidecar ExecStart runs (default: this one)")
        parser.add_argument("--unit-only", action="store_true",
                            help="only the unit (with --print: its text alone); no env file, "
                            "no systemctl: what install.sh runs")
        parser.set_defaults(func=cmd_install)
