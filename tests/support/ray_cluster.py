"""A real Ray cluster on this machine for the Ray integration tests: a head and more
raylets (``ray.cluster_utils.Cluster``) on 127.0.0.1, node ``i`` carrying the resource
``esi_node_i`` so that a test knows which node is which."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def local_cluster(nodes: int) -> Iterator[Any]:
    """A started cluster of ``nodes`` nodes with ``ray.init`` connected to it; skips the
    test when ray is not installed."""
    # Ray picks the host's address for its cluster unless told this is a one-machine
    # cluster; the tests reach loopback only.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = pytest.importorskip("ray", reason="make test installs ray")
    from ray.cluster_utils import Cluster

    # Ray (the cluster's head, ray.init) installs signal handlers in this process and
    # leaves them after shutdown: put back what was there, or later tests see Ray's.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    started = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"esi_node_0": 1}, "include_dashboard": False})
    for index in range(1, nodes):
        started.add_node(num_cpus=1, resources={f"esi_node_{index}": 1})
    try:
        ray.init(address=started.address, include_dashboard=False, log_to_driver=False)
        started.wait_for_nodes()
        yield started
    finally:
        ray.shutdown()
        started.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)


def node_index(entry: dict[str, Any]) -> int:
    """Which node a ``ray.nodes()`` entry is: the ``i`` of its ``esi_node_i`` resource."""
    return next(int(name.rsplit("_", 1)[1]) for name in entry["Resources"]
                if name.startswith("esi_node_"))
