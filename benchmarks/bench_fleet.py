"""A fleet of hosts polling one account: the fixed schedule vs the adaptive one.

Run alone: ``python -m benchmarks --only fleet``.

N hosts (100, 1,000, 5,000), each an ESI instance whose release comes 2 to 6 hours after
the start (uniformly spread), poll one account whose API admits ``ACCOUNT_RATE`` calls a
second (bursts of one second's worth; beyond it the service answers 429 Throttling.User).
Ten minutes before its release, each host's release moves 30 minutes later (a renewal),
and the host must see it. The pollers are the daemon's own rules, called as the poller
calls them: ``next_delay`` (the fixed schedule, the failure and throttling backoff),
``adaptive_interval``, ``jittered`` and ``retry_cap`` (the adaptive schedule), each host's
``ApiBudget`` (``--max-api-rate``, 720 an hour), and the emulator's ``AccountLimit`` as
the account; all on a simulated clock, one event queue for the fleet, so thousands of
hosts' hours take seconds. What is not simulated: the HTTP round trip (milliseconds on a
real API; it delays nothing here) and the source's first DescribeInstances.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from sidecar.host.poller import next_delay
from sidecar.host.schedule import (
    NEAR_SECONDS,
    ApiBudget,
    adaptive_interval,
    jittered,
    retry_cap,
)
from sidecar.tools.emulator.state import AccountLimit

__all__ = ["main", "simulate"]

BASE = 30.0  # --poll-interval (the default)
ACCOUNT_RATE = 20.0  # calls per second for the account (an assumption: not documented)
RELEASE_FROM, RELEASE_TO = 2 * 3600.0, 6 * 3600.0
MOVE_BEFORE = 600.0  # the release moves this long before it would have come
MOVE_BY = 1800.0  # ... this much later
SAMPLE_EVERY = 5.0  # staleness is sampled this often in each host's final window


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Host:
    release: float  # the true release time (moves once)
    moved_at: float
    budget: ApiBudget
    failures: int = 0
    successes: list[float] = field(default_factory=list)  # success times
    seen_move: float = math.inf  # the first success after the move
    calls_far: int = 0  # attempts while the release was more than an hour away
    calls_near: int = 0  # attempts in the final 15 minutes


def simulate(hosts: int, schedule: str, seed: int = 0,
             account_rate: float = ACCOUNT_RATE) -> dict[str, Any]:
    rng = random.Random(seed)
    clock = SimClock()
    account = AccountLimit(account_rate, burst=account_rate, clock=clock)
    fleet = []
    queue: list[tuple[float, int]] = []
    for index in range(hosts):
        original = rng.uniform(RELEASE_FROM, RELEASE_TO)
        fleet.append(Host(release=original, moved_at=original - MOVE_BEFORE,
                          budget=ApiBudget(720.0, monotonic=clock)))
        queue.append((rng.uniform(0, BASE), index))  # daemons started within 30 s
    heapq.heapify(queue)
    far_time = sum(max(0.0, h.release - 3600.0) for h in fleet)  # host-seconds > 1 h away
    attempts = throttled = 0
    while queue:
        now, index = heapq.heappop(queue)
        host = fleet[index]
        clock.now = now
        if now >= host.moved_at and host.release < host.moved_at + MOVE_BEFORE + MOVE_BY:
            host.release = host.moved_at + MOVE_BEFORE + MOVE_BY  # the renewal
        if now >= host.release:
            continue  # released: this daemon is gone
        wait = host.budget.take()
        if wait > 0:
            heapq.heappush(queue, (now + wait, index))
            continue
        attempts += 1
        remaining = host.release - now
        if remaining > 3600:
            host.calls_far += 1
        elif remaining <= NEAR_SECONDS:
            host.calls_near += 1
        if account.allow():
            host.failures = 0
            host.successes.append(now)
            if now >= host.moved_at and host.seen_move == math.inf:
                host.seen_move = now
            if schedule == "adaptive":
                delay = jittered(adaptive_interval(remaining, BASE), BASE, rng)
            else:
                delay = next_delay(BASE, 0, rng=rng)
        else:
            throttled += 1
            host.failures += 1
            cap = retry_cap(host.release - now if host.successes else None, BASE) if (
                schedule == "adaptive") else BASE
            delay = next_delay(cap, host.failures, throttled=True, rng=rng)
        heapq.heappush(queue, (now + delay, index))
    return _figures(fleet, attempts, throttled, far_time)


def _p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _staleness(host: Host, start: float, end: float) -> list[float]:
    """The age of the served answer, sampled every SAMPLE_EVERY s in [start, end)."""
    ages, successes, at = [], host.successes, 0
    t = start
    while t < end:
        while at + 1 < len(successes) and successes[at + 1] <= t:
            at += 1
        if successes and successes[at] <= t:
            ages.append(t - successes[at])
        t += SAMPLE_EVERY
    return ages


def _figures(fleet: list[Host], attempts: int, throttled: int,
             far_time: float) -> dict[str, Any]:
    near_stale: list[float] = []
    delays = []
    for host in fleet:
        # The final 15 minutes before the (moved) release.
        near_stale += _staleness(host, host.release - NEAR_SECONDS, host.release)
        delays.append(host.seen_move - host.moved_at)
    # Within 15 min of a release: the 5 min of the first before it moved, then the whole
    # final window of the moved one.
    near_time = len(fleet) * (NEAR_SECONDS - MOVE_BEFORE + NEAR_SECONDS)
    return {
        "hosts": len(fleet),
        "calls": attempts,
        "far_per_host_hour": sum(h.calls_far for h in fleet) / (far_time / 3600.0),
        "near_per_host_hour": sum(h.calls_near for h in fleet) / (near_time / 3600.0),
        "throttled_fraction": throttled / attempts if attempts else 0.0,
        "p99_staleness_near_s": _p99(near_stale),
        "p99_move_delay_s": _p99(delays),
        "missed_moves": sum(1 for d in delays if math.isinf(d)),
    }


def main(quick: bool = False) -> dict[str, Any]:
    sizes = (100, 1000) if quick else (100, 1000, 5000)
    rows, runs = [], {}
    started = time.monotonic()
    for size in sizes:
        for schedule in ("fixed", "adaptive"):
            t0 = time.monotonic()
            result = simulate(size, schedule)
            result["seconds"] = time.monotonic() - t0
            runs[f"{schedule}-{size}"] = result
            rows.append([f"{size:,}", schedule, f"{result['calls']:,}",
                         f"{result['far_per_host_hour']:.1f}",
                         f"{result['near_per_host_hour']:.1f}",
                         f"{100 * result['throttled_fraction']:.1f} %",
                         f"{result['p99_staleness_near_s']:.0f}",
                         f"{result['p99_move_delay_s']:.0f}",
                         str(result["missed_moves"])])
            print(f"    {size:>5} hosts {schedule:8s}: far {result['far_per_host_hour']:.1f}"
                  f"/h, near {result['near_per_host_hour']:.1f}/h, throttled "
                  f"{100 * result['throttled_fraction']:.1f} %, p99 move delay "
                  f"{result['p99_move_delay_s']:.0f} s ({result['seconds']:.1f} s)",
                  flush=True)
    took = time.monotonic() - started
    adaptive = [runs[f"adaptive-{n}"] for n in sizes]
    fixed = [runs[f"fixed-{n}"] for n in sizes]
    return {
        "title": "Fleet: one account's API budget, fixed vs adaptive schedule",
        "description": " ".join((__doc__ or "").split("\n\n")[2].split()),
        "tables": [{
            "title": f"{' / '.join(f'{n:,}' for n in sizes)} hosts, account limit "
                     f"{ACCOUNT_RATE:g} calls/s, --poll-interval {BASE:g} s ({took:.0f} s "
                     "to simulate)",
            "columns": ["hosts", "schedule", "API calls", "calls per host-hour (> 1 h "
                        "away)", "calls per host-hour (final 15 min)", "throttled",
                        "p99 staleness, final 15 min (s)",
                        "p99 delay to see a move 10 min before (s)", "moves never seen"],
            "rows": rows,
        }],
        "targets": [
            {"target": "<= 12 calls per host-hour while the release is more than an hour "
                       "away (adaptive)",
             "measured": ", ".join(f"{r['far_per_host_hour']:.1f}" for r in adaptive),
             "met": all(r["far_per_host_hour"] <= 12 for r in adaptive)},
            {"target": "the same notice latency as today in the final 15 minutes (p99 "
                       "delay to see a move, adaptive vs fixed at 100 hosts)",
             "measured": f"{adaptive[0]['p99_move_delay_s']:.0f} s vs "
                         f"{fixed[0]['p99_move_delay_s']:.0f} s",
             "met": adaptive[0]["p99_move_delay_s"] <= fixed[0]["p99_move_delay_s"] * 1.1},
        ],
        "notes": [
            f"The account limit ({ACCOUNT_RATE:g} calls/s) is an assumption: the service "
            "does not document DescribeScheduledInstances' rate. The fixed schedule "
            "makes hosts / 30 calls a second whatever the release, so it is throttled "
            "from about 600 hosts on; the adaptive one spends its calls where a move "
            "matters.",
            "A throttled host backs off from 4 s, doubling, capped at --poll-interval "
            "(fixed) or at its planned interval (adaptive: a far host retries rarely): "
            "staleness and move delays under throttling come from that backoff.",
            "Capacity: within 15 minutes of a release a host polls every 30 s, so an "
            f"account admitting {ACCOUNT_RATE:g} calls/s serves about "
            f"{ACCOUNT_RATE * BASE:,.0f} hosts in that window at once. Here each host "
            f"spends {(2 * NEAR_SECONDS - MOVE_BEFORE) / 60:.0f} min there (the move "
            "included), so 5,000 hosts whose releases fall within "
            f"{(RELEASE_TO - RELEASE_FROM) / 3600:.0f} h need about "
            f"{5000 * (2 * NEAR_SECONDS - MOVE_BEFORE) / (RELEASE_TO - RELEASE_FROM) / BASE:.0f}"
            " calls/s for their final windows alone: the adaptive schedule is throttled "
            "too, and its far calls are no longer what uses the limit up. Such a fleet "
            "needs a higher account limit or a longer --poll-interval in the final window.",
        ],
        "figures": runs,
    }


if __name__ == "__main__":
    main()
