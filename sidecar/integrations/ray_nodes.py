"""Every node's deadline for a job that spans a Ray cluster (verl's single controller).

Each node of the job is its own machine with its own release time and its own daemon on
loopback; the controller runs on one of them. :class:`NodeDeadlines` places one small
actor on every alive node (``num_cpus=0``, hard node affinity), asks each for its node's
``/v1/expiry`` in parallel, and answers like :class:`~sidecar.train.client.SidecarClient`
(the guard takes either as its ``client``): the earliest deadline over all nodes, the
slowest upload estimate, ``stale`` when any node did not answer. With ``drain_within``,
each node's own deadline is also handed to Ray as a drain once it is that close
(:mod:`sidecar.integrations.ray_drain`), so Ray Train's preemption watcher sees it.
The job's events go to every node's daemon, and a fire drill on any node is the job's.

A node that fails to answer (its daemon down, its actor dead, the node gone from the
cluster) keeps its last good deadline in the MIN: a node that stops answering is still
released on time. Each failure is logged once per change, with the node's address.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from sidecar.integrations.ray_drain import RayDrains
from sidecar.models import Expiry
from sidecar.train.client import DEFAULT_URL, SidecarClient

__all__ = ["NodeDeadlines"]

logger = logging.getLogger("sidecar.integrations.ray_nodes")

ASK_TIMEOUT_SECONDS = 0.5  # all nodes at once (each actor's request: 0.2 s at most)


def _default_url(node: dict[str, Any]) -> str:
    return DEFAULT_URL  # every node's daemon on its own loopback


@dataclass
class _Node:
    node_id: str
    address: str
    actor: Any
    known: Optional[Expiry] = None  # the last answer with a deadline
    problem: Optional[str] = None  # why the last ask failed, as logged
    ran_on: Optional[str] = None  # the node the actor reported it runs on


class NodeDeadlines:
    """The earliest deadline over every node of the Ray cluster this process is in."""

    def __init__(self, url_for_node: Callable[[dict[str, Any]], str] = _default_url, *,
                 timeout: float = ASK_TIMEOUT_SECONDS,
                 drain_within: Optional[float] = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``url_for_node``: the daemon's URL as seen on a node (``ray.nodes()`` entry);
        default ``http://127.0.0.1:8791`` on every node. ``drain_within``: hand a node's
        deadline to Ray as a drain (reason PREEMPTION) once it is this many seconds away,
        and again whenever it moves; None (the default) never drains, since Ray cannot
        undo a drain (docs/integrations.md, Ray)."""
        self._url_for_node = url_for_node
        self._timeout = timeout
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self.drains = None if drain_within is None else RayDrains(drain_within, clock=clock)
        self.last_error: Optional[str] = None

    @property
    def placement(self) -> dict[str, Optional[str]]:
        """Node id -> the node its actor said it runs on (the same, by hard affinity)."""
        return {node.node_id: node.ran_on for node in self._nodes.values()}

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(f"ray node {node.address}" for node in self._nodes.values())

    def expiry(self) -> Optional[Expiry]:
        """Ask every node now; None when none ever answered."""
        import ray

        self._place_actors()
        pending = {node.node_id: node.actor.expiry.remote() for node in self._nodes.values()}
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending),
                            timeout=self._timeout)
        answered: list[Expiry] = []
        errors: list[str] = []
        for node_id, ref in pending.items():
            node = self._nodes[node_id]
            try:
                answer = self._answer(node, ref, ready)
            except Exception as exc:  # a dead actor or node, a timeout: keep what it said
                self._fail(node, f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
                errors.append(f"ray node {node.address}: {node.problem}")
                continue
            answered.append(answer)
            if answer.expires_at_unix is not None:
                node.known = answer
            elif not answer.stale:
                node.known = None  # the daemon says, freshly: nothing scheduled there
        if self.drains is not None:
            for node in self._nodes.values():  # a silent node's kept deadline counts too
                self.drains.update(node.node_id, node.address, node.known)
        self.last_error = "; ".join(errors) or None
        candidates = [node.known for node in self._nodes.values() if node.known is not None]
        if not answered and not candidates:
            return None
        chosen = min(candidates, key=lambda e: e.expires_at_unix or 0.0, default=None)
        if chosen is None:
            chosen = answered[0]
        uploads = [e.upload_seconds for e in (*answered, *candidates)
                   if e.upload_seconds is not None]
        # A drill on any node is the job's drill: the earliest one answered (as
        # SidecarClient.expiry chooses among several daemons).
        drills = [e.drill for e in answered if e.drill is not None]
        return replace(chosen, stale=chosen.stale or bool(errors),
                       error=self.last_error or chosen.error,
                       upload_seconds=max(uploads) if uploads else None,
                       drill=min(drills, key=lambda d: d["expires_at_unix"]) if drills else None)

    def send_event(self, event: Mapping[str, Any]) -> None:
        """A job event for every node's daemon (through its actor), without waiting: the
        controller's job is every node's, and a drill started on each node is reported to
        each (docs/drill.md). Never raises."""
        for node in list(self._nodes.values()):
            with contextlib.suppress(Exception):  # a dead actor: its node is gone
                node.actor.send_event.remote(dict(event))

    def is_durable(self, step: int) -> Optional[bool]:
        """Unknown across nodes (None): the guard then follows no upload."""
        return None

    def close(self) -> None:
        import ray

        for node in self._nodes.values():
            with contextlib.suppress(Exception):  # already gone with its node
                ray.kill(node.actor)
        self._nodes.clear()

    # ------------------------------------------------------------------ internals

    def _place_actors(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for entry in ray.nodes():
            node_id = entry.get("NodeID")
            if not entry.get("Alive") or not node_id or node_id in self._nodes:
                continue
            actor = _actor_class().options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, False),
            ).remote(self._url_for_node(entry))
            address = str(entry.get("NodeManagerAddress") or node_id[:8])
            self._nodes[node_id] = _Node(node_id, f"{address} ({node_id[:8]})", actor)
            logger.info("asking the daemon of ray node %s", address)

    def _answer(self, node: _Node, ref: Any, ready: list[Any]) -> Expiry:
        import ray

        if ref not in ready:
            raise TimeoutError(f"no answer within {self._timeout:g} s")
        body, problem, node.ran_on = ray.get(ref)
        if body is None:
            raise ConnectionError(problem or "the daemon did not answer")
        if node.problem is not None:
            logger.info("ray node %s answers again", node.address)
            node.problem = None
        return Expiry.from_json(body)

    def _fail(self, node: _Node, problem: str) -> None:
        if node.problem != problem:
            kept = (f"its last deadline {node.known.expires_at} still counts"
                    if node.known is not None else "no deadline known from it")
            logger.warning("ray node %s: %s; %s", node.address, problem, kept)
        node.problem = problem


_ACTOR: Any = None


def _actor_class() -> Any:
    """The per-node actor, defined on first use so that importing this module needs no
    Ray."""
    global _ACTOR
    if _ACTOR is None:
        import ray

        @ray.remote(num_cpus=0)
        class NodeDaemon:
            def __init__(self, url: str) -> None:
                self._client = SidecarClient(url)

            def expiry(self) -> tuple[Optional[dict[str, Any]], Optional[str], str]:
                answer = self._client.expiry()
                body = None if answer is None else answer.to_json()
                return body, self._client.last_error, ray.get_runtime_context().get_node_id()

            def send_event(self, event: dict[str, Any]) -> None:
                self._client.send_event(event)  # queued; its thread posts it

        _ACTOR = NodeDaemon
    return _ACTOR
