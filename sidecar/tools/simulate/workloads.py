"""Built-in workloads: how long steps and saves take, and how the release deadline behaves.

A workload is a recipe; :meth:`Workload.trace` turns it into one reproducible run (a
:class:`Trace`) for a seed. Every policy simulated on the same (workload, seed) meets the
same trace: step ``i`` and save ``k`` take the same time and the deadline moves at the
same instants, so differences between policies come from the policies alone (common
random numbers), and a few hundred seeds are enough to compare them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["COMMIT_TAIL_SECONDS", "HEAVY_WORKLOADS", "WORKLOADS", "DeadlineChange", "Link",
           "Trace", "Workload", "get_workload"]

MINUTE = 60.0
# The daemon streams a save's files while it writes them; what is left once the save ends
# is the commit: the last file closed, the manifest, fsyncs and renames. Seconds on the
# link as the benchmarks measured it (docs/benchmarks.md, "Streaming upload": 0.01-0.16 s
# after the save for a file left unchanged), rounded up for a last file that is a shard.
COMMIT_TAIL_SECONDS = 2.0


@dataclass(frozen=True)
class DeadlineChange:
    """At ``at_seconds`` (since the run started) the true deadline becomes ``deadline_seconds``.

    ``deadline_seconds`` None means "no deadline" (a spot machine before its notice). A change
    at 0 is known to the job at once (the daemon had it before the job started); a later
    change reaches the job one notice delay after it happened.
    """

    at_seconds: float
    deadline_seconds: Optional[float]


Schedule = Callable[[random.Random], tuple[DeadlineChange, ...]]


class Trace:
    """One drawn run: step and save durations (drawn lazily, in order) and the schedule."""

    def __init__(self, workload: Workload, seed: int) -> None:
        self.workload = workload
        # String seeds are hashed with SHA-512 by `random`: stable across processes,
        # unlike hash(), so a seed gives the same run everywhere.
        self._step_rng = random.Random(f"{workload.name}/{seed}/steps")
        self._save_rng = random.Random(f"{workload.name}/{seed}/saves")
        self._upload_rng = random.Random(f"{workload.name}/{seed}/uploads")
        self._earlier_seed = f"{workload.name}/{seed}/earlier-saves"
        self.changes = workload.schedule(random.Random(f"{workload.name}/{seed}/deadline"))
        self._seed = seed
        # The link halves at an instant drawn before the first deadline, or never.
        self.link = Link()
        first = self.changes[0].deadline_seconds
        if workload.link_halves is not None and first is not None:
            lo, hi = workload.link_halves
            link_rng = random.Random(f"{workload.name}/{seed}/link")
            self.link = Link(max(0.0, first - link_rng.uniform(lo, hi)))
        self._steps: list[float] = []
        self._saves: list[float] = []
        self._uploads: list[float] = []

    def step_seconds(self, index: int) -> float:
        """Duration of step ``index`` (0-based)."""
        while len(self._steps) <= index:
            self._steps.append(self.workload.draw_step(self._step_rng, len(self._steps) + 1))
        return self._steps[index]

    def save_seconds(self, index: int) -> float:
        """Duration of the ``index``-th save of the run (0-based)."""
        while len(self._saves) <= index:
            self._saves.append(self.workload.draw_save(self._save_rng))
        return self._saves[index]

    def earlier_saves(self) -> list[float]:
        """The saves the guard measured before this run (``Workload.measured_saves``)."""
        rng = random.Random(self._earlier_seed)  # the same list on every call
        return [self.workload.draw_save(rng) for _ in range(self.workload.measured_saves)]

    def upload_seconds(self, index: int) -> float:
        """How long the ``index``-th save of the run takes to upload at the link's full
        speed (0: no uploader)."""
        while len(self._uploads) <= index:
            self._uploads.append(self.workload.draw_upload(self._upload_rng))
        return self._uploads[index]

    def upload(self, index: int) -> tuple[float, float]:
        """The ``index``-th upload as ``(amount, rate)``: at rate 1 an amount is its own
        duration. Size noise (the default) varies the amount; a workload whose noise is
        the link's (``upload_sigma``) keeps the checkpoint's size and varies the rate."""
        seconds = self.upload_seconds(index)
        if self.workload.upload_sigma and seconds > 0:
            return self.workload.upload_seconds, self.workload.upload_seconds / seconds
        return seconds, 1.0

    def probe_rate(self, index: int) -> float:
        """The link's rate (full speed 1) that the ``index``-th probe of the run meets: a
        workload whose noise is the link's (``upload_sigma``) draws it as an upload's; the
        others' links only change by ``link_halves``."""
        if not self.workload.upload_sigma:
            return 1.0
        rng = random.Random(f"{self.workload.name}/{self._seed}/probe/{index}")
        return 1.0 / math.exp(rng.gauss(0.0, self.workload.upload_sigma))

    def history(self, count: int) -> list[tuple[float, float]]:
        """``count`` uploads the daemon of the machine before measured, oldest first, as
        ``(amount, seconds)``: the checkpoint's size at the link's rates as this workload
        draws them (a separate stream, so the run's own draws stay the same)."""
        rng = random.Random(f"{self.workload.name}/{self._seed}/history")
        size = self.workload.upload_seconds
        if not self.workload.upload_sigma:
            return [(size, size)] * count
        return [(size, self.workload.draw_upload(rng)) for _ in range(count)]


