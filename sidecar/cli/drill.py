"""``esi-sidecar drill``: start a fire drill on one or more daemons, and with ``--wait``
print each verdict and its figures (docs/drill.md).

Standard library only, like ``esi-sidecar status``. Exit status: 0 every drill passed (or,
without ``--wait``, every drill started), 1 one failed (or was called off by a real
deadline), 2 refused or a usage error, 3 no job answered (no job is running: said at
once, without waiting; or none reported by the drill deadline + grace), 4 a daemon
unreachable. ``--wait`` prints where the drill stands every PROGRESS_SECONDS.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Optional

from sidecar.train.client import SidecarClient
from sidecar.train.daemon_request import daemon_request

__all__ = ["EXIT_FAIL", "EXIT_NO_ANSWER", "EXIT_PASS", "EXIT_REFUSED", "EXIT_UNREACHABLE",
           "cmd_drill", "describe_drill", "exit_code", "late_seconds", "progress_line"]

EXIT_PASS, EXIT_FAIL, EXIT_REFUSED, EXIT_NO_ANSWER, EXIT_UNREACHABLE = 0, 1, 2, 3, 4
POLL_SECONDS = 0.5
PROGRESS_SECONDS = 10.0  # --wait says where the drill stands this often
WAIT_SLACK_SECONDS = 30.0  # beyond the drill deadline + the daemon's grace


def _seconds(value: Any) -> str:
    return "?" if not isinstance(value, (int, float)) else f"{value:.1f} s"


def late_seconds(drill: dict[str, Any]) -> Optional[float]:
    """How long after the drill deadline its checkpoint became durable, by the guard's
    figures (``lead_seconds``; ``remaining_seconds`` less ``durable_seconds``); None when
    it was durable in time or no figure says. A PASS with a late checkpoint is a FAIL here
    whatever the daemon said (an older daemon counted it)."""
    figures = drill.get("figures") or {}
    lead, remaining, durable = (_number(figures.get(key)) for key in (
        "lead_seconds", "remaining_seconds", "durable_seconds"))
    leads = [x for x in (lead, None if remaining is None or durable is None
                         else remaining - durable) if x is not None]
    earliest = min(leads, default=None)
    return None if earliest is None or earliest >= 0 else -earliest


def _number(value: Any) -> Optional[float]:
    """``value`` as seconds, None unless a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def describe_drill(drill: dict[str, Any]) -> list[str]:
    """The verdict line and the figures behind it, from a drill of ``GET /v1/drill``."""
    verdict = drill.get("verdict") or drill.get("state") or "?"
    result = drill.get("result")
    late = late_seconds(drill) if result is not None else None
    label = "FAIL: no answer" if result == "no-answer" else verdict
    reason = drill.get("reason") or "waiting for the job"
    if result == "pass" and late is not None:
        label, reason = "FAIL", f"durable {late:.1f} s after the drill deadline"
    lines = [f"{drill.get('id')}: {label} - {reason}"]
    figures = drill.get("figures") or {}
    if figures:
        seconds = {key: _seconds(figures.get(key)) for key in (
            "budget_seconds", "save_seconds", "upload_seconds", "durable_seconds")}
        when = (f"{_seconds(figures.get('lead_seconds'))} before" if late is None
                else f"{late:.1f} s after")
        lines.append(
            f"  step {figures.get('step', '?')}; budget planned {seconds['budget_seconds']}; "
            f"save {seconds['save_seconds']}, upload {seconds['upload_seconds']}, durable "
            f"{seconds['durable_seconds']} after the save started; "
            f"{when} the drill deadline "
            f"(lead {_seconds(drill.get('lead_seconds'))}; job {figures.get('job', '?')})")
    return lines


def exit_code(drill: dict[str, Any]) -> int:
    """The exit status for a decided drill: PASS only when the daemon said so and no figure
    shows the checkpoint durable after the drill deadline."""
    if drill.get("result") == "pass" and late_seconds(drill) is not None:
        return EXIT_FAIL
    return {"pass": EXIT_PASS, "no-answer": EXIT_NO_ANSWER}.get(drill.get("result") or "",
                                                              EXIT_FAIL)


def _start(url: str, lead: Optional[float], timeout: float) -> tuple[int, Optional[dict]]:
    status, body = daemon_request(url, "POST", {} if lead is None else {"in_seconds": lead},
                                 timeout)
    if status is None:
        print(f"esi-sidecar drill: {url}: cannot reach the daemon: {body}", file=sys.stderr)
        return EXIT_UNREACHABLE, None
    if status != 201 or not isinstance(body, dict):
        error = body.get("error") if isinstance(body, dict) else body
        if isinstance(body, dict) and body.get("reason") == "no-job":
            # Nothing to rehearse: said at once, exit 3 (docs/drill.md).
            print(f"esi-sidecar drill: {url}: no job is running - {error}")
            return EXIT_NO_ANSWER, None
        print(f"esi-sidecar drill: {url}: refused (HTTP {status}): {error}", file=sys.stderr)
        return EXIT_REFUSED, None
    at = time.strftime("%H:%M:%S", time.localtime(body["expires_at_unix"]))
    print(f"{body['id']} started on {url}: drill deadline in {body['lead_seconds']:.0f} s "
          f"(at {at}); verdict by {body['grace_seconds']:.0f} s after it", flush=True)
    return EXIT_PASS, body


