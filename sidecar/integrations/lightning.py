"""Lightning callback: save before the machine is released, then stop.

    from sidecar.integrations.lightning import EsiCheckpointCallback
    trainer = lightning.Trainer(..., callbacks=[EsiCheckpointCallback(dirpath="ckpt")])
    # resume: trainer.fit(model, ckpt_path="last") or ckpt_path=callback.last_checkpoint_path

The decision point is the end of a training batch that completed an optimizer step
(``trainer.global_step`` moved; batches that only accumulate gradients are skipped, since
a checkpoint there would drop the accumulated gradients). It records the time since the
previous decision point (data loading, the step, validation all count), asks the guard
on every rank and, when true, saves through ``trainer.save_checkpoint(path)`` on every
rank: Lightning's save is collective (the strategy gathers or barriers inside it), so a
rank that skipped it would hang the others. That is also why the default guard reduces
its inputs across ranks when ``torch.distributed`` is initialised. After the save,
``trainer.should_stop`` is set when ``stop_after_save`` and no further step plus save
fits before the deadline. Note that Lightning honours ``should_stop`` only once
``min_steps`` / ``min_epochs`` are met, and may run a validation pass before leaving.

Lightning is imported when ``EsiCheckpointCallback`` is first looked up (``lightning``,
else the older ``pytorch_lightning`` package), not when this module is imported.
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from sidecar.client import CheckpointGuard
from sidecar.integrations.distributed import distributed_guard

__all__ = ["DEFAULT_FILENAME", "EsiCheckpointCallback"]

DEFAULT_FILENAME = "esi-epoch={epoch}-step={step}.ckpt"

if TYPE_CHECKING:
    EsiCheckpointCallback: Any


class _EsiLightningLogic:
    """The callback's behaviour, free of Lightning so that the class can be built lazily."""

    def __init__(
        self,
        dirpath: Union[str, os.PathLike[str], None] = None,
        guard: Optional[CheckpointGuard] = None,
        stop_after_save: bool = True,
        *,
        filename: str = DEFAULT_FILENAME,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        self.guard = guard
        self.stop_after_save = stop_after_save
        self._monotonic = monotonic
        self._since: Optional[float] = None
        self._decided_step: Optional[int] = None
        self.last_checkpoint_path: Optional[str] = None
        self.saves = 0
        self.stopped = False

    def _guard(self) -> CheckpointGuard:
        if self.guard is None:
            # Built at first use: the strategy has initialised torch.distributed by then.
            self.guard = distributed_guard()
        return self.guard

    def checkpoint_path(self, trainer: Any) -> str:
        """Where the next save goes: ``dirpath`` (default ``<default_root_dir>/checkpoints``)."""
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        name = self.filename.format(epoch=trainer.current_epoch, step=trainer.global_step)
        return os.path.join(dirpath, name)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._guard()
        self._since = None
        self._decided_step = trainer.global_step

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._since is None:
            self._since = self._monotonic()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._decided_step:
            return  # gradient accumulation: no optimizer step yet, nothing to decide
        self._decided_step = step
        guard = self._guard()
        now = self._monotonic()
        if self._since is not None:
            guard.record_step(max(0.0, now - self._since))
        self._since = now
        if not guard.should_save():  # collective with a reducer: every rank calls it here
            return
        path = self.checkpoint_path(trainer)
        with guard.saving():  # timed and counted only if it returns
            trainer.save_checkpoint(path)  # collective as well: every rank calls it here
        self.last_checkpoint_path = path
        self.saves += 1
        self._since = self._monotonic()  # the save is not part of the next step
        if self.stop_after_save and guard.should_stop():
            trainer.should_stop = True
            self.stopped = True


def _lightning_callback_base() -> type:
    # importlib, not two import statements: both packages may be installed, with
    # distinct Callback classes, and the Trainer only accepts its own package's.
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        base: type = module.Callback
        return base
    raise ImportError("EsiCheckpointCallback needs lightning (pip install lightning)")


@functools.cache
def _callback_class() -> type:
    base = _lightning_callback_base()

    class EsiCheckpointCallback(_EsiLightningLogic, base):  # type: ignore[misc,valid-type]
        """Lightning ``Callback`` that saves once before the release and then stops.

        ``EsiCheckpointCallback(dirpath=None, guard=None, stop_after_save=True, *,
        filename="esi-epoch={epoch}-step={step}.ckpt")``. ``last_checkpoint_path``,
        ``saves`` and ``stopped`` say what it did.
        """

    EsiCheckpointCallback.__module__ = __name__
    EsiCheckpointCallback.__qualname__ = "EsiCheckpointCallback"
    return EsiCheckpointCallback


def __getattr__(name: str) -> Any:
    if name == "EsiCheckpointCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
