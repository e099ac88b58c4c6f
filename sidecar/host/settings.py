"""Daemon settings: flags > ESI_SIDECAR_* environment > defaults, validated at start.

Each setting is written once, in ``OPTIONS``: the argparse flag, the environment name,
the parser, the default and the help text all come from that one row, so they cannot
drift apart. A source's own rows come from its module's spec (sidecar.host.sources.spec).
``Settings`` only stores values; the daemon does the work.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timezone, tzinfo
from pathlib import Path
from typing import Any, Optional

from sidecar.host.schedule import DEFAULT_MAX_API_RATE
from sidecar.host.setting_parsers import (
    is_loopback_url,
    parse_address,
    parse_addresses,
    parse_addressing_style,
    parse_api_rate,
    parse_bandwidth,
    parse_destination,
    parse_log_level,
    parse_part_size,
    parse_poll_schedule,
    parse_positive_int,
    parse_positive_seconds,
    parse_token,
    parse_zone,
)
from sidecar.host.sources import registry
from sidecar.host.sources.spec import ENV_PREFIX, Option, parse_boolean
from sidecar.host.sources.spec import parse_text as _text
from sidecar.host.sources.spec import parse_url as _url
from sidecar.host.upload.plan import (  # the upload defaults: pure, loads nothing else
    DEFAULT_UPLOAD_CONCURRENCY,
    DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS,
    DEFAULT_UPLOAD_PART_SIZE,
    DEFAULT_UPLOAD_SCAN_INTERVAL_SECONDS,
)
from sidecar.models import (
    DEFAULT_AWS_IMDS_URL,
    DEFAULT_AZURE_METADATA_URL,
    DEFAULT_GCP_METADATA_URL,
    DEFAULT_LISTEN,
    DEFAULT_METADATA_URL,
)
from sidecar.timeparse import TimestampError, parse_timestamp

__all__ = [
    "OPTIONS",
    "RESTORE_FLAGS",
    "ConfigError",
    "Option",
    "Settings",
    "add_arguments",
    "load_settings",
    "storage_options",
]

# The least --poll-interval against the cloud's API (issue 13): at the default 30 s a
# source makes 120 calls per host-hour, at 5 s 720, and a 1,000-host fleet running both
# Volcengine sources about 400 calls a second on one account. A shorter interval buys
# nothing: the guard asks once a second, the notices are minutes long, and the poller's
# own confirming polls come 5 s apart.
MIN_API_POLL_INTERVAL_SECONDS = 5.0
# Any source: below this a poll thread only spins.
MIN_POLL_INTERVAL_SECONDS = 0.1
# The sources that call the Volcengine OpenAPI every --poll-interval (auto may run them);
# aws, gcp and azure keep their own cadence, env and static call nothing.
API_SOURCES = ("auto", *sorted(s.name for s in registry.specs() if s.traits.api_budget))


class ConfigError(ValueError):
    """A bad setting. The message is one line and names the flag and the variable."""


@dataclass(frozen=True)
class Settings:
    listen: tuple[tuple[str, int], ...] = field(
        default_factory=lambda: (parse_address(DEFAULT_LISTEN),)
    )
    # Required from peers beyond loopback (sidecar.host.auth); from ESI_SIDECAR_TOKEN or
    # read from token_file at load.
    token: Optional[str] = field(default=None, repr=False)
    token_file: Optional[Path] = None
    # Loopback is shared (hostNetwork): writes need the token from loopback too.
    writes_need_token: bool = False
    sources: tuple[str, ...] = ("auto",)
    instance_id: Optional[str] = None
    scheduled_instance_id: Optional[str] = None
    region: Optional[str] = None
    api_endpoint: Optional[str] = None
    metadata_url: str = DEFAULT_METADATA_URL
    poll_interval: float = 30.0
    stale_after: Optional[float] = None  # None: 3 x poll_interval (see effective_stale_after)
    # The ESI release's schedule (sidecar.host.schedule, docs/polling.md) and the cap on
    # this host's OpenAPI calls per hour.
    poll_schedule: str = "adaptive"
    max_api_rate: Optional[float] = None  # None: see effective_max_api_rate
    state_file: Optional[Path] = None
    log_level: str = "INFO"
    expires_at: Optional[str] = None
    # --timezone; None: each source reads a time without an offset in its platform's zone.
    naive_timezone: Optional[tzinfo] = None
    # Checkpoint upload (sidecar.host.upload, docs/upload.md): off unless upload_to is set.
    upload_from: Optional[Path] = None
    upload_to: Optional[str] = None  # s3://bucket/prefix, checked at start
    upload_endpoint: Optional[str] = None
    upload_region: Optional[str] = None
    upload_access_key: Optional[str] = field(default=None, repr=False)  # never printed
    upload_secret_key: Optional[str] = field(default=None, repr=False)
    upload_concurrency: int = DEFAULT_UPLOAD_CONCURRENCY
    upload_part_size: int = DEFAULT_UPLOAD_PART_SIZE
    upload_keep_local: Optional[int] = None
    upload_near_release: float = DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS
    upload_scan_interval: float = DEFAULT_UPLOAD_SCAN_INTERVAL_SECONDS
    upload_addressing_style: str = "auto"
    upload_max_bandwidth: Optional[int] = None  # bytes per second; None: no cap
    upload_prefetch: bool = True  # the follower (upload/follower.py): on with upload
    # AWS EC2 (the aws source): the instance metadata service, IMDSv2 unless allowed.
    aws_imds_url: str = DEFAULT_AWS_IMDS_URL
    aws_imdsv1: bool = False
    # GCP (the gcp source) and Azure (the azure source): their metadata services.
    gcp_metadata_url: str = DEFAULT_GCP_METADATA_URL
    azure_metadata_url: str = DEFAULT_AZURE_METADATA_URL
    azure_approve: bool = False  # approve (StartRequests) once the checkpoint is durable
    # --notice: a source's notice in seconds (None: known far ahead), over its spec's
    # (sidecar.host.protection).
    notices: Mapping[str, Optional[float]] = field(default_factory=dict)
    # The options a source's spec declares that are no field here (a source added since:
    # its module and a registry line), by option name.
    source_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def effective_max_api_rate(self) -> Optional[float]:
        """The cap on this host's OpenAPI calls per hour: as set, else the default, except
        against a loopback --api-endpoint (the emulator: no account to protect)."""
        if self.max_api_rate is not None:
            return self.max_api_rate
        if self.emulated_api:
            return None
        return DEFAULT_MAX_API_RATE

    @property
    def emulated_api(self) -> bool:
        """A loopback --api-endpoint or --aws-ec2-endpoint: the emulator."""
        endpoints = (self.api_endpoint, self.source_options.get("aws_ec2_endpoint"))
        return any(isinstance(url, str) and is_loopback_url(url) for url in endpoints)

    @property
    def effective_stale_after(self) -> float:
        return self.stale_after if self.stale_after is not None else 3 * self.poll_interval


# ------------------------------------------- the parsers that read the source registry
# (the others: sidecar.host.setting_parsers)


def _source_names(text: str) -> tuple[str, ...]:
    names = [part for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("no source given")
    return tuple(dict.fromkeys(registry.canonical_name(name) for name in names))


def _notices(text: str) -> dict[str, Optional[float]]:
    """``gcp=15,aws=120``: per source, the notice its platform gives (``ahead``: far)."""
    from sidecar.train.protection import parse_notice

    notices: dict[str, Optional[float]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, seconds = item.partition("=")
        if not equals:
            raise ValueError(f"{item!r}: give SOURCE=SECONDS, e.g. gcp=15")
        source = registry.canonical_name(name)
        if source not in registry.SOURCES:
            raise ValueError(f"{item!r}: name one source, not {source}")
        notices[source] = parse_notice(seconds)
    if not notices:
        raise ValueError("give SOURCE=SECONDS, e.g. gcp=15")
    return notices


# ---------------------------------------------------------------- the one table

_DEFAULTS = Settings()  # the help lines quote the defaults from here, not a copy


def _source_help() -> str:
    """--source's help line, from the specs: what auto probes, what each source reads."""
    candidates = ", ".join(registry.auto_candidates())
    each = ", ".join(f"{s.name} ({s.summary})" if s.summary else s.name
                     for s in registry.specs())
    return (f"where the deadline comes from: auto (default: every one of {candidates} whose "
            f"metadata service answers here), {each}; comma-separate several (the earliest "
            "deadline wins)")