def progress_line(drill_id: str, expires_at_unix: float, verdict_by_unix: float,
                  now: float) -> str:
    """Where a drill stands, for ``--wait`` while no verdict has come."""
    if now < expires_at_unix:
        return (f"{drill_id}: waiting for the job's save: drill deadline in "
                f"{expires_at_unix - now:.0f} s")
    return (f"{drill_id}: drill deadline passed {now - expires_at_unix:.0f} s ago; waiting "
            f"for the job's report (no answer after {max(0.0, verdict_by_unix - now):.0f} s "
            "more)")


def _wait(url: str, started: dict[str, Any], timeout: float) -> int:
    verdict_by = started["expires_at_unix"] + started["grace_seconds"]
    give_up = verdict_by + WAIT_SLACK_SECONDS
    said_at = time.monotonic()
    while True:
        status, body = daemon_request(url, "GET", timeout=timeout)
        mine = None
        if status == 200 and isinstance(body, dict):
            mine = next((d for d in body.get("drills", ()) if d.get("id") == started["id"]),
                        None)
            if mine is None:  # the daemon restarted: its drills are gone
                print(f"{started['id']}: FAIL: no answer - the daemon at {url} no longer "
                      "knows this drill (restarted?)")
                return EXIT_NO_ANSWER
            if mine.get("result") is not None:
                print("\n".join(describe_drill(mine)))
                return exit_code(mine)
        if time.monotonic() - said_at >= PROGRESS_SECONDS:
            said_at = time.monotonic()
            print(progress_line(started["id"], started["expires_at_unix"], verdict_by,
                                time.time()), flush=True)
        if time.time() > give_up:
            print(f"{started['id']}: FAIL: no answer - no verdict from {url} by "
                  f"{WAIT_SLACK_SECONDS:.0f} s after the grace")
            return EXIT_NO_ANSWER
        time.sleep(POLL_SECONDS)


def cmd_drill(args: argparse.Namespace) -> int:
    lead: Optional[float] = args.in_seconds
    if lead is not None and (not math.isfinite(lead) or lead <= 0):
        print(f"esi-sidecar drill: --in: a positive number of seconds, got {lead:g}",
              file=sys.stderr)
        return EXIT_REFUSED
    try:
        urls = SidecarClient(",".join(args.url) if args.url else None).urls
    except ValueError as exc:
        print(f"esi-sidecar drill: --url: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    started, codes = [], []
    for url in urls:
        code, body = _start(url, lead, args.timeout)
        codes.append(code)
        if body is not None:
            started.append((url, body))
    if args.wait:
        codes += [_wait(url, body, args.timeout) for url, body in started]
    return _worst(codes)


def _worst(codes: list[int]) -> int:
    """FAIL over a refusal over no answer over unreachable over PASS."""
    for code in (EXIT_FAIL, EXIT_REFUSED, EXIT_NO_ANSWER, EXIT_UNREACHABLE):
        if code in codes:
            return code
    return EXIT_PASS


def add_drill_parser(commands: Any, timeout_type: Any) -> None:
    """The ``drill`` sub-command's options (wired in ``sidecar.cli``)."""
    drill = commands.add_parser(
        "drill", help="rehearse a release on the live job: save, upload, train on",
        description="Ask the daemon(s) for a drill deadline: the job's guard saves and "
        "uploads for it as for a release, then trains on. Exit 0 PASS, 1 FAIL, 2 refused, "
        "3 no job answered, 4 unreachable (docs/drill.md).")
    drill.add_argument("--in", dest="in_seconds", type=float, default=None, metavar="SECONDS",
                       help="drill deadline this many seconds from now (default: just over "
                       "the job's save budget as the daemon heard it)")
    drill.add_argument("--url", action="append", default=None,
                       help="a daemon URL; repeat it (or comma-separate) for several "
                       "(default: $ESI_SIDECAR_URL, else the local daemon)")
    drill.add_argument("--wait", action="store_true",
                       help="wait for each verdict and print it with its figures")
    drill.add_argument("--timeout", type=timeout_type, default=5.0,
                       help="seconds to wait for each answer of a daemon (default 5)")
    drill.set_defaults(func=cmd_drill)
