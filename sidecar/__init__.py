"""esi-sidecar: save your checkpoint before a reclaimable GPU machine is released.

Only the training-side API is re-exported here; importing ``sidecar`` never pulls in
the daemon's dependencies (standard library only).
"""

from __future__ import annotations

from sidecar.client import SidecarClient, env_deadline
from sidecar.guard import CheckpointGuard, GuardStatus, Reducer
from sidecar.models import Decision, Expiry
from sidecar.policy import PolicyDecision, SavePolicy

__version__ = "0.1.0"

__all__ = [
    "CheckpointGuard",
    "Decision",
    "Expiry",
    "GuardStatus",
    "PolicyDecision",
    "Reducer",
    "SavePolicy",
    "SidecarClient",
    "__version__",
    "env_deadline",
]
