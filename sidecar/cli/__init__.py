"""``esi-sidecar``: serve, status, drill, check, env, emulate, restore, run, install, demo,
simulate.

``serve``, ``emulate`` and ``demo`` need the ``[server]`` extra and ``restore`` from S3 the
``[upload]`` extra (from a mounted volume, nothing more); ``status``,
``check`` and ``env`` use the stdlib client, so they also work inside a training
container that has only the base install. Server modules are imported inside the
commands that need them.

The package: this module holds the parser and ``main``; ``commands`` the small commands,
``status_view`` and ``drill`` the views on a running daemon (standard library only).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Optional

from sidecar import __version__
from sidecar.cli.commands import (
    ENV_EXPORT_NAME,
    EXIT_USAGE,
    METADATA_CLOUDS,
    cmd_check,
    cmd_emulate,
    cmd_env,
    cmd_restore,
    cmd_serve,
)
from sidecar.cli.drill import add_drill_parser
from sidecar.cli.status_view import EXIT_NOT_HEALTHY, EXIT_UNKNOWN, UsageError, cmd_status
from sidecar.train.client import DEFAULT_URL, ENV_URL
from sidecar.train.policy import DEFAULT_REDUNDANT_SECONDS, DEFAULT_SAVE_SECONDS

# stdout's reader closed it early (`| head -1`): the code a shell reports for a tool that
# SIGPIPE killed, so `set -o pipefail` scripts see the output was cut (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141

# ---------------------------------------------------------------------- parser


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}")
    return value


def _timeout(text: str) -> float:
    value = _positive_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


# The table's help lines speak of the upload; restore reads the same settings the other
# way round, so it says what each flag means to it (the [env ...] part is the table's).
_RESTORE_HELP = {
    "upload_to": "where to fetch the checkpoint from: s3://BUCKET/PREFIX on S3 or "
    "Volcengine TOS, or file:///PATH (or /PATH) on a mounted network volume; the --upload-to the "
    "daemon uploaded to",
    "upload_from": "local checkpoint folder to restore into: the root the training job "
    "resumes from with latest_valid()",
    "upload_region": "signing region (default: from a TOS endpoint's name, else boto3's "
    "chain, else us-east-1)",
    "upload_concurrency": "parts and files downloaded at once (default {default})",
}


def _say_what_restore_does(restore: argparse.ArgumentParser) -> None:
    from sidecar.host.upload.plan import DEFAULT_UPLOAD_CONCURRENCY  # standard library only

    for action in restore._actions:
        if action.dest in _RESTORE_HELP:
            variable = (action.help or "").rpartition(" [env ")[2]
            text = _RESTORE_HELP[action.dest].format(default=DEFAULT_UPLOAD_CONCURRENCY)
            action.help = text + (f" [env {variable}" if variable else "")


def build_parser() -> argparse.ArgumentParser:
    # The settings table (standard library only) defines serve's and restore's flags.
    from sidecar.host.settings import RESTORE_FLAGS, add_arguments

    parser = argparse.ArgumentParser(
        prog="esi-sidecar",
        description="Know when this reclaimable GPU machine will be released, and save the "
        "training checkpoint in time.",
        epilog="Quick look: esi-sidecar status    Docs: README.md and docs/    Any command "
        "whose output pipe closes early (| head -1) stops quietly with exit 141.",
    )
    parser.add_argument("--version", action="version", version=f"esi-sidecar {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the host daemon (needs the [server] extra)",
        # The settings, grouped by topic below, replace argparse's 23-line list of flags.
        usage="%(prog)s [-h] [--SETTING VALUE ...]",
        description="Poll the deadline sources and serve /v1/expiry, /v1/decision, /healthz "
        "and /metrics. Every flag has an ESI_SIDECAR_* variable; the flag wins. The "
        "settings by topic: listening, sources (then each source's own), polling, state "
        "and logging, checkpoint upload.",
    )
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    def client_options(sub: argparse.ArgumentParser, timeout: float = 2.0) -> None:
        sub.add_argument("--url", help="daemon URL(s), comma-separated (default: "
                         f"${ENV_URL}, else {DEFAULT_URL})")
        sub.add_argument("--timeout", type=_timeout, default=timeout,
                         help=f"seconds to wait for the daemon (default {timeout:g})")

    status = commands.add_parser(
        "status", help="show when this machine will be released",
        description="Ask the daemon and print the deadline in words. Exit 0: the daemon is "
        f"healthy (/healthz 200); {EXIT_NOT_HEALTHY}: it answers but is starting or degraded "
        f"(the reason on stderr); {EXIT_UNKNOWN}: unreachable; {EXIT_USAGE}: usage error. "
        "So `esi-sidecar status && python train.py` starts only a protected job.")
    client_options(status)
    status.add_argument("--wait-healthy", type=_timeout, default=None, metavar="SECONDS",
                        help="first wait up to SECONDS for /healthz to say ok (for scripts "
                        "started with the daemon), then print and exit as above")
    status.add_argument("--json", action="store_true", help="print the raw /v1/expiry body")
    status.add_argument("--watch", action="store_true",
                        help="keep showing it: redrawn in place every second on a terminal, "
                        "a timestamped block every 10 s elsewhere; Ctrl-C stops")
    status.add_argument("--interval", type=_positive_float, default=None,
                        help="seconds between redraws with --watch (default 1 on a terminal, "
                        "10 otherwise)")
    status.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)
    status.set_defaults(func=cmd_status)
    add_drill_parser(commands, _timeout)  # esi-sidecar drill (sidecar.cli.drill)

    check = commands.add_parser(
        "check",
        help="exit 0 when a checkpoint should be saved now",
        description="Apply the save rule: remaining <= step + save + redundant. Exit 0: save "
        "now; 1: not yet (or too late); 3: daemon unreachable or deadline unknown; "
        "2: usage error.",
    )
    client_options(check)
    check.add_argument("--step-seconds", type=_positive_float, required=True,
                       help="the longest recent training step, seconds")
    check.add_argument("--save-seconds", type=_positive_float, default=DEFAULT_SAVE_SECONDS,
                       help=f"how long one save takes (default {DEFAULT_SAVE_SECONDS:g})")
    check.add_argument("--redundant-seconds", type=_positive_float,
                       default=DEFAULT_REDUNDANT_SECONDS,
                       help=f"safety margin (default {DEFAULT_REDUNDANT_SECONDS:g})")
    check.set_defaults(func=cmd_check)

    env = commands.add_parser(
        "env",
        help="print the deadline as MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP=...",
        description="For `docker run --env-file`: the deadline in Unix seconds. A variable is "
        "frozen when the container starts; a moved deadline is only seen through the daemon.",
    )
    client_options(env)
    env.add_argument("--name", default=ENV_EXPORT_NAME, help=f"variable name (default "
                     f"{ENV_EXPORT_NAME})")
    env.set_defaults(func=cmd_env)

    emulate = commands.add_parser(
        "emulate",
        help="run a cloud emulator (for trying the daemon without a cloud)",
        description="A local fake of a cloud, in its wire format: by default the Volcengine "
        "ECS OpenAPI (DescribeInstances, DescribeScheduledInstances, DescribeSystemEvents, "
        "signature checked) and its metadata service; --cloud aws, gcp or azure for their "
        "instance metadata services and reclaim notices. Each has a JSON control API under "
        "/_emulator/ (printed at start).",
    )
    emulate.add_argument("--cloud", choices=("volcengine", *METADATA_CLOUDS),
                         default="volcengine", help="which cloud to fake (default volcengine; "
                         "the --access-key ... --release-at options are Volcengine's)")
    emulate.add_argument("--listen", default="127.0.0.1:9000", help="HOST:PORT (default "
                         "127.0.0.1:9000)")
    # The emulator's own keys, never the real VOLCENGINE_* variables: the command prints
    # them for copy-paste, and a real secret must not end up on a terminal.
    emulate.add_argument("--access-key", default="AKLTEMULATOR",
                         help="access key the emulator accepts (default AKLTEMULATOR)")
    emulate.add_argument("--secret-key", default="emulator-secret",
                         help="secret key it checks signatures with (default emulator-secret)")
    emulate.add_argument("--region", default="cn-beijing",
                         help="region it serves and signs for (default cn-beijing)")
    emulate.add_argument("--instance-id", default="i-emulator0001",
                         help="instance id from the metadata paths (default i-emulator0001)")
    emulate.add_argument("--scheduled-instance-id", default="esi-emulator0001",
                         help="its ScheduledInstanceId (default esi-emulator0001)")
    when = emulate.add_mutually_exclusive_group()
    when.add_argument("--release-in", type=_positive_float, default=3600.0, metavar="SECONDS",
                      help="release this many seconds from now (default 3600)")
    when.add_argument("--release-at", metavar="TIME", help="release at this time "
                      "(served verbatim as AutoReleaseAt)")
    emulate.set_defaults(func=cmd_emulate)

    restore = commands.add_parser(
        "restore",
        help="fetch the newest complete checkpoint from S3 / TOS or a mounted volume",
        description="Fetch the newest remote checkpoint whose MANIFEST.json exists (the "
        "uploader writes it last), verify every file against it and commit it into DIR so "
        "latest_valid(DIR) finds it. Credentials: ESI_SIDECAR_UPLOAD_ACCESS_KEY/_SECRET_KEY "
        "or boto3's chain (AWS_ACCESS_KEY_ID, ...). Exit 0: restored (or already there); "
        "3: no complete checkpoint (a fresh start); 1: failed; 2: usage error.",
    )
    # --from, --to, --endpoint, --region, --concurrency, --addressing-style: the daemon's
    # upload settings, from the one table (with their ESI_SIDECAR_UPLOAD_* variables).
    add_arguments(restore, flags=RESTORE_FLAGS)
    _say_what_restore_does(restore)
    restore.add_argument("--step", type=int, metavar="N",
                         help="this step instead of the newest")
    restore.add_argument("--no-verify", action="store_true",
                         help="skip the sha256 check (sizes are always checked)")
    restore.add_argument("-v", "--verbose", action="store_true", help="log progress")
    restore.add_argument("--released-at", metavar="TIME",
                         help="when the previous machine was released (RFC 3339 or Unix "
                         "seconds): also print the GPU time that release cost, from the "
                         "state restored to it, and post that account to the daemon "
                         "(--url; a daemon that is not there costs one line, not the "
                         "restore)")
    client_options(restore, timeout=5.0)
    restore.set_defaults(func=cmd_restore)

    from sidecar.host.launch import add_run_command  # standard library only

    add_run_command(commands)  # esi-sidecar run: restore, then the training command
    from sidecar.host.install_service import add_install_commands  # standard library only

    add_install_commands(commands)  # esi-sidecar install / uninstall: the systemd service
    from sidecar.tools.demo.run import add_demo_command
    from sidecar.tools.simulate.command import add_simulate_command

    add_demo_command(commands)
    add_simulate_command(commands)
    return parser


def _warn_if_not_ours() -> None:
    """One stderr line when `import sidecar` found another distribution's __init__.py (the
    JupyterLab widget's): then ours never ran its own check (issue 26)."""
    import sidecar

    if hasattr(sidecar, "CheckpointGuard") or not getattr(sidecar, "__file__", None):
        return
    from sidecar.train.importname import describe_clash

    message = describe_clash(Path(sidecar.__file__).parent, thorough=True)
    print(f"esi-sidecar: warning: {message or '`import sidecar` is not esi-sidecar'}",
          file=sys.stderr)


def _output_closed() -> int:
    """The reader of stdout went away (``esi-sidecar status | head -1``): end quietly, as
    a tool killed by SIGPIPE does. stdout now points at /dev/null, so the interpreter's
    flush at exit finds nothing to complain about (the recipe in Python's signal docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # pragma: no cover - stdout without a descriptor
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Optional[Sequence[str]] = None) -> int:
    _warn_if_not_ours()
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here (--help's exit too), not at exit
    except BrokenPipeError:
        return _output_closed()


def _run(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UsageError as exc:
        print(f"esi-sidecar {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
