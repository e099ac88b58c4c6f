"""Each node's deadline handed to Ray as a drain, so Ray's own preemption paths see it.

Ray 2.60 has no public call that marks a node draining with a deadline: the GCS RPC
``DrainNode`` is reached through ``ray._raylet.GcsClient.drain_node`` (what the hidden,
"not covered by Ray's public API stability guarantees" ``ray drain-node`` command calls),
and Ray Train's ``PreemptionWatcher`` reads it back through the equally private
``ray._private.state.state.get_draining_nodes()`` every 5 s. So this is used behind a
version check (2.60 and later, the one tested) and only when asked for
(``NodeDeadlines(drain_within=...)``).

A drain is one-way in Ray 2.60 (measured on a loopback cluster): another ``DrainNode``
overwrites its deadline (later, earlier, or 0 = none), but nothing un-drains a node. A
draining node takes no new tasks or actors, and its raylet exits as soon as nothing runs
on it. Hence a drain is published only when the node's deadline is within
``drain_within`` seconds, a moved deadline (a renewal included) is published again, and a
withdrawn one is said once (Ray keeps the node draining at the last deadline).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from sidecar.models import Expiry

__all__ = ["RayDrains", "drain_supported"]

logger = logging.getLogger("sidecar.integrations.ray_drain")

FIRST_TESTED = (2, 60)  # GcsClient.drain_node(node, reason, message, deadline_ms) and
# Ray Train's PreemptionWatcher, both read from that release's installed source
SAME_DEADLINE_MS = 1000  # a deadline read again within 1 s is the same deadline


def drain_supported(version: str) -> bool:
    """Whether this Ray release is one the drain call was checked against (2.60+)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= FIRST_TESTED


class RayDrains:
    """Marks a node draining (reason PREEMPTION) with its own deadline, once per change."""

    def __init__(self, within_seconds: float, *,
                 clock: Callable[[], float] = time.time) -> None:
        self._within = within_seconds
        self._clock = clock
        self._client: Any = None
        self._usable: Optional[bool] = None  # decided on first use
        self._published: dict[str, int] = {}  # node id -> the deadline (ms) Ray was given
        self._withdrawn: set[str] = set()  # nodes whose deadline went after a drain
        self._problem: dict[str, str] = {}  # node id -> the last failure, as logged

    @property
    def published(self) -> dict[str, int]:
        """Node id -> the drain deadline (Unix ms) last handed to Ray."""
        return dict(self._published)

    def update(self, node_id: str, address: str, known: Optional[Expiry]) -> None:
        """Hand ``known`` (the node's daemon's merged deadline) to Ray if it is new."""
        if known is None or known.expires_at_unix is None:
            if node_id in self._published and node_id not in self._withdrawn:
                self._withdrawn.add(node_id)
                logger.warning(
                    "ray node %s: its deadline was withdrawn, but Ray cannot undo a drain: "
                    "the node stays draining until %s (no new work there; its raylet "
                    "exits when idle; `ray stop` + `ray start` on it rejoins)",
                    address, _utc(self._published[node_id]))
            return
        deadline_ms = round(known.expires_at_unix * 1000)
        before = self._published.get(node_id)
        if before is None:
            if known.expires_at_unix - self._clock() > self._within:
                return  # not yet: a drain stops Ray placing work there, for good
        elif abs(deadline_ms - before) < SAME_DEADLINE_MS:
            return
        if not self._ready():
            return
        message = (f"esi-sidecar: {known.source or 'deadline'} {known.kind or ''} "
                   f"at {known.expires_at or _utc(deadline_ms)}").replace("  ", " ")
        try:
            accepted, rejection = self._client.drain_node(
                node_id, _preemption_reason(), message, deadline_ms)
        except Exception as exc:  # a GCS hiccup: tried again on the next ask
            self._fail(node_id, address, f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
            return
        if not accepted:
            self._fail(node_id, address, f"not accepted: {rejection}")
            return
        self._problem.pop(node_id, None)
        self._withdrawn.discard(node_id)
        self._published[node_id] = deadline_ms
        if before is None:
            logger.warning("ray node %s: drained for its deadline %s (Ray's preemption "
                           "watchers now see it)", address, _utc(deadline_ms))
        else:
            logger.warning("ray node %s: drain deadline moved from %s to %s", address,
                           _utc(before), _utc(deadline_ms))

    # ------------------------------------------------------------------ internals

    def _ready(self) -> bool:
        if self._usable is None:
            import ray

            self._usable = drain_supported(ray.__version__)
            if not self._usable:
                logger.warning("Ray %s is older than %d.%d: node deadlines are not handed "
                               "to Ray as drains", ray.__version__, *FIRST_TESTED)
                return False
            try:
                address = ray.get_runtime_context().gcs_address
                raylet: Any = ray._raylet  # compiled: mypy sees no GcsClient there
                self._client = raylet.GcsClient(address=address)
                self._client.drain_node  # noqa: B018 (its absence is what is checked)
            except Exception as exc:
                self._usable = False
                logger.warning("Ray %s has no drain call this was written for (%s): node "
                               "deadlines are not handed to Ray as drains",
                               ray.__version__, f"{type(exc).__name__}: {exc}"[:200])
        return bool(self._usable)

    def _fail(self, node_id: str, address: str, problem: str) -> None:
        if self._problem.get(node_id) != problem:
            logger.warning("ray node %s: its deadline could not be handed to Ray as a "
                           "drain (%s); tried again on the next ask", address, problem)
        self._problem[node_id] = problem


def _preemption_reason() -> int:
    from ray.core.generated import autoscaler_pb2

    generated: Any = autoscaler_pb2  # mypy sees no enum in generated code
    return int(generated.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"))


def _utc(unix_ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_ms / 1000))