@dataclass(frozen=True)
class Link:
    """The uploader's link: full speed, halving at ``halves_seconds`` (inf: never)."""

    halves_seconds: float = math.inf

    def ends(self, start_seconds: float, amount: float, rate: float = 1.0) -> float:
        """When an upload of ``amount`` at ``rate`` (full speed) started at
        ``start_seconds`` ends."""
        halves = self.halves_seconds
        if start_seconds + amount / rate <= halves:
            return start_seconds + amount / rate
        before = max(0.0, halves - start_seconds) * rate
        return max(start_seconds, halves) + (amount - before) / (0.5 * rate)

    def sent(self, start_seconds: float, until_seconds: float, rate: float = 1.0) -> float:
        """What an upload at ``rate`` started at ``start_seconds`` sent by ``until_seconds``."""
        until_seconds = max(start_seconds, until_seconds)
        halves = max(start_seconds, min(until_seconds, self.halves_seconds))
        return ((halves - start_seconds) + 0.5 * (until_seconds - halves)) * rate


@dataclass(frozen=True)
class Workload:
    """Step and save time distributions plus a deadline schedule.

    Steps take ``step_seconds`` +- ``step_jitter`` (uniform, relative); every
    ``spike_every``-th step takes ``spike_factor`` times as long (validation); each step is
    a straggler with ``straggler_probability``, taking 3-5x. Saves take ``save_seconds`` +-
    ``save_jitter`` (``save_spike_factor`` times that with ``save_spike_probability``). A
    checkpoint's upload takes ``upload_seconds`` +- ``upload_jitter`` of sending (the
    daemon's uploader, which streams it while the save writes it: the engine; 0: no
    uploader, the local save is durable). ``step_max_seconds``, ``save_max_seconds`` and
    ``upload_max_seconds`` are the largest values these can draw, and
    ``durable_max_seconds`` the longest from a save's start to durable: they define
    whether a run is feasible at all and the final window (see engine).
    """

    name: str
    description: str
    schedule: Schedule
    step_seconds: float = 20.0
    step_jitter: float = 0.05
    spike_every: int = 0
    spike_factor: float = 10.0
    straggler_probability: float = 0.0
    straggler_factor: tuple[float, float] = (3.0, 5.0)
    save_seconds: float = 60.0
    save_jitter: float = 0.10
    # A save takes ``save_spike_factor`` times as long with this probability (a busy disk,
    # a save that also writes the optimizer's full state).
    save_spike_probability: float = 0.0
    save_spike_factor: float = 3.0
    # How long until the job learns of a deadline change; None: the run's setting (the
    # daemon's poll interval). The spot workloads: the aws source polls every 2 s.
    notice_delay_seconds: Optional[float] = None
    upload_seconds: float = 0.0
    upload_jitter: float = 0.10
    # > 0: upload times are lognormal, median ``upload_seconds``, this sigma, from the
    # link's speed (the checkpoint's size stays the same); the jitter is then unused.
    upload_sigma: float = 0.0
    # The link's speed halves at an instant drawn this many seconds (lo, hi) before the
    # first deadline (None: it never does).
    link_halves: Optional[tuple[float, float]] = None
    # Non-empty for a stress workload: what it hides from a policy that only sees its
    # own measurements (the reference workloads leave it empty).
    stress: str = ""
    # Saves the guard measured before the run: a resumed job whose checkpoint carries
    # ``CheckpointGuard.state_dict()`` meets its first deadline with measured saves.
    measured_saves: int = 0
    # The running source and its notice, as the daemon's GET /v1/protection serves them
    # (the guard's routine saves read it); None: the stand-in client answers none, as
    # before routine saves (the reference tables stay as they were).
    notice: Optional[tuple[str, float]] = None

    def draw_step(self, rng: random.Random, number: int) -> float:
        """Duration of step ``number`` (1-based, so "every K-th" means K, 2K, ...)."""
        seconds = self.step_seconds * rng.uniform(1 - self.step_jitter, 1 + self.step_jitter)
        if self.spike_every and number % self.spike_every == 0:
            seconds *= self.spike_factor
        if self.straggler_probability and rng.random() < self.straggler_probability:
            seconds *= rng.uniform(*self.straggler_factor)
        return seconds

    def draw_save(self, rng: random.Random) -> float:
        seconds = self.save_seconds * rng.uniform(1 - self.save_jitter, 1 + self.save_jitter)
        if self.save_spike_probability and rng.random() < self.save_spike_probability:
            seconds *= self.save_spike_factor
        return seconds

    def draw_upload(self, rng: random.Random) -> float:
        if self.upload_sigma:
            return self.upload_seconds * math.exp(rng.gauss(0.0, self.upload_sigma))
        return self.upload_seconds * rng.uniform(1 - self.upload_jitter, 1 + self.upload_jitter)

    @property
    def step_max_seconds(self) -> float:
        factor = 1.0  # a spike step may be a straggler too: draw_step multiplies both
        if self.spike_every:
            factor *= self.spike_factor
        if self.straggler_probability:
            factor *= self.straggler_factor[1]
        return self.step_seconds * (1 + self.step_jitter) * factor

    @property
    def save_max_seconds(self) -> float:
        factor = self.save_spike_factor if self.save_spike_probability else 1.0
        return self.save_seconds * (1 + self.save_jitter) * factor

    @property
    def upload_max_seconds(self) -> float:
        factor = 2.0 if self.link_halves is not None else 1.0  # at worst all at half speed
        if self.upload_sigma:  # unbounded: its 99.9th percentile, z = 3.09
            return self.upload_seconds * math.exp(3.09 * self.upload_sigma) * factor
        return self.upload_seconds * (1 + self.upload_jitter) * factor

    @property
    def durable_max_seconds(self) -> float:
        """The longest from a save's start to durable, the upload thread free: the
        daemon streams the files while the save writes them, so the longer of the save
        and the upload, then the commit (``COMMIT_TAIL_SECONDS``); the save alone without
        an uploader."""
        if self.upload_seconds <= 0:
            return self.save_max_seconds
        return max(self.save_max_seconds, self.upload_max_seconds) + COMMIT_TAIL_SECONDS

    def trace(self, seed: int) -> Trace:
        return Trace(self, seed)


