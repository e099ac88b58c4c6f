"""``esi-sidecar run``: restore the newest durable checkpoint, run the training command,
and exit with a code a job launcher understands (docs/launch.md).

Standard library only (a ``file://`` volume needs nothing more; ``s3://`` loads boto3 from
the ``[upload]`` extra), so it runs in a training image with the base install. It lives on
the host side because it reads the upload settings (``ESI_SIDECAR_UPLOAD_*``, the one
table) and the uploader's restore; the CLI imports it lazily, as the layout rules ask.

The command runs as a child in its own process group; SIGTERM, SIGINT, SIGHUP, SIGUSR1
and SIGUSR2 sent to the launcher are passed on to that whole group (a ``torchrun`` and
its workers alike), once each: a Ctrl-C on a terminal reaches the launcher alone and is
forwarded, never delivered twice.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from sidecar.train.release_wait import EXIT_RELEASED

__all__ = [
    "EXIT_CANNOT_EXECUTE",
    "EXIT_NOT_FOUND",
    "EXIT_RELEASED",
    "EXIT_RESTORE_FAILED",
    "EXIT_USAGE",
    "FORWARDED_SIGNALS",
    "add_run_command",
    "exit_status",
    "run_command",
]

EXIT_USAGE = 2
# Nothing was run: the restore failed (volume not mounted, storage refused, a copy that
# does not match its manifest). Training from scratch over a lost checkpoint would be
# worse, so it stops; sysexits' EX_IOERR, a code training scripts do not use.
EXIT_RESTORE_FAILED = 74
EXIT_CANNOT_EXECUTE = 126  # the shell's codes: found but not executable; not found
EXIT_NOT_FOUND = 127

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                     signal.SIGUSR2)

# --restore-from and --to are the upload settings read the other way round (as restore
# reads them); endpoint, region and keys come from their ESI_SIDECAR_UPLOAD_* variables.
RUN_FLAGS: dict[str, Optional[str]] = {
    "upload_to": "--restore-from",
    "upload_from": "--to",
    "upload_endpoint": None,
    "upload_region": None,
    "upload_concurrency": None,
    "upload_addressing_style": None,
    "upload_access_key": None,
    "upload_secret_key": None,
}


def exit_status(returncode: int) -> int:
    """A child's ``returncode`` as a shell reports it: its own code, or 128 + N when
    signal N ended it (``Popen`` gives -N)."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pid, signum)


def _own_group() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.9 and 3.10


