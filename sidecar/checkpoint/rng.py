"""Save and restore the global random number generators (standard library only).

Part of a complete checkpoint (see docs/checkpoints.md): the resumed run draws the same
dropout masks, augmentations and samples as the run that was killed. Re-exported from
:mod:`sidecar.checkpoint.folders`, where most code imports it. NumPy and torch are never imported
here at import time: :func:`capture_rng_state` reads them only once the program has, and
:func:`restore_rng_state` imports them only when the saved state holds their part.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

__all__ = ["capture_rng_state", "restore_rng_state"]

# The checkpoint logger, where these warnings were always reported: users filter and test
# the messages of a resume under that name.
_log = logging.getLogger("sidecar.checkpoint")


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states of Python ``random``, NumPy, torch CPU and CUDA.

    Plain Python values only (lists, ints, floats, strings), so the result survives
    ``torch.load(weights_only=True)`` (torch's default), JSON and pickle alike. NumPy and
    torch are included when the program has already imported them: a library never
    imported has no RNG state worth saving, and importing torch here would cost seconds.
    CUDA is included once CUDA is initialised (asking earlier would create a context on
    every visible GPU). Generators you own (a DataLoader's ``torch.Generator``, a NumPy
    ``Generator``) are yours to save.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss_next]}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, key, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "bit_generator": str(name),
            "key": [int(value) for value in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        }
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state().tolist()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured; parts this process cannot take
    (NumPy not installed, no GPU now) are skipped with a warning rather than failing the
    resume."""
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            _log.warning("checkpoint holds a NumPy RNG state but NumPy is not installed")
        else:
            saved = state["numpy"]
            numpy.random.set_state(
                (
                    saved["bit_generator"],
                    numpy.asarray(saved["key"], dtype=numpy.uint32),
                    saved["pos"],
                    saved["has_gauss"],
                    saved["gauss"],
                )
            )
    if "torch" in state or "torch_cuda" in state:
        try:
            import torch
        except ImportError:
            _log.warning("checkpoint holds a torch RNG state but torch is not installed")
            return
        if "torch" in state:
            torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        cuda_states = state.get("torch_cuda") or []
        if cuda_states:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count != len(cuda_states):
                _log.warning(
                    "checkpoint holds CUDA RNG states for %d devices, this process sees %d; "
                    "restoring the first %d",
                    len(cuda_states),
                    count,
                    min(count, len(cuda_states)),
                )
            for index, values in enumerate(cuda_states[:count]):
                torch.cuda.set_rng_state(torch.tensor(values, dtype=torch.uint8), index)
