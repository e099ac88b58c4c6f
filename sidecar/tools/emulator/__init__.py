"""A fake Volcengine cloud for tests and the demo: the signed ECS OpenAPI
(DescribeInstances, DescribeScheduledInstances), the ECS metadata service and a small
control API, on one real HTTP server. Standard library only."""

from __future__ import annotations

from sidecar.tools.emulator.server import DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY, Emulator
from sidecar.tools.emulator.state import FAULT_KINDS

__all__ = ["DEFAULT_ACCESS_KEY", "DEFAULT_SECRET_KEY", "FAULT_KINDS", "Emulator"]
