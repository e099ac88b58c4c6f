"""What ``esi-sidecar status`` shows: the deadline, each source, the job, the uploads, and
the daemon's health (the exit codes scripts read); ``--watch`` and ``--wait-healthy``.
Standard library only: it runs in a training container with the base install.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime, timezone
from typing import Any, Optional

from sidecar.models import Expiry
from sidecar.train.client import SidecarClient

__all__ = [
    "EXIT_NOT_HEALTHY", "EXIT_UNKNOWN", "SayOnce", "UsageError", "cmd_status", "describe",
    "describe_job", "describe_protection", "describe_sources", "describe_uploads",
    "fetch_expiry", "format_duration",
]

EXIT_UNKNOWN = 3
# `esi-sidecar status`: the daemon answers but /healthz is not 200 (starting or degraded),
# so `esi-sidecar status && python train.py` does not go ahead unprotected (issue 26,
# item 4). 0: healthy; 3: unreachable, as before.
EXIT_NOT_HEALTHY = 4


def format_duration(seconds: float) -> str:
    """``3723`` -> ``1h 02m 03s``; ``90061`` -> ``1d 01h 01m 01s``; negative -> ``-5s``."""
    sign = "-" if seconds < 0 else ""
    total = int(abs(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days}d {hours:02d}h {minutes:02d}m {secs:02d}s"
    if hours:
        return f"{sign}{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{sign}{minutes}m {secs:02d}s"
    return f"{sign}{secs}s"


# kind -> (noun, verb) for the status line: "reclaimed in 2m 04s", "maintenance in 1h".
_WORDS = {"preemption-notice": ("reclaim", "reclaimed"),
          "scheduled-maintenance": ("maintenance", "maintenance")}


def describe(expiry: Expiry) -> list[str]:
    """Human-readable lines for ``esi-sidecar status``."""
    where = expiry.source or "no source"
    if expiry.age_seconds is not None:
        where += f", polled {format_duration(expiry.age_seconds)} ago"
    lines = []
    if expiry.expires_at_unix is None or expiry.remaining_seconds is None:
        lines.append(f"no scheduled release known ({where})")
    else:
        at = datetime.fromtimestamp(expiry.expires_at_unix, tz=timezone.utc)
        stamp = at.strftime("%Y-%m-%d %H:%M:%S UTC")
        noun, verb_in = _WORDS.get(expiry.kind or "", ("release", "releases"))
        if expiry.remaining_seconds > 0:
            verb = f"{verb_in} in {format_duration(expiry.remaining_seconds)}"
        else:
            verb = f"{noun} time passed {format_duration(-expiry.remaining_seconds)} ago"
        kind = "" if expiry.kind in (None, "scheduled-release") else f" [{expiry.kind}]"
        lines.append(f"{verb} at {stamp}{kind} ({where})")
    if expiry.instance_id or expiry.scheduled_instance_id:
        ids = [part for part in (expiry.instance_id, expiry.scheduled_instance_id) if part]
        lines.append("instance: " + " / ".join(ids))
    if expiry.assumed_timezone:
        lines.append(f"note: the API gave no UTC offset; read as {expiry.assumed_timezone}")
    if expiry.stale:
        lines.append("warning: stale - no recent successful poll; this may be out of date")
    if expiry.error:
        lines.append(f"last error: {expiry.error}")
    if len(expiry.notices) > 1 or any(n.get("advisory") for n in expiry.notices):
        lines.append("notices:")
        lines.extend("  " + _notice_line(notice) for notice in expiry.notices)
    return lines


def _notice_line(notice: dict[str, Any]) -> str:
    remaining = notice.get("remaining_seconds")
    if notice.get("advisory"):
        when = "advice"
    elif not isinstance(remaining, (int, float)):
        when = "no time"
    elif remaining > 0:
        when = f"in {format_duration(remaining)}"
    else:
        when = f"{format_duration(-remaining)} ago"
    detail = f"  {notice['detail']}" if notice.get("detail") else ""
    return f"{notice.get('source', '?'):<18} {notice.get('kind', '?'):<25} {when:<14}{detail}"


def describe_sources(health: Any) -> list[str]:
    """Which sources run and which --source auto left out, from a /healthz body: those
    whose service is not here on one line (why: /healthz), those refused one line each."""
    if not isinstance(health, dict):
        return []
    running = health.get("sources")
    skipped = health.get("skipped")
    lines = []
    if isinstance(running, dict) and running:
        lines.append("sources: " + ", ".join(sorted(running)))
    if isinstance(skipped, dict) and skipped:
        refused = {name: str(reason) for name, reason in skipped.items()
                   if str(reason).startswith(_REFUSED)}
        absent = sorted(name for name in skipped if name not in refused)
        if absent:
            lines.append(f"not on this machine: {', '.join(absent)} (why: /healthz)")
        lines.extend(f"left out: {name:<18} {reason[len(_REFUSED):]}"
                     for name, reason in sorted(refused.items()))
    return lines


# How the daemon marks a source whose service answered but refused (host/sources/auto.py).
_REFUSED = "refused: "
# A source's "no <cloud> credentials: set ..." sentence, up to the daemon's retry note.
_CREDENTIALS = re.compile(r"no (\w+) credentials: .*?(?= \(asked again|$)")


class SayOnce:
    """Shortens a credentials sentence already said (issue 39: `status` repeated the same
    one five times, once per source that needs those credentials)."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def line(self, text: str) -> str:
        def once(match: re.Match[str]) -> str:
            if match.group(0) in self.said:
                return f"no {match.group(1)} credentials (as above)"
            self.said.add(match.group(0))
            return match.group(0)

        return _CREDENTIALS.sub(once, text)

    def lines(self, texts: list[str]) -> list[str]:
        return [self.line(text) for text in texts]


