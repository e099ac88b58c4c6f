"""The daemon's uploader in the simulator: one thread that streams each save while it is
written, the daemon's own estimate and give-way rule (``sidecar.host.upload.plan``).

Split from the engine (issue 37, item 6), which feeds it the saves as the run makes them.
Times are seconds since the run started; an amount is an upload's duration at rate 1 on a
link at full speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

from sidecar.host.upload import plan
from sidecar.host.upload.plan import DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS
from sidecar.tools.simulate.workloads import COMMIT_TAIL_SECONDS, Link

__all__ = ["FULL_SPEED", "UPLOAD_RATE", "Checkpoint", "Uploads", "durable_times",
           "saved_estimate", "streamed"]

# The plan's amounts here are upload durations, the daemon's bytes: at rate 1 an upload's
# amount is its own duration.
UPLOAD_RATE = 1.0
FULL_SPEED = Link()  # a link that never slows

@dataclass(frozen=True)
class Checkpoint:
    """A save from ``state_seconds`` (the training state it holds, and when the save began)
    to ``saved_seconds`` (complete on disk), with ``upload_seconds`` to upload (the amount:
    its duration at ``upload_rate`` 1 on a link at full speed)."""

    state_seconds: float
    saved_seconds: float
    upload_seconds: float
    upload_rate: float = 1.0


@dataclass(frozen=True)
class _Upload:
    """The checkpoint the upload thread is on: its bytes go from ``sending`` (the stream's
    start while it was saved, or its commit's) until ``sent_by`` (the link's); its commit
    began at ``commit`` (the save's end, or when the thread took it); durable at
    ``durable``, the later of the two plus ``COMMIT_TAIL_SECONDS``; the thread is free
    then."""

    index: int
    sending: float
    sent_by: float
    commit: float
    durable: float


class Uploads:
    """The daemon's uploader in a few lines, fed the saves as they are made: one thread.

    It streams a save's files while the save writes them (``stream``, the daemon's
    default ``UploaderConfig.stream``) when it is free, so a checkpoint is durable at
    the later of its save's end and its stream's start plus its upload, then the commit
    (``COMMIT_TAIL_SECONDS``). The thread is not free while an older checkpoint uploads
    or waits: the commit loop goes first, and the save's stream starts when it ends (or
    never, the save ending first: it then goes up whole after its save). A checkpoint
    saved while one uploads waits (replacing an older one waiting, which is skipped);
    near the release the running upload gives way to it as ``plan.gives_way`` says (the
    daemon's default ``--upload-near-release``, its real size as ``newer``).

    The estimate it serves is the daemon's (``plan.estimate_seconds``, as
    ``UploadTracker.next_upload_seconds``): the largest of the newest checkpoints' bytes
    left after their save (a checkpoint not yet uploaded counts whole) at the slow tail
    of the rates measured (every byte sent, streamed ones included, over the time
    sending), updated by the commit in progress (``plan.in_progress_rate``); never less
    than the measured times from a commit's start to durable x1.2. ``first_estimate``
    (the one saved in the checkpoint) until one was done here; ``prior``: the
    ``(amount, seconds)`` the machine before measured, the rate assumed until then.
    While the thread is free and no save runs, the link is probed
    (``plan.probe_interval``; ``probe_rate(k)``: the link's rate the k-th probe meets, on
    top of ``link``; ``probes=False``: never, as before issue 23)."""

    def __init__(self, known_deadline: Callable[[float], Optional[float]],
                 first_estimate: Optional[float], *, link: Link = FULL_SPEED,
                 prior: Sequence[tuple[float, float]] = (),
                 probe_rate: Callable[[int], float] = lambda index: 1.0,
                 probes: bool = True, stream: bool = True) -> None:
        self._known_deadline = known_deadline
        self._first_estimate = first_estimate
        self._link = link
        self._prior = list(prior)
        self._stream = stream
        self.checkpoints: list[Checkpoint] = []
        self.durable: list[float] = []  # inf: not (yet) durable
        # Per checkpoint, what the daemon's record keeps once it is durable: the amount
        # sent after its commit began, and the seconds from then to durable.
        self._after: list[Optional[float]] = []
        self._durations: list[Optional[float]] = []
        # The checkpoint before's, for the sizes until one was seen here.
        self._seed_sizes = [] if first_estimate is None else [first_estimate / plan.ESTIMATE_MARGIN]
        self._done: list[tuple[float, float]] = []  # (amount, seconds sending) uploaded here
        self._running: Optional[_Upload] = None
        self._waiting: Optional[int] = None
        self._free_at = 0.0  # when the thread last became free
        self._probes = probes
        self._probe_rate = probe_rate
        self._measured_at = 0.0  # the last upload's end or probe
        self._probes_since: list[float] = []  # rates the probes since the last upload measured
        self.probe_count = 0
        self._probe_at: Optional[float] = None  # when the next probe goes (cached)

    # ------------------------------------------------------------------ the thread

    def _upload(self, index: int, sending: float, commit: float) -> _Upload:
        checkpoint = self.checkpoints[index]
        sent_by = self._link.ends(sending, checkpoint.upload_seconds, checkpoint.upload_rate)
        return _Upload(index, sending, sent_by, commit,
                       max(sent_by, commit) + COMMIT_TAIL_SECONDS)

    def _commit(self, index: int, at: float) -> None:
        """The thread takes checkpoint ``index`` (complete on disk) at ``at``, whole."""
        self._running = self._upload(index, at, at)
        self._probe_at = None

    def _sent(self, upload: _Upload, at: float) -> float:
        """What ``upload`` sent by ``at``."""
        checkpoint = self.checkpoints[upload.index]
        sent = self._link.sent(upload.sending, min(at, upload.sent_by), checkpoint.upload_rate)
        return min(checkpoint.upload_seconds, sent)

    def _finish(self) -> None:
        """The running upload is durable: record it as the daemon does, and take the
        checkpoint waiting, if any."""
        upload = self._running
        assert upload is not None
        amount = self.checkpoints[upload.index].upload_seconds
        self.durable[upload.index] = upload.durable
        self._after[upload.index] = amount - self._sent(upload, upload.commit)
        self._durations[upload.index] = upload.durable - upload.commit
        # The rate: every byte sent (streamed ones too) over the time sending, the
        # commit's tail included, as the uploader records it.
        self._done.append((amount, upload.sent_by - upload.sending + COMMIT_TAIL_SECONDS))
        self._running = None
        self._free_at = upload.durable
        self._measured_at, self._probe_at = upload.durable, None
        self._probes_since = []
        if self._waiting is not None:
            self._commit(self._waiting, upload.durable)
            self._waiting = None

    # ------------------------------------------------------------------ the estimate

    def _sizes(self) -> list[float]:
        """The amounts the daemon's estimate counts, newest first: what each checkpoint
        still had to send after its save, or all of it while it is not durable; the
        checkpoint before's (from its saved estimate) until one was seen here."""
        sizes: list[float] = []
        for index in range(len(self.checkpoints) - 1, -1, -1):
            whole, after = self.checkpoints[index].upload_seconds, self._after[index]
            if whole > 0:
                sizes.append(whole if after is None else after)
        return sizes or self._seed_sizes

    def _served(self, now: float) -> Optional[float]:
        """The daemon's own estimate at ``now`` (``plan.estimate_seconds``)."""
        durations = [self._durations[index]
                     for index, checkpoint in reversed(list(enumerate(self.checkpoints)))
                     if checkpoint.upload_seconds > 0]
        return plan.estimate_seconds(self._sizes(), self.rate(now), durations)

    def measured(self) -> int:
        """How many uploads the estimate's rate rests on, as the daemon serves it
        (``upload_measured``): those done here, at most ``plan.RATE_WINDOW``."""
        return min(len(self._done), plan.RATE_WINDOW)

    def _left(self, now: float) -> float:
        """What the running upload still has to send at ``now`` (0: none runs)."""
        if self._running is None:
            return 0.0
        return self.checkpoints[self._running.index].upload_seconds - self._sent(self._running, now)

    def rate(self, now: float) -> Optional[float]:
        """The rate the daemon assumes at ``now``: the plan's over the recent uploads (the
        prior's before any), slower when the commit in progress shows it (its bytes and
        seconds since the commit began, as the tracker counts them)."""
        rate = plan.throughput((self._done or self._prior)[-plan.RATE_WINDOW:], None)
        rate = plan.with_probe(rate, plan.probed_rate(self._probes_since))
        upload = self._running
        if upload is None or rate is None or now <= upload.commit:
            return UPLOAD_RATE if rate is None else rate
        sent = self._sent(upload, now) - self._sent(upload, upload.commit)
        return plan.in_progress_rate(rate, sent=sent, elapsed_seconds=now - upload.commit,
                                     left=self._left(now))

    def estimate(self, now: float) -> Optional[float]:
        """What the daemon serves at ``now`` as the next upload's duration."""
        self.advance(now)
        if not self._done:
            if plan.probed_rate(self._probes_since) is None:
                return self._first_estimate  # nothing measured here: the saved estimate
            # A probe, no upload yet: the saved estimate, longer when the link is slower.
            probed = plan.next_upload_seconds(self._sizes(), self.rate(now))
            return max(self._first_estimate or 0.0, probed or 0.0) or None
        return self._served(now)

    # ------------------------------------------------------------------ probes

    def _next_probe(self) -> float:
        """When the next probe goes: the first instant, after the last measurement, at
        which ``plan.probe_interval`` (the deadline known then) has passed since it; inf
        while an upload runs, or before any checkpoint was seen. Both inputs change only
        at a measurement (the schedule is fixed), so it is worked out once per one."""
        if not self._probes or self._running is not None or not self._sizes():
            return math.inf
        if self._probe_at is None:
            last = self._measured_at
            at = last + plan.PROBE_NEAR_SECONDS
            far = last + plan.PROBE_FAR_SECONDS
            estimate = plan.next_upload_seconds(self._sizes(), self.rate(last))
            while at < far:
                deadline = self._known_deadline(at)
                remaining = None if deadline is None else deadline - at
                if plan.probe_interval(remaining, DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS,
                                       estimate) <= at - last:
                    break
                at += plan.PROBE_NEAR_SECONDS
            self._probe_at = min(at, far)
        return self._probe_at

    def _send_probe(self, at: float) -> None:
        """A probe at ``at``: ``plan.PROBE_SECONDS`` worth at the rate assumed, through the
        link as it is then."""
        amount = plan.probe_amount(self.rate(at) or UPLOAD_RATE)
        link_rate = self._probe_rate(self.probe_count)
        self._probes_since.append(amount / (self._link.ends(at, amount, link_rate) - at))
        self.probe_count += 1
        self._measured_at, self._probe_at = at, None

    # ------------------------------------------------------------------ time

    def advance(self, until: float, *, probes: bool = True) -> None:
        """Finish every upload durable by ``until``, probing the link when it is due
        (``until`` inf: finish the uploads only, the run is over; ``probes=False``: a save
        runs, and a probe gives way to it)."""
        while True:
            probe_at = math.inf if math.isinf(until) or not probes else self._next_probe()
            if self._running is None:
                if probe_at > until or math.isinf(probe_at):
                    return
                self._send_probe(probe_at)
                continue
            if self._running.durable > until:
                return
            self._finish()

    def add(self, checkpoint: Checkpoint) -> None:
        """A save from ``checkpoint.state_seconds`` to ``checkpoint.saved_seconds``: stream
        it while it is written if the thread is free, upload it once saved, or queue it."""
        started, saved = checkpoint.state_seconds, checkpoint.saved_seconds
        self.advance(started)
        index = len(self.checkpoints)
        self.checkpoints.append(checkpoint)
        self.durable.append(math.inf)
        self._after.append(None)
        self._durations.append(None)
        if checkpoint.upload_seconds <= 0:
            self.durable[index] = saved
            return
        self.advance(saved, probes=False)  # what the thread is on goes on during the save
        if self._running is None:
            # Free since the save began, or since its upload ended: the stream went then.
            sending = max(started, self._free_at) if self._stream else saved
            self._running = self._upload(index, min(sending, saved), saved)
            self._probe_at = None
            return
        deadline = self._known_deadline(saved)
        remaining = None if deadline is None else deadline - saved
        if plan.gives_way(
            remaining, near_release_seconds=DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS,
            next_upload=self._served(saved), current_left=self._left(saved),
            newer=checkpoint.upload_seconds, rate=self.rate(saved),
        ):
            self._commit(index, saved)  # give the old one up
            self._waiting = None
        else:
            self._waiting = index


