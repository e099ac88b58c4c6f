"""The checkpoint format on disk, shared by both sides (standard library only).

``folders`` is the public API (atomic commit, the newest valid checkpoint, retention);
``manifest`` the format, ``leftovers`` a killed save's remains, ``durable`` the crash-safe
writes, ``rng`` the RNG state. docs/checkpoints.md says how to use them.
"""

from __future__ import annotations

from sidecar.checkpoint.folders import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointInfo,
    CheckpointListing,
    atomic_checkpoint,
    capture_rng_state,
    latest_valid,
    list_checkpoints,
    prune,
    restore_rng_state,
    validate,
)

__all__ = [
    "LATEST_NAME",
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointListing",
    "atomic_checkpoint",
    "capture_rng_state",
    "latest_valid",
    "list_checkpoints",
    "prune",
    "restore_rng_state",
    "validate",
]