# ---------------------------------------------------------------------- schedules
# ESI: the scheduled release is known from the start, 90-150 min ahead, so that a
# periodic policy meets the deadline at every phase of its interval.


def _release(rng: random.Random) -> float:
    return rng.uniform(90 * MINUTE, 150 * MINUTE)


def fixed_release(rng: random.Random) -> tuple[DeadlineChange, ...]:
    return (DeadlineChange(0.0, _release(rng)),)


def brought_forward(rng: random.Random) -> tuple[DeadlineChange, ...]:
    """30 min earlier, announced 2-40 min before the new deadline (some inside the window)."""
    original = _release(rng)
    new = original - 30 * MINUTE
    return (DeadlineChange(0.0, original), DeadlineChange(new - rng.uniform(2, 40) * MINUTE, new))


def extended(rng: random.Random) -> tuple[DeadlineChange, ...]:
    """60 min later, announced 0-10 min before the original (after some policies saved)."""
    original = _release(rng)
    at = original - rng.uniform(0, 10) * MINUTE
    return (DeadlineChange(0.0, original), DeadlineChange(at, original + 60 * MINUTE))


def extended_then_back(rng: random.Random) -> tuple[DeadlineChange, ...]:
    """Extended as above; 0-10 min after the original, brought back to 20 min from then."""
    first = extended(rng)
    original = first[0].deadline_seconds
    assert original is not None
    back_at = original + rng.uniform(0, 10) * MINUTE
    return (*first, DeadlineChange(back_at, back_at + 20 * MINUTE))


