"""``esi-sidecar``: serve, status, drill, check, env, emulate, restore, run, install, demo,
simulate.

``serve``, ``emulate`` and ``demo`` need the ``[server]`` extra and ``restore`` from S3 the
``[upload]`` extra (from a mounted volume, nothing more); ``status``,
``check`` and ``env`` use the stdlib client, so they also work inside a training
container that has only the base install. Server modules are imported inside the
commands that need them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar import __version__
from sidecar.train.client import DEFAULT_URL, ENV_URL
from sidecar.train.drill_cli import add_drill_parser
from sidecar.train.policy import DEFAULT_REDUNDANT_SECONDS, DEFAULT_SAVE_SECONDS, seed_rule
from sidecar.train.status_view import (  # noqa: F401  (re-exported: the CLI's names)
    EXIT_NOT_HEALTHY,
    EXIT_UNKNOWN,
    UsageError,
    cmd_status,
    describe,
    describe_job,
    describe_sources,
    describe_uploads,
    fetch_expiry,
    format_duration,
)

EXIT_SAVE_NOW = 0
EXIT_NOT_YET = 1
EXIT_USAGE = 2
# stdout's reader closed it early (`| head -1`): the code a shell reports for a tool that
# SIGPIPE killed, so `set -o pipefail` scripts see the output was cut (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141

ENV_EXPORT_NAME = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def cmd_check(args: argparse.Namespace) -> int:
    expiry = fetch_expiry(args)
    if expiry is None:
        return EXIT_UNKNOWN
    if expiry.remaining_seconds is None:
        print("unknown: no deadline is known")
        return EXIT_UNKNOWN
    save_now, budget = seed_rule(
        expiry.remaining_seconds, args.step_seconds, args.save_seconds, args.redundant_seconds
    )
    remaining = format_duration(expiry.remaining_seconds)
    if save_now:
        print(f"save now: {remaining} left <= budget {budget:g} s")
        return EXIT_SAVE_NOW
    if expiry.remaining_seconds <= 0:
        print(f"too late: the release time passed {format_duration(-expiry.remaining_seconds)}"
              " ago")
        return EXIT_NOT_YET
    print(f"not yet: {remaining} left > budget {budget:g} s")
    return EXIT_NOT_YET


def cmd_env(args: argparse.Namespace) -> int:
    expiry = fetch_expiry(args)
    if expiry is None:
        return EXIT_UNKNOWN
    if expiry.expires_at_unix is None:
        print("esi-sidecar: no deadline is known; nothing to export", file=sys.stderr)
        return EXIT_UNKNOWN
    print(f"{args.name}={int(expiry.expires_at_unix)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from sidecar.host.settings import ConfigError, load_settings
    except ImportError as exc:  # pragma: no cover - depends on the install
        return _missing_server_extra(exc)
    try:
        settings = load_settings(vars(args))
    except ConfigError as exc:
        print(f"esi-sidecar serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from sidecar.host.journal import configure_logging  # standard library only

    configure_logging(settings.log_level)  # <N> priorities under systemd's journal (issue 26)
    from sidecar.host.logscrub import install as scrub_credentials  # standard library only

    scrub_credentials()  # no credentials in the log, whatever the level (issue 13)
    try:
        from sidecar.host.daemon import run
    except ImportError as exc:
        return _missing_server_extra(exc)
    try:
        run(settings)
    except OSError as exc:
        print(f"esi-sidecar serve: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a source that rejects its settings
        print(f"esi-sidecar serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def cmd_emulate(args: argparse.Namespace) -> int:
    try:
        from sidecar.host.settings import parse_address  # standard library only

        host, port = parse_address(args.listen)
    except ValueError as exc:
        print(f"esi-sidecar emulate: invalid --listen {args.listen!r}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.cloud != "volcengine":
        return _emulate_metadata(args.cloud, host, port)
    from sidecar.tools.emulator import Emulator

    emulator = Emulator(
        access_key=args.access_key,
        secret_key=args.secret_key,
        region=args.region,
        instance_id=args.instance_id,
        scheduled_instance_id=args.scheduled_instance_id,
        auto_release_at=None,
    )
    if args.release_at is not None:
        emulator.set_release(args.release_at)
    else:
        emulator.set_release_in(args.release_in)
    url = _start_emulator(emulator, host, port)
    if url is None:
        return EXIT_USAGE
    when = args.release_at or f"in {args.release_in:g} s"
    print(f"Volcengine ECS emulator on {url} (release {when})")
    print("Point the daemon at it, in another terminal:")
    # Emulator credentials are not secrets; print them so the lines can be pasted as-is.
    print(f"  export VOLCENGINE_ACCESS_KEY={args.access_key} "
          f"VOLCENGINE_SECRET_KEY={args.secret_key}")
    print(f"  esi-sidecar serve --api-endpoint {url} --metadata-url {url} "
          "--poll-schedule fixed --poll-interval 5")
    print("  (a moved release is then seen within 5 s; by default, while the release is far, "
          "the daemon asks every 1/12 of the time left: an hour away, every 5 min)")
    print(f"Move the release:  curl -X POST {url}/_emulator/release -d '{{\"in_seconds\": 600}}'")
    print(f"Spot reclaim:      curl -X POST {url}/_emulator/event "
          "-d '{\"type\": \"SpotInstanceInterruption_Delete\"}'")
    print("  (the daemon reads system events with --source volcengine-esi,volcengine-events)")
    print(f"Spot notice:       curl -X POST {url}/_emulator/spot -d '{{\"in_seconds\": 300}}'")
    print("  (served at /latest/spot_instance_termination_time; --source volcengine-spot; "
          f"withdraw it: curl -X DELETE {url}/_emulator/spot)")
    return _serve_until_interrupted(emulator)


# cloud -> (emulator class, what it fakes, the serve flag, a notice to raise: path, body)
_METADATA_CLOUDS = {
    "aws": ("sidecar.tools.emulator.aws:AwsImdsEmulator", "AWS EC2 instance metadata (IMDSv2)",
            "--source aws --aws-imds-url", "interrupt", '{"in_seconds": 120}'),
    "gcp": ("sidecar.tools.emulator.gcp:GcpMetadataEmulator", "GCE metadata server",
            "--source gcp --gcp-metadata-url", "preempt", "{}"),
    "azure": ("sidecar.tools.emulator.azure:AzureImdsEmulator",
              "Azure Instance Metadata Service (Scheduled Events)",
              "--source azure --azure-metadata-url", "event",
              '{"type": "Preempt", "in_seconds": 30}'),
}


def _emulate_metadata(cloud: str, host: str, port: int) -> int:
    import importlib

    target, what, flags, verb, body = _METADATA_CLOUDS[cloud]
    module, _, name = target.partition(":")
    emulator = getattr(importlib.import_module(module), name)()
    url = _start_emulator(emulator, host, port)
    if url is None:
        return EXIT_USAGE
    print(f"{what} emulator on {url}")
    print("Point the daemon at it, in another terminal:")
    print(f"  esi-sidecar serve {flags} {url}")
    print(f"Raise a notice:    curl -X POST {url}/_emulator/{verb} -d '{body}'")
    print(f"Withdraw it:       curl -X POST {url}/_emulator/clear")
    print(f"Inject a fault:    curl -X POST {url}/_emulator/fault "
          "-d '{\"kind\": \"status\", \"status\": 503, \"count\": 3}'")
    return _serve_until_interrupted(emulator)


def _start_emulator(emulator: Any, host: str, port: int) -> Optional[str]:
    """The emulator's URL, or None after one line saying why it cannot listen (a port in
    use, an address not on this host), as ``serve`` says it."""
    try:
        return str(emulator.start(host=host, port=port))
    except OSError as exc:
        print(f"esi-sidecar emulate: cannot listen on {host}:{port}: {exc.strerror or exc} "
              "(another --listen HOST:PORT?)", file=sys.stderr)
        return None


def _serve_until_interrupted(emulator: Any) -> int:
    print("Ctrl-C to stop.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """Fetch the newest complete remote checkpoint into a folder (docs/upload.md)."""
    from sidecar.host.settings import RESTORE_FLAGS, ConfigError, load_settings, storage_options
    from sidecar.host.upload.fetch import restore_newest  # boto3 only for s3://
    from sidecar.host.upload.volume import RestoreError

    try:
        settings = load_settings(vars(args), flags=RESTORE_FLAGS)
    except ConfigError as exc:
        print(f"esi-sidecar restore: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if settings.upload_to is None or settings.upload_from is None:
        print("esi-sidecar restore: give --from s3://BUCKET/PREFIX (or file:///PATH) and --to "
              "DIR (or set ESI_SIDECAR_UPLOAD_TO and ESI_SIDECAR_UPLOAD_FROM)", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        restored = restore_newest(settings.upload_to, Path(settings.upload_from),
                                  storage_options(settings), step=args.step,
                                  verify_checksums=not args.no_verify)
    except RestoreError as exc:
        print(f"esi-sidecar restore: {exc}", file=sys.stderr)
        return exc.exit_code
    info = restored.info
    if restored.already_present:
        print(f"{info.path} is already the newest complete checkpoint (step {info.step}); "
              "nothing downloaded")
    else:
        print(f"restored {info.name} (step {info.step}, {info.total_bytes} bytes, "
              f"{len(info.files)} files) from {restored.source} into {info.path} "
              f"in {restored.seconds:.1f} s")
    if args.released_at is not None:
        from sidecar.host.restore_account import close_release_account
        from sidecar.train.client import SidecarClient

        try:
            urls = SidecarClient(args.url).urls
        except ValueError as exc:  # after the restore: the checkpoint is there all the same
            print(f"esi-sidecar restore: --url: {exc}; the account is not posted",
                  file=sys.stderr)
            urls = ()
        close_release_account(info.path, args.released_at, urls, args.timeout,
                              restored.seconds)
    return 0


def _missing_server_extra(exc: ImportError) -> int:
    print(f"esi-sidecar: the daemon needs the server extra ({exc.name} is missing): "
          "pip install 'esi-sidecar[server]'", file=sys.stderr)
    return EXIT_USAGE


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
    from sidecar.host.settings import DEFAULT_UPLOAD_CONCURRENCY  # standard library only

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
    add_drill_parser(commands, _timeout)  # esi-sidecar drill (sidecar.train.drill_cli)

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
    emulate.add_argument("--cloud", choices=("volcengine", *_METADATA_CLOUDS),
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