def _source_rows(*names: str, besides: tuple[str, ...] = ()) -> tuple[Option, ...]:
    """The rows the sources' specs declare: those of ``names``, or with ``besides``, of
    every source but those (a source added since lands there, in the registry's order)."""
    chosen = names or [name for name in registry.SOURCES if name not in besides]
    return tuple(replace(option, group=option.group or registry.spec(name).settings_group)
                 for name in chosen for option in registry.spec(name).options)


# The --help headings of the rows below (a source's rows: "the NAME source").
GROUP_LISTENING = "listening and access"
GROUP_SOURCES = "deadline sources"
GROUP_POLLING = "polling"
GROUP_STATE = "state and logging"
GROUP_UPLOAD = "checkpoint upload (docs/upload.md; s3:// needs the [upload] extra)"


OPTIONS: tuple[Option, ...] = (
    Option("listen", parse_addresses, f"address to serve on, HOST:PORT; repeat or comma-separate "
           f"for several, e.g. 127.0.0.1:8791,172.17.0.1:8791 (default {DEFAULT_LISTEN})",
           "HOST:PORT", repeatable=True, group=GROUP_LISTENING),
    Option("token", parse_token, "the token a peer beyond loopback must send (Authorization: "
           "Bearer); required to --listen on any address but loopback, 16 characters or "
           "more (openssl rand -hex 16); environment only, never logged or served", "TOKEN",
           env_only=True, group=GROUP_LISTENING),
    Option("token_file", Path, "read the token from this file instead (mode 600, readable "
           "by the service only)", "PATH", group=GROUP_LISTENING),
    Option("writes_need_token", parse_boolean, "every request but GET and HEAD needs the "
           "token from loopback too: set it where loopback is not this host alone (a pod with "
           "hostNetwork shares the node's loopback with every pod on it); needs the token: true or "
           "false (default false)",
           "BOOL", group=GROUP_LISTENING),
    Option("source", _source_names, _source_help(), "NAME", repeatable=True, group=GROUP_SOURCES),
    # The sources' own rows stand where they stood before the specs, so --help and the
    # docs keep their order.
    *_source_rows("volcengine-esi"),
    Option("poll_interval", parse_positive_seconds,
           f"seconds between polls (default {_DEFAULTS.poll_interval:g}, with +-10%% jitter; "
           "aws, gcp and azure keep their own cadence): at least "
           f"{MIN_API_POLL_INTERVAL_SECONDS:g} where the Volcengine OpenAPI is polled, "
           f"{MIN_POLL_INTERVAL_SECONDS:g} with a loopback --api-endpoint (the emulator) or "
           "sources that call no API", "SECONDS", group=GROUP_POLLING),
    Option("stale_after", parse_positive_seconds, "report stale when no poll succeeded for this "
           "long (default 3 x poll interval)", "SECONDS", group=GROUP_POLLING),
    Option("poll_schedule", parse_poll_schedule, "adaptive (default: while the ESI release is more "
           "than 15 min away, poll every 1/12 of the time left, at most every 15 min; "
           "--poll-interval in the final 15 min; docs/polling.md) or fixed (every "
           "--poll-interval)", "adaptive|fixed", group=GROUP_POLLING),
    Option("max_api_rate", parse_api_rate, "most OpenAPI calls per hour this host makes, all "
           f"sources together, retries included (default {DEFAULT_MAX_API_RATE:g}; none "
           "against a loopback --api-endpoint, the emulator); a call over it waits", "CALLS",
           group=GROUP_POLLING),
    Option("state_file", Path, "where the last good state is kept across restarts (default: "
           "$STATE_DIRECTORY/state.json under systemd, else none)", "PATH", group=GROUP_STATE),
    Option("notice", _notices, "the notice a source's platform gives, SOURCE=SECONDS (or "
           "ahead), repeatable, e.g. gcp=20 (default: each source's own: aws 120, gcp 30 or "
           "15 on a GKE node, azure 30, volcengine-spot 300; docs/protection.md)",
           "SOURCE=SECONDS", repeatable=True, group=GROUP_SOURCES),
    Option("log_level", parse_log_level, "DEBUG, INFO (default), WARNING, ERROR", "LEVEL",
           group=GROUP_STATE),
    *_source_rows("static"),
    Option("timezone", parse_zone, "time zone for timestamps that carry no offset (default: the "
           "source's platform's, the earliest plausible: UTC+8 for the Volcengine API and "
           "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP, UTC for AWS, GCP and "
           "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP; --expires-at needs an "
           "offset unless this is set)", "ZONE", group=GROUP_SOURCES),
    *_source_rows(besides=("volcengine-esi", "static")),  # aws, gcp, azure, ...
    Option("upload_from", Path, "checkpoint folder to upload from: the root that "
           "atomic_checkpoint writes into (upload is on when this and --upload-to are set)",
           "DIR", group=GROUP_UPLOAD),
    Option("upload_to", parse_destination, "where complete checkpoints go: "
           "s3://BUCKET/PREFIX on S3 or Volcengine TOS, or file:///PATH on a mounted network "
           "volume (vePFS, NAS, NFS); one prefix or folder per uploading host", "URL",
           group=GROUP_UPLOAD),
    Option("upload_endpoint", _url, "S3 endpoint, e.g. https://tos-s3-cn-beijing.volces.com "
           "for TOS (default: AWS S3)", "URL", group=GROUP_UPLOAD),
    Option("upload_region", _text, "signing region for the upload (default: from a TOS "
           "endpoint's name, else boto3's chain, else us-east-1)", group=GROUP_UPLOAD),
    Option("upload_access_key", _text, "access key for the upload (default: boto3's chain: "
           "AWS_ACCESS_KEY_ID, a profile, the instance role); environment only", "KEY",
           env_only=True, group=GROUP_UPLOAD),
    Option("upload_secret_key", _text, "secret key for the upload, with the access key; "
           "environment only, never logged or served", "SECRET", env_only=True, group=GROUP_UPLOAD),
    Option("upload_concurrency", parse_positive_int, f"parts and files uploaded at once "
           f"(default {_DEFAULTS.upload_concurrency})",
           "N", group=GROUP_UPLOAD),
    Option("upload_part_size", parse_part_size, f"multipart part size, 5MiB-5GiB "
           f"(default {_DEFAULTS.upload_part_size >> 20}MiB)",
           "SIZE", group=GROUP_UPLOAD),
    Option("upload_keep_local", parse_positive_int, "after an upload, delete local checkpoints "
           "beyond the N newest that are durable in storage (default: delete nothing)", "N",
           group=GROUP_UPLOAD),
    Option("upload_near_release", parse_positive_seconds, "when the release is this close, an "
           f"older upload in progress yields to the newest checkpoint "
           f"(default {_DEFAULTS.upload_near_release:g})",
           "SECONDS", group=GROUP_UPLOAD),
    Option("upload_scan_interval", parse_positive_seconds, "rescan the checkpoint folder this "
           f"often besides inotify events (default {_DEFAULTS.upload_scan_interval:g})", "SECONDS",
           group=GROUP_UPLOAD),
    Option("upload_max_bandwidth", parse_bandwidth, "cap the upload at this many bytes per "
           "second, e.g. 200MiB, when the uploader shares the NIC with training (default: "
           "no cap); the durability estimate uses it until an upload was measured", "RATE",
           group=GROUP_UPLOAD),
    Option("upload_prefetch", parse_boolean, "with --upload-from and --upload-to: bring the "
           "newest durable checkpoint into --upload-from at start, before any job, and newer "
           "ones until a job writes there (true, the default); it costs one checkpoint's "
           "bytes read and kept on the local disk when no job comes. false: a host that must "
           "not read the destination", "true|false", group=GROUP_UPLOAD),
    Option("upload_addressing_style", parse_addressing_style, "auto (default: path style for an IP "
           "or localhost endpoint, virtual-hosted otherwise), path or virtual", "STYLE",
           group=GROUP_UPLOAD),
)