# ---------------------------------------------------------------------- commands


class UsageError(Exception):
    """A bad argument found after parsing: one line on stderr, exit 2."""


def fetch_expiry(args: argparse.Namespace) -> Optional[Expiry]:
    try:
        client = SidecarClient(args.url, timeout=args.timeout)
    except ValueError as exc:
        raise UsageError(f"--url: {exc}") from None
    expiry = client.expiry()
    if expiry is None:
        # last_error names the URL already
        reason = client.last_error or f"{', '.join(client.urls)}: no answer"
        print(f"esi-sidecar: cannot reach the daemon: {reason}", file=sys.stderr)
        print("  is it running?  systemctl status esi-sidecar  |  esi-sidecar serve --help",
              file=sys.stderr)
    return expiry


def describe_job(events: Any, now: Optional[float] = None) -> list[str]:
    """The job's state, last checkpoint and durability, from a /v1/events body."""
    summary = events.get("summary") if isinstance(events, dict) else None
    if not isinstance(summary, dict) or not summary.get("job"):
        return []
    now = time.time() if now is None else now

    def ago(unix: Any) -> str:
        return "?" if not isinstance(unix, (int, float)) else format_duration(now - unix) + " ago"

    lines = [f"job: {summary['job']} {summary.get('state') or 'training'} (heard "
             f"{ago(summary.get('last_event_at_unix'))})"]
    budget, remaining = summary.get("budget_seconds"), summary.get("remaining_seconds")
    if isinstance(budget, (int, float)):
        told = ("" if not isinstance(remaining, (int, float)) else
                f" vs {format_duration(remaining)} left when it last decided")
        lines.append(f"  save budget {format_duration(budget)}{told}")
    step = summary.get("last_save_step")
    if step is not None:
        took = summary.get("last_save_seconds")
        took_text = "" if not isinstance(took, (int, float)) else f", took {took:.1f}s"
        lines.append(f"  last checkpoint: step {step} ({summary.get('last_save') or 'routine'}, "
                     f"{ago(summary.get('last_save_at_unix'))}{took_text})")
    durable = summary.get("last_durable_step")
    if durable is not None:
        lines.append(f"  durable: step {durable} ({ago(summary.get('last_durable_at_unix'))})")
    return lines


def describe_drills(drills: Any, now: Optional[float] = None) -> list[str]:
    """The drill under way or the last one, from a /v1/drill body (docs/drill.md)."""
    listed = drills.get("drills") if isinstance(drills, dict) else None
    if not isinstance(listed, list) or not listed or not isinstance(listed[0], dict):
        return []
    drill, now = listed[0], time.time() if now is None else now
    if drill.get("result") is None:
        left = drill.get("remaining_seconds")
        when = f"in {format_duration(left)}" if isinstance(left, (int, float)) and left > 0 \
            else "passed, waiting for the job's report"
        return [f"drill: {drill.get('id')} under way (its deadline {when})"]
    verdict = "FAIL: no answer" if drill["result"] == "no-answer" else drill.get("verdict")
    at = drill.get("decided_at_unix")
    ago = f", {format_duration(now - at)} ago" if isinstance(at, (int, float)) else ""
    return [f"last drill: {drill.get('id')} {verdict} ({drill.get('reason')}{ago})"]


def describe_uploads(uploads: Any) -> list[str]:
    """One line on the uploader, from a /v1/uploads body (none without an uploader)."""
    if not isinstance(uploads, dict) or not uploads.get("enabled"):
        return []
    step = uploads.get("last_durable_step")
    error = f" - {uploads['error']}" if uploads.get("error") else ""
    return [f"uploads: {uploads.get('status') or 'ok'}, last durable step "
            f"{'none' if step is None else step}{error}"]


