"""esi-sidecar: save your checkpoint before a reclaimable GPU machine is released.

Only the training-side API is re-exported here; importing ``sidecar`` never pulls in
the daemon's dependencies (standard library only). Where things are: ``sidecar.train``
(the training side), ``sidecar.integrations`` (frameworks), ``sidecar.host`` (the daemon),
``sidecar.tools`` (emulator, simulator, demo); see docs/architecture.md.
"""

from __future__ import annotations

import os

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.models import Decision, Expiry
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import env_deadline
from sidecar.train.guard import EXIT_RELEASED, CheckpointGuard, GuardStatus, Reducer
from sidecar.train.policy import PolicyDecision, SavePolicy

__version__ = "0.1.0"

# The unrelated `sidecar` distribution (a JupyterLab widget) has the same import name: say
# so when its module is beside ours. One stat when it is not (issue 26).
if os.path.exists(os.path.join(os.path.dirname(__file__), "sidecar.py")):
    from pathlib import Path

    from sidecar.train.importname import warn_if_shared

    warn_if_shared(Path(__file__).parent)

__all__ = [
    "EXIT_RELEASED",
    "CheckpointGuard",
    "Decision",
    "Expiry",
    "GuardStatus",
    "PolicyDecision",
    "Reducer",
    "SavePolicy",
    "SidecarClient",
    "__version__",
    "atomic_checkpoint",
    "env_deadline",
    "latest_valid",
]