def run_command(command: Sequence[str], env: Optional[dict[str, str]] = None) -> int:
    """Run ``command`` in its own process group, forward :data:`FORWARDED_SIGNALS` to the
    group, and return :func:`exit_status` of it (127 / 126 when it cannot start).

    A signal that comes before the child exists is kept and sent once it does; the
    previous handlers come back afterwards. Call from the main thread."""
    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(signum: int, frame: Optional[FrameType]) -> None:
        if child:
            _signal_group(child[0].pid, signum)
        else:
            pending.append(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        try:
            child.append(subprocess.Popen(list(command), env=env, **_own_group()))
        except FileNotFoundError:
            print(f"esi-sidecar run: {command[0]}: command not found", file=sys.stderr)
            return EXIT_NOT_FOUND
        except OSError as exc:  # a folder, no execute permission, a bad interpreter line
            print(f"esi-sidecar run: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_CANNOT_EXECUTE
        for signum in pending:
            _signal_group(child[0].pid, signum)
        returncode = child[0].wait()  # retried after each handler (PEP 475)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    status = exit_status(returncode)
    if status == EXIT_RELEASED:
        print(f"esi-sidecar run: released (exit {EXIT_RELEASED}): resume on the next machine",
              file=sys.stderr)
    elif returncode < 0:
        name = signal.Signals(-returncode).name
        print(f"esi-sidecar run: the command was killed by {name} (exit {status})",
              file=sys.stderr)
    return status


def restore_before(args: argparse.Namespace) -> Optional[int]:
    """Restore when ``--restore-from`` (or its variable) is given: None to go on (restored,
    already there, or nothing yet: a first start), else the exit code to stop with."""
    from sidecar.host.settings import ConfigError, load_settings, storage_options
    from sidecar.host.upload.fetch import restore_newest
    from sidecar.host.upload.volume import EXIT_NOTHING, RestoreError

    try:
        settings = load_settings(vars(args), flags=RUN_FLAGS)
    except ConfigError as exc:
        print(f"esi-sidecar run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    assert settings.upload_to is not None and settings.upload_from is not None
    try:
        restored = restore_newest(settings.upload_to, Path(settings.upload_from),
                                  storage_options(settings))
    except RestoreError as exc:
        if exc.exit_code == EXIT_NOTHING:
            print(f"esi-sidecar run: nothing to restore ({exc}): starting fresh",
                  file=sys.stderr)
            return None
        print(f"esi-sidecar run: restore failed, the command was not run: {exc}",
              file=sys.stderr)
        return EXIT_USAGE if exc.exit_code == EXIT_USAGE else EXIT_RESTORE_FAILED
    info = restored.info
    how = "already there" if restored.already_present else \
        f"restored from {restored.source} in {restored.seconds:.1f} s"
    print(f"esi-sidecar run: {info.path} (step {info.step}) {how}", file=sys.stderr)
    return None


def _env(name: str) -> str:
    """The ESI_SIDECAR_* variable of the setting ``name``, from the settings table."""
    from sidecar.host.settings import OPTIONS

    (option,) = [option for option in OPTIONS if option.name == name]
    return option.env


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.run_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("esi-sidecar run: give the command after --: esi-sidecar run [--restore-from "
              "URL --to DIR] -- python train.py", file=sys.stderr)
        return EXIT_USAGE
    # The flags, else the ESI_SIDECAR_UPLOAD_TO / _FROM that `restore` reads too (issue 39:
    # run ignored them): each named by the one settings table.
    asked = {name: getattr(args, name) is not None or bool(os.environ.get(_env(name), "").strip())
             for name in ("upload_to", "upload_from")}
    if asked["upload_to"] != asked["upload_from"]:
        print(f"esi-sidecar run: --restore-from ({_env('upload_to')}) and --to "
              f"({_env('upload_from')}) go together", file=sys.stderr)
        return EXIT_USAGE
    stop = restore_before(args) if asked["upload_to"] else None
    if stop is not None:
        return stop
    return run_command(command)


def add_run_command(commands: Any) -> None:
    """The ``run`` sub-command, on the CLI's sub-parsers."""
    run = commands.add_parser(
        "run",
        help="restore the newest checkpoint, then run the training command",
        description="Restore the newest complete checkpoint from --restore-from into --to "
        "(when given; none yet is a fresh start), then run the command after --, passing "
        "SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 on to its process group. Exit: the "
        f"command's own code ({EXIT_RELEASED}: released, resume on another machine); 128+N "
        f"when signal N killed it; {EXIT_RESTORE_FAILED}: restore failed, nothing run; "
        f"{EXIT_NOT_FOUND}: command not found; {EXIT_CANNOT_EXECUTE}: not executable; "
        f"{EXIT_USAGE}: usage error. S3 settings: ESI_SIDECAR_UPLOAD_ENDPOINT, _REGION, "
        "_ACCESS_KEY, _SECRET_KEY (docs/launch.md).",
    )
    run.add_argument("--restore-from", dest="upload_to", metavar="URL",
                     help="s3://BUCKET/PREFIX or file:///PATH: where the daemon uploaded to "
                     "(the daemon's --upload-to)")
    run.add_argument("--to", dest="upload_from", metavar="DIR",
                     help="local checkpoint folder the command resumes from")
    run.add_argument("run_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                     help="the training command and its arguments")
    run.set_defaults(func=cmd_run)