def describe_protection(protection: Any) -> list[str]:
    """Each running source's protection verdict, from a /v1/protection body."""
    verdicts = protection.get("sources") if isinstance(protection, dict) else None
    if not isinstance(verdicts, list) or not verdicts:
        return []
    lines = ["protection:"]
    for verdict in verdicts:
        if isinstance(verdict, dict):
            lines.append(f"  {verdict.get('status', '?')!s:<14} {verdict.get('reason', '')}")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(args)
    health = _wait_healthy(args, args.wait_healthy) if args.wait_healthy else None
    expiry = fetch_expiry(args)
    if expiry is None:
        return EXIT_UNKNOWN
    health = health if _is_healthy(health) else _health(args)
    once = SayOnce()
    if args.json:
        import json

        print(json.dumps(expiry.to_json(), indent=2))
    else:
        # The verdicts before the sources: scripts read the sources' lines last
        # (the drills' lines follow only once a drill ran).
        print("\n".join(once.lines(describe(expiry)
                                  + describe_protection(_get_json(args, "/v1/protection"))
                                  + describe_sources(health)
                                  + describe_drills(_get_json(args, "/v1/drill")))))
    if _is_healthy(health):
        return 0
    verdict = health.get("status", "?") if isinstance(health, dict) else "no /healthz answer"
    reason = health.get("reason") if isinstance(health, dict) else None
    print(once.line(f"esi-sidecar: the daemon is not healthy: {verdict}"
                    + (f": {reason}" if reason else "")), file=sys.stderr)
    return EXIT_NOT_HEALTHY


def _is_healthy(health: Any) -> bool:
    return isinstance(health, dict) and health.get("status") == "ok"


def _wait_healthy(args: argparse.Namespace, seconds: float) -> Any:
    """Ask /healthz until it says ok or ``seconds`` pass; the last answer (None: none)."""
    deadline = time.monotonic() + seconds
    while True:
        health = _health(args)
        left = deadline - time.monotonic()
        if _is_healthy(health) or left <= 0:
            return health
        time.sleep(min(0.5, left))


def _watch(args: argparse.Namespace) -> int:
    """Redraw the status in place every --interval (1 s) on a terminal; elsewhere (a pipe,
    a log) print a timestamped block every --interval (10 s). Ctrl-C ends it."""
    try:
        client = SidecarClient(args.url, timeout=args.timeout)
    except ValueError as exc:
        raise UsageError(f"--url: {exc}") from None
    tty = sys.stdout.isatty()
    interval = args.interval if args.interval is not None else (1.0 if tty else 10.0)
    frames = 0
    try:
        while True:
            expiry = client.expiry()
            if expiry is None:
                lines = [f"daemon unreachable: {client.last_error or 'no answer'} "
                         "(still trying)"]
            else:
                lines = SayOnce().lines(
                    describe(expiry) + describe_sources(_health(args))
                    + describe_job(_get_json(args, "/v1/events?limit=0"))
                    + describe_uploads(_get_json(args, "/v1/uploads?limit=0"))
                    + describe_protection(_get_json(args, "/v1/protection"))
                    # the drill under way or the last one, as `status` shows it
                    + describe_drills(_get_json(args, "/v1/drill")))
            stamp = datetime.now(timezone.utc).strftime("%H:%M:%S UTC")
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + f"esi-sidecar status --watch   {stamp}   "
                                 "(Ctrl-C to stop)\n\n" + "\n".join(lines) + "\n")
            else:
                sys.stdout.write(f"--- {stamp}\n" + "\n".join(lines) + "\n")
            sys.stdout.flush()
            frames += 1
            if args.count is not None and frames >= args.count:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _health(args: argparse.Namespace) -> Any:
    """The /healthz body of the first daemon (200 or 503 alike), None when unreachable."""
    return _get_json(args, "/healthz")


def _get_json(args: argparse.Namespace, path: str) -> Any:
    """The JSON body of ``path`` on the first daemon (any status), None when unreachable or
    not JSON. Sends ``$ESI_SIDECAR_TOKEN`` as the client does."""
    import json
    import os
    import urllib.error
    import urllib.request

    from sidecar.train.client import ENV_TOKEN

    url = SidecarClient(args.url, timeout=args.timeout).urls[0] + path
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url)
    token = os.environ.get(ENV_TOKEN, "").strip()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with opener.open(request, timeout=max(args.timeout, 0.5)) as response:
            return json.loads(response.read(1 << 16))
    except urllib.error.HTTPError as exc:
        with exc:
            try:
                return json.loads(exc.read(1 << 16))
            except ValueError:
                return None
    except (OSError, ValueError):
        return None
