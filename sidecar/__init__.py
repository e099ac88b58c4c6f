"""esi-sidecar: save your checkpoint before a reclaimable GPU machine is released.

Only the training-side API is re-exported here; importing ``sidecar`` never pulls in
the daemon's dependencies.
"""

from __future__ import annotations

__version__ = "0.1.0"