def spot_notice(lead_seconds: float) -> Schedule:
    """No scheduled release; a preemption notice ``lead_seconds`` before the reclaim."""

    def schedule(rng: random.Random) -> tuple[DeadlineChange, ...]:
        notice = rng.uniform(60 * MINUTE, 150 * MINUTE)
        return (DeadlineChange(0.0, None), DeadlineChange(notice, notice + lead_seconds))

    return schedule


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("steady", "20 s +-5% steps, 60 s +-10% saves, release in 90-150 min",
                 fixed_release),
        Workload("validation-spikes", "as steady, but every 50th step is a 10x validation step",
                 fixed_release, spike_every=50),
        Workload("stragglers", "as steady, but 3% of steps are stragglers taking 3-5x",
                 fixed_release, straggler_probability=0.03),
        Workload("slow-saves", "as steady, but saves take 150 s +-20% (above verl's fixed 60 s)",
                 fixed_release, save_seconds=150.0, save_jitter=0.20),
        Workload("brought-forward", "release moved 30 min earlier, announced 2-40 min before it",
                 brought_forward),
        Workload("extended", "release moved 60 min later, announced 0-10 min before the original",
                 extended),
        Workload("extended-then-back",
                 "extended as above, then 0-10 min past the original moved back to 20 min away",
                 extended_then_back),
        Workload("upload-1min", "as steady, each checkpoint then uploads for 60 s +-10% "
                 "(18 GB at 300 MB/s)", fixed_release, upload_seconds=60.0),
        Workload("upload-3min", "as steady, each checkpoint then uploads for 180 s +-10% "
                 "(longer than a step and a save)", fixed_release, upload_seconds=180.0),
        Workload("spot-notice-300s", "no scheduled release; preemption notice 300 s before "
                 "reclaim, learned within 2 s", spot_notice(300.0), notice_delay_seconds=2.0),
        Workload("spot-notice-120s", "no scheduled release; preemption notice 120 s before "
                 "reclaim, learned within 2 s", spot_notice(120.0), notice_delay_seconds=2.0),
        Workload("spot-notice-60s", "no scheduled release; preemption notice 60 s before "
                 "reclaim, learned within 2 s (about one save)", spot_notice(60.0),
                 notice_delay_seconds=2.0),
        Workload("spot-notice-30s", "no scheduled release; preemption notice 30 s before "
                 "reclaim (a SIGTERM's grace), learned within 2 s", spot_notice(30.0),
                 notice_delay_seconds=2.0),
        Workload("rare-validation", "as steady, but every 150th step is a 10x validation step",
                 fixed_release, spike_every=150,
                 stress="the spike can fall outside the 100-step window of the step estimate"),
        Workload("very-slow-saves", "as steady, but saves take 240 s +-20%",
                 fixed_release, save_seconds=240.0, save_jitter=0.20,
                 stress="a job that saves only at the deadline never measured a save"),
        # Upload noise and a slowing link (issue 23, items 3 and 7).
        Workload("upload-lognormal", "as steady, upload times lognormal (sigma 0.35, median "
                 "150 s) from the link's speed", fixed_release, upload_seconds=150.0,
                 upload_sigma=0.35,
                 stress="an upload 2.5-3x the median after a few fast ones beats an estimate "
                 "from those few"),
        Workload("link-halves", "as upload-3min, but the link's speed halves 2-20 min before "
                 "the release (often during an upload)", fixed_release, upload_seconds=180.0,
                 link_halves=(2 * MINUTE, 20 * MINUTE),
                 stress="a link that slows while nothing uploads is seen only by the final "
                 "upload: routine uploads measure it"),
    )
}


