"""The ``esi-sidecar`` commands that are neither views nor tools: ``check``, ``env``,
``serve``, ``emulate``, ``restore``. The host is imported inside each command, lazily.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

from sidecar.cli.status_view import EXIT_UNKNOWN, fetch_expiry, format_duration
from sidecar.train.policy import seed_rule

EXIT_SAVE_NOW = 0
EXIT_NOT_YET = 1
EXIT_USAGE = 2

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
METADATA_CLOUDS = {
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

    target, what, flags, verb, body = METADATA_CLOUDS[cloud]
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
        from sidecar.cli.restore_account import close_release_account
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