def durable_times(
    checkpoints: Sequence[Checkpoint],
    known_deadline: Callable[[float], Optional[float]],
    first_estimate: Optional[float],
    *,
    link: Link = FULL_SPEED,
    prior: Sequence[tuple[float, float]] = (),
    stream: bool = True,
) -> list[float]:
    """When each checkpoint became durable (``inf``: never, its upload was given up or
    skipped), by :class:`Uploads` (``stream=False``: each sent after its save, as the
    daemon's ``UploaderConfig(stream=False)``)."""
    uploads = Uploads(known_deadline, first_estimate, link=link, prior=prior, stream=stream)
    for checkpoint in checkpoints:
        uploads.add(checkpoint)
    uploads.advance(math.inf)
    return uploads.durable


def streamed(history: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The uploads the machine before measured, ``(amount, link seconds)``, as its daemon
    recorded them: the commit's tail in the time sending."""
    return [(amount, seconds + COMMIT_TAIL_SECONDS) for amount, seconds in history]


def saved_estimate(prior: Sequence[tuple[float, float]], save_seconds: float) -> Optional[float]:
    """The estimate the checkpoint carried from the machine before: its daemon's, over the
    uploads it measured there (``prior``, oldest first), each streamed while a save of
    ``save_seconds`` wrote it, so that only what the link had left after the save counts."""
    rate = plan.throughput(prior, None)
    newest = list(prior[::-1])
    after = [max(0.0, sending - COMMIT_TAIL_SECONDS - save_seconds) for _, sending in newest]
    sizes = [amount * left / (sending - COMMIT_TAIL_SECONDS)
             for (amount, sending), left in zip(newest, after)]
    return plan.estimate_seconds(sizes, rate, [left + COMMIT_TAIL_SECONDS for left in after])