# ---------------------------------------------------------------------- heavy checkpoints
# Issue 23: a node's share of the checkpoint takes minutes to save or to upload, so no
# top-up fits after the final save and the margin is idle time. Apart from WORKLOADS, so
# the main document and its tests keep their reference set; docs/simulation.md's
# "Choosing the margin" and "Late saves" run them (tools/simulation_heavy.py). The job resumed from
# a checkpoint holding the guard's state: it meets the deadline with 5 measured saves.
HEAVY_WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("heavy-saves", "as steady, but saves take 150-240 s (195 s +-23%), no "
                 "upload; 5 saves measured before the run", fixed_release,
                 save_seconds=195.0, save_jitter=45.0 / 195.0, measured_saves=5),
        Workload("heavy-upload", "as steady, but saves take 45 s +-10% and uploads 300 s "
                 "+-10%; 5 saves measured before the run", fixed_release,
                 save_seconds=45.0, upload_seconds=300.0, measured_saves=5),
        Workload("heavy-brought-forward", "heavy-saves, the release moved 30 min earlier, "
                 "announced 2-40 min before it", brought_forward,
                 save_seconds=195.0, save_jitter=45.0 / 195.0, measured_saves=5),
        Workload("heavy-notice-240s", "heavy-saves on a spot machine: a notice 240 s before "
                 "the reclaim, learned within 2 s", spot_notice(240.0),
                 notice_delay_seconds=2.0, save_seconds=195.0, save_jitter=45.0 / 195.0,
                 measured_saves=5),
        # Notices no save can hold: routine saves (issue 23, item 6). The reclaim comes at
        # a random time with no deadline ahead, only the source's notice.
        Workload("gcp-notice-30s-heavy", "a GCP spot VM: no deadline ahead, a 30 s notice "
                 "60-150 min in, learned within 2 s; saves 35 s +-10%, uploads 60 s +-10%; "
                 "5 saves measured before the run", spot_notice(30.0),
                 notice_delay_seconds=2.0, save_seconds=35.0, upload_seconds=60.0,
                 measured_saves=5, notice=("gcp", 30.0)),
        Workload("spot-notice-120s-heavy", "an AWS spot instance: no deadline ahead, a "
                 "2 min notice 60-150 min in, learned within 2 s; saves 180 s +-10%, no "
                 "upload; 5 saves measured before the run", spot_notice(120.0),
                 notice_delay_seconds=2.0, save_seconds=180.0, measured_saves=5,
                 notice=("aws", 120.0)),
        # Issue 37: the independent simulation's heavy cases the set above lacked.
        Workload("heavy-save-spikes", "as steady, but 1 save in 8 takes 3x (60 s +-10%, "
                 "else 180 s) and uploads take 200 s +-10%; 5 saves measured before the run",
                 fixed_release, upload_seconds=200.0, save_spike_probability=1 / 8,
                 measured_saves=5),
        Workload("heavy-upload-brought-forward", "heavy-upload, the release moved 30 min "
                 "earlier, announced 2-40 min before it", brought_forward,
                 save_seconds=45.0, upload_seconds=300.0, measured_saves=5),
        # The slowing link of issue 23, item 7, "midway": long before the final save, so
        # that the probe (and a fallback save's upload) see it first; link-halves, in
        # WORKLOADS, has it 2-20 min before the release, after the final save began in
        # some runs, which nothing measured before can show.
        Workload("link-halves-midway", "as upload-3min, but the link's speed halves "
                 "midway through the run (45-75 min before the release)", fixed_release,
                 upload_seconds=180.0, link_halves=(45 * MINUTE, 75 * MINUTE)),
    )
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS.get(name) or HEAVY_WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; choose from {', '.join([*WORKLOADS, *HEAVY_WORKLOADS])}"
        ) from None
