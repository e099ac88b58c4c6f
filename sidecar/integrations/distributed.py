"""``torch.distributed`` support: every rank decides alike, so every rank saves together.

Why: a checkpoint of a data- or model-parallel job is collective (DDP, FSDP, DeepSpeed all
gather or barrier inside the save). Each node asks its own daemon and measures its own
steps, so without agreement one rank may decide to save a step before the others; it
then waits inside the save's collective while the others wait inside the next step's:
the job hangs until the process-group timeout, right before the machine is released.

:class:`TorchReducer` implements :class:`sidecar.train.vote.Reducer` with ONE ``all_reduce``
per decision (float64, the vote's numbers: each slot MIN or MAX as ``sidecar.train.vote.Vote``
declares it, the MAX ones negated so a single MIN serves them all).

    from sidecar.integrations.distributed import distributed_guard
    guard = distributed_guard()   # a TorchReducer when torch.distributed is initialised

torch is imported inside the functions: ``import sidecar.integrations.distributed`` works
in an image without torch, and :func:`reducer_if_distributed` then answers None.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from sidecar.train.guard import CheckpointGuard, Reducer
from sidecar.train.policy import SavePolicy
from sidecar.train.vote import MIN, Op

_log = logging.getLogger("sidecar.integrations.distributed")

__all__ = ["TorchReducer", "distributed_guard", "reducer_if_distributed"]

# Backends whose collectives take CPU tensors. "cpu:gloo,cuda:nccl" style strings name a
# CPU backend too and are handled by the "cpu:" test below.
_CPU_BACKENDS = ("gloo", "mpi", "ucc")


class TorchReducer:
    """The :class:`~sidecar.train.guard.Reducer` for ``torch.distributed``.

    - ``group``: the process group whose ranks must agree (default: the world).
    - ``device``: where the vote's numbers travel. Default: chosen from the group's backend
      on each call: CPU for gloo/mpi/ucc (or a mixed "cpu:gloo,cuda:nccl" backend), the
      current CUDA device for nccl (NCCL only reduces device tensors), the current
      accelerator for other device backends.

    Collective: call it on every rank of ``group`` the same number of times. Errors from
    ``all_reduce`` (a timeout, a dead peer) propagate: pretending to agree would hang or
    split the job later.
    """

    def __init__(self, group: Any = None, device: Any = None) -> None:
        self.group = group
        self.device = device

    def _device(self) -> Any:
        import torch
        import torch.distributed as dist

        if self.device is not None:
            return torch.device(self.device)
        backend = str(dist.get_backend(self.group)).lower()
        if backend in _CPU_BACKENDS or "cpu:" in backend:
            return torch.device("cpu")
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            kind = accelerator.current_accelerator()
            return torch.device(kind.type, accelerator.current_device_index())
        return torch.device("cpu")

    def __call__(self, values: Sequence[float], ops: Sequence[Op], /) -> list[float]:
        import torch
        import torch.distributed as dist

        # One MIN reduction serves both kinds: a MAX slot travels negated. The sentinels
        # survive: -(-1) stays the largest "unknown" step/save/upload, and -(-inf) = +inf
        # under MIN loses to any rank that made a save.
        signs = [1.0 if op == MIN else -1.0 for op in ops]
        tensor = torch.tensor([sign * value for sign, value in zip(signs, values)],
                              dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return [sign * float(value) for sign, value in zip(signs, tensor.tolist())]

    def __repr__(self) -> str:
        return f"TorchReducer(group={self.group!r}, device={self.device!r})"


def reducer_if_distributed(group: Any = None) -> Optional[TorchReducer]:
    """A :class:`TorchReducer` when ``torch.distributed`` is initialised, else None.

    None also when torch is not installed, so a single-process script and a launcher-run
    job can share one line: ``CheckpointGuard(reducer=reducer_if_distributed())``. Call it
    after ``init_process_group`` (HF's ``TrainingArguments`` and Lightning's strategies do
    that before training starts).
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return TorchReducer(group=group)


def distributed_guard(
    *, reducer: Optional[Reducer] = None, group: Any = None, **guard_options: Any
) -> CheckpointGuard:
    """A :class:`~sidecar.train.guard.CheckpointGuard` that agrees across ranks when distributed.

    ``guard_options`` go to ``CheckpointGuard`` (``client``, ``policy``, ``clock``, ...).
    ``reducer`` defaults to :func:`reducer_if_distributed` for ``group``.
    """
    if reducer is None:
        reducer = reducer_if_distributed(group)
    return CheckpointGuard(reducer=reducer, **guard_options)


# -- shared by the framework callbacks (transformers, lightning) ------------------------

# What a callback may pass on to distributed_guard() besides the policy: CheckpointGuard's
# own options, read from its signature so that they are named in one place, and "group".
# Not "monotonic": each callback has a keyword of that name for its own step timing.
_GUARD_OPTIONS = frozenset(
    name
    for name, parameter in inspect.signature(CheckpointGuard).parameters.items()
    if name not in ("policy", "monotonic") and parameter.kind is not inspect.Parameter.VAR_KEYWORD
) | {"group"}


def check_callback_guard_arguments(
    owner: str,
    guard: Optional[CheckpointGuard],
    policy: Optional[SavePolicy],
    guard_options: Mapping[str, Any],
) -> None:
    """Refuse, when the callback is built, what would only fail (or mislead) at train start.

    ``guard`` is a finished guard: it already holds its policy, client and reducer, so
    ``policy`` or guard options next to it would be silently ignored.
    """
    unknown = sorted(set(guard_options) - _GUARD_OPTIONS)
    if unknown:
        raise TypeError(
            f"{owner} got unexpected option(s) {', '.join(map(repr, unknown))}; "
            f"guard options are: {', '.join(sorted(_GUARD_OPTIONS))}"
        )
    if guard is not None and (policy is not None or guard_options):
        given = ["policy"] if policy is not None else []
        given += sorted(guard_options)
        raise ValueError(
            f"{owner}: pass either guard= or policy=/guard options ({', '.join(given)}), "
            "not both: a guard already holds its policy and options. Prefer policy=: the "
            "callback then builds its guard at train start, with the torch.distributed "
            "reducer when the strategy has set it up"
        )


def callback_guard(
    guard: Optional[CheckpointGuard],
    policy: Optional[SavePolicy],
    guard_options: Mapping[str, Any],
) -> CheckpointGuard:
    """The guard a callback uses from train start on: ``guard``, or one built now.

    Built now, not when the callback is: the frameworks set up torch.distributed between
    the two (Lightning inside ``trainer.fit()``), and :func:`reducer_if_distributed` can
    only find the process group once it exists. A guard passed in is used as it is; a
    warning says so when it cannot agree across ranks.
    """
    if guard is None:
        return distributed_guard(policy=policy, **guard_options)
    world_size = _world_size()
    # CheckpointGuard keeps its reducer private; a guard of another kind is trusted.
    if world_size > 1 and isinstance(guard, CheckpointGuard) and guard._vote.reducer is None:
        _log.warning(
            "the checkpoint guard passed to the callback has no reducer, but "
            "torch.distributed runs %d ranks: ranks may decide to save at different steps "
            "and hang in the collective save. Pass policy= instead of guard= (the callback "
            "then builds distributed_guard() at train start), or build the guard after the "
            "process group exists",
            world_size,
        )
    return guard


def _world_size() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 1
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())
