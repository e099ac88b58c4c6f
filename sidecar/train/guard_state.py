"""What the guard learned, kept in the checkpoint (``CheckpointGuard.state_dict``): the
rule's step and save times and the upload estimate, as plain JSON, so that the next
machine's first deadline meets measured values, not the 60 s default.

Standard library only. A state that is not one is ignored with one warning: a resume never
fails because of it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sidecar.train.policy import SavePolicy, check_seconds
from sidecar.train.upload_time import UploadTime

__all__ = ["STATE_VERSION", "dump", "load"]

# The guard's own voice: these lines are the guard's, as users filter them.
logger = logging.getLogger("sidecar.train.guard")

STATE_VERSION = 1  # of state_dict()


def dump(policy: SavePolicy, upload: UploadTime) -> dict[str, object]:
    """The guard's state: the policy's and the upload estimate."""
    return {
        "version": STATE_VERSION,
        "policy": policy.state_dict(),
        "upload_seconds": upload.to_save(),
    }


def load(state: object, policy: SavePolicy, upload: UploadTime) -> bool:
    """Seed ``policy`` and ``upload`` from :func:`dump`'s ``state``; False (and one
    warning) when it is not one."""
    try:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a guard state of version {STATE_VERSION}")
        saved = state.get("policy", {})
        if not isinstance(saved, Mapping):
            raise ValueError("policy must be a mapping")
        seconds = state.get("upload_seconds")
        if seconds is not None:
            seconds = check_seconds("upload_seconds", seconds)
        policy.load_state_dict(saved)
    except (ValueError, TypeError) as exc:
        logger.warning("ignoring the saved guard state: %s", exc)
        return False
    upload.saved_seconds = seconds
    return True