# Option name -> Settings attribute, where they differ.
_ATTRIBUTE = {"source": "sources", "timezone": "naive_timezone", "notice": "notices"}
_FIELDS = frozenset(f.name for f in fields(Settings))


# `esi-sidecar restore` reads the upload settings through this same table, under its own
# flag names (None: environment only). The daemon's --upload-to is where restore reads from.
RESTORE_FLAGS: dict[str, Optional[str]] = {
    "upload_to": "--from",
    "upload_from": "--to",
    "upload_endpoint": "--endpoint",
    "upload_region": "--region",
    "upload_concurrency": "--concurrency",
    "upload_addressing_style": "--addressing-style",
    "upload_access_key": None,
    "upload_secret_key": None,
}


def _chosen(flags: Optional[Mapping[str, Optional[str]]]) -> list[tuple[Option, str]]:
    """The options a command reads, each with the flag that names it."""
    if flags is None:
        return [(option, option.flag) for option in OPTIONS]
    return [(option, flags[option.name] or option.env) for option in OPTIONS
            if option.name in flags]


def add_arguments(
    parser: argparse.ArgumentParser, flags: Optional[Mapping[str, Optional[str]]] = None
) -> None:
    """Add every option (or those in ``flags``, under those names) as a flag, under its
    group's heading (``serve``; a command that reads a few, as restore, lists them flat).
    Defaults stay None so we can tell 'not given'."""
    groups: dict[str, Any] = {}  # heading -> its argparse group, in the table's order
    for option, flag in _chosen(flags):
        if option.env_only:
            continue
        if flags is None and option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        groups.get(option.group, parser).add_argument(
            flag,
            dest=option.name,
            action="append" if option.repeatable else "store",
            metavar=option.metavar,
            help=f"{option.help} [env {option.env}]",
        )


def load_settings(
    given: Optional[Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
    *,
    flags: Optional[Mapping[str, Optional[str]]] = None,
) -> Settings:
    """Flags (``given``, e.g. ``vars(namespace)``) > environment > defaults.

    ``flags``: read only these options, named by these flags in errors (``RESTORE_FLAGS``);
    None reads them all, as ``serve`` does.
    """
    given = dict(given or {})
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    source_options: dict[str, Any] = {}  # a spec's rows that are no field of Settings
    given_as: dict[str, tuple[str, str]] = {}  # option name -> (flag or variable, raw text)
    for option, flag in _chosen(flags):
        raw = given.get(option.name)
        origin = flag
        if isinstance(raw, list):
            raw = ",".join(raw)
        if raw is None:
            raw = environ.get(option.env)
            origin = option.env
            if raw is not None and not raw.strip():
                raw = None  # an empty variable means "not set", as in the shell
        if raw is None:
            continue
        attribute = _ATTRIBUTE.get(option.name, option.name)
        try:
            parsed = option.parse(str(raw))
        except (ValueError, TimestampError) as exc:
            shown = "(hidden)" if option.env_only else repr(str(raw))
            raise ConfigError(f"invalid {origin} value {shown}: {exc}") from None
        (values if attribute in _FIELDS else source_options)[attribute] = parsed
        given_as[option.name] = (origin, str(raw))
    if "state_file" not in values and environ.get("STATE_DIRECTORY"):
        # systemd's StateDirectory= sets this (several paths are colon-separated).
        values["state_file"] = Path(environ["STATE_DIRECTORY"].split(":")[0]) / "state.json"
    if values.get("token_file") is not None:
        if "token" in values:
            raise ConfigError("set ESI_SIDECAR_TOKEN or --token-file (ESI_SIDECAR_TOKEN_FILE), "
                              "not both")
        from sidecar.host.auth import read_token_file

        origin = given_as["token_file"][0]
        try:
            values["token"] = read_token_file(values["token_file"])
        except ValueError as exc:
            raise ConfigError(f"invalid {origin}: {exc}") from None
    settings = Settings(**values, source_options=source_options)
    _check(settings)
    if "poll_interval" in given_as:
        _check_poll_interval(settings, *given_as["poll_interval"])
    if "static" in settings.sources and "expires_at" in given_as:
        _check_static_zone(settings, *given_as["expires_at"])
    return settings


def _check_static_zone(settings: Settings, origin: str, raw: str,
                       now: Optional[float] = None) -> None:
    """The static deadline is the operator's own: without an offset it is refused, not
    guessed, unless --timezone names the zone (issue 13); one already past is refused too
    (issue 39: it only warned, then served a release that had come)."""
    if settings.naive_timezone is None and parse_timestamp(raw).assumed_timezone is not None:
        raise ConfigError(
            f"invalid {origin} value {raw!r}: it has no UTC offset; add one "
            "(2030-01-01T08:00:00+08:00, or Z for UTC) or set --timezone "
            f"({ENV_PREFIX}TIMEZONE)"
        )
    zone = settings.naive_timezone or timezone.utc
    ago = (time.time() if now is None else now) - parse_timestamp(raw, naive_timezone=zone).unix
    if ago >= 0:
        raise ConfigError(f"invalid {origin} value {raw!r}: it passed {_ago(ago)} ago; give "
                          "the deadline to come")


def _ago(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _check_poll_interval(settings: Settings, origin: str, raw: str) -> None:
    """The cloud API's budget (MIN_API_POLL_INTERVAL_SECONDS); the emulator on a loopback
    endpoint, and sources that call no API, may poll faster, down to
    MIN_POLL_INTERVAL_SECONDS."""
    api = [name for name in settings.sources if name in API_SOURCES]
    if not api or settings.emulated_api:
        if settings.poll_interval < MIN_POLL_INTERVAL_SECONDS:
            raise ConfigError(f"invalid {origin} value {raw!r}: must be at least "
                              f"{MIN_POLL_INTERVAL_SECONDS:g} s")
        return
    if settings.poll_interval >= MIN_API_POLL_INTERVAL_SECONDS:
        return
    calls = 3600 / settings.poll_interval
    raise ConfigError(
        f"invalid {origin} value {raw!r}: must be at least {MIN_API_POLL_INTERVAL_SECONDS:g} s "
        f"where a cloud API is polled (--source {','.join(api)}): that is "
        f"{calls:,.0f} calls per source per host-hour, the default "
        f"{_DEFAULTS.poll_interval:g} s makes {3600 / _DEFAULTS.poll_interval:.0f}; only a "
        "loopback --api-endpoint or --aws-ec2-endpoint (the emulator) may be polled faster"
    )


def storage_options(settings: Settings) -> dict[str, Any]:
    """The arguments of ``sidecar.host.upload.storage_config.StorageConfig``: for the daemon's
    wiring and for ``esi-sidecar restore``, so neither reads the upload settings itself."""
    return {
        "endpoint": settings.upload_endpoint,
        "region": settings.upload_region,
        "access_key": settings.upload_access_key,
        "secret_key": settings.upload_secret_key,
        "addressing_style": settings.upload_addressing_style,
        "concurrency": settings.upload_concurrency,
        "part_size": settings.upload_part_size,
        "max_bandwidth": settings.upload_max_bandwidth,
    }


def _check(settings: Settings) -> None:
    from sidecar.host.auth import check_exposure

    exposed = check_exposure(settings.listen, settings.token, settings.writes_need_token)
    if exposed is not None:
        raise ConfigError(exposed)
    if "static" in settings.sources and settings.expires_at is None:
        raise ConfigError(
            "the static source needs a deadline: --expires-at TIME or ESI_SIDECAR_EXPIRES_AT"
        )
    if (settings.upload_to is None) != (settings.upload_from is None):
        raise ConfigError(
            "upload needs both --upload-from DIR (ESI_SIDECAR_UPLOAD_FROM) and --upload-to "
            "s3://BUCKET/PREFIX (ESI_SIDECAR_UPLOAD_TO)"
        )
    if (settings.upload_access_key is None) != (settings.upload_secret_key is None):
        raise ConfigError(
            "set both ESI_SIDECAR_UPLOAD_ACCESS_KEY and ESI_SIDECAR_UPLOAD_SECRET_KEY, or "
            "neither (to use boto3's chain)"
        )
    # Successful polls come every interval +-10 %: a bound under 1.2 x the interval would
    # flap to stale between two healthy polls.
    if settings.effective_stale_after < 1.2 * settings.poll_interval:
        raise ConfigError(
            f"--stale-after ({settings.effective_stale_after:g} s) must be at least 1.2 x "
            f"--poll-interval ({settings.poll_interval:g} s), or answers flap to stale"
        )
