"""Lightning callback: save before the machine is released, then stop.

    from sidecar.integrations.lightning import EsiCheckpointCallback, latest_checkpoint
    esi = EsiCheckpointCallback(dirpath="ckpt", policy=SavePolicy(save_seconds=90))
    trainer = lightning.Trainer(..., callbacks=[esi])
    trainer.fit(model, ckpt_path=latest_checkpoint("ckpt"))   # None: from scratch
    esi.exit_if_released()   # exit 75 after a stop for the release: the launcher resumes

The decision point is the end of a training batch that completed an optimizer step
(``trainer.global_step`` moved; batches that only accumulate gradients are skipped, since
a checkpoint there would drop the accumulated gradients). It records the time since the
previous decision point (data loading, the step, validation all count), asks the guard
on every rank and, when true, saves through ``trainer.save_checkpoint`` on every rank:
Lightning's save is collective (the strategy gathers or barriers inside it), so a rank
that skipped it would hang the others. That is also why the guard reduces its inputs
across ranks: without ``guard=``, the callback builds ``distributed_guard(policy=...)`` in
``on_train_start``, after the strategy has set up torch.distributed inside
``trainer.fit()`` (a guard built before ``fit()`` finds no process group, so no reducer).
After the save, ``trainer.should_stop`` is set when ``stop_after_save`` and no further
step plus save fits before the deadline. Note that Lightning honours ``should_stop`` only
once ``min_steps`` / ``min_epochs`` are met, and may run a validation pass before leaving.

The save is atomic: Lightning writes ``<name>.tmp-<pid>`` (rank 0's pid, the same name on
every rank, so sharded strategies write into one folder), then global rank 0 fsyncs it,
renames it to ``<name>`` and fsyncs the folder, and every rank learns the outcome. So a
file with the final name is complete, and :func:`latest_checkpoint` can trust names.
(Lightning's own "atomic" write stages the file in the system temp folder and moves it,
which is a copy when that folder is on another file system, and it does not fsync.)
Remote paths (``s3://...``) and ``AsyncCheckpointIO`` are written directly, as before.

This module imports Lightning (``lightning``, else the older ``pytorch_lightning``
package): the class derives from its ``Callback``, so that IDEs and type checkers see it.
``import sidecar`` and ``import sidecar.integrations`` do not import it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import string
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from sidecar.checkpoint.durable import rename_durably, sync_tree
from sidecar.integrations.distributed import callback_guard, check_callback_guard_arguments
from sidecar.train.guard import EXIT_RELEASED, CheckpointGuard
from sidecar.train.policy import SavePolicy

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:
    # One package or the other, never both: both may be installed, with distinct
    # Callback classes, and the Trainer only accepts its own package's.
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as exc:
            raise ImportError(
                f"{__name__} needs lightning (pip install lightning)"
            ) from exc

__all__ = ["DEFAULT_FILENAME", "EsiCheckpointCallback", "checkpoint_step", "latest_checkpoint"]

DEFAULT_FILENAME = "esi-epoch={epoch}-step={step}.ckpt"
PARTIAL_MARK = ".tmp-"  # "<name>.tmp-<pid>": a save in progress, or cut short

PathLike = Union[str, "os.PathLike[str]"]


class EsiCheckpointCallback(Callback):
    """Lightning ``Callback`` that saves once before the release and then stops.

    ``EsiCheckpointCallback(dirpath=None, guard=None, stop_after_save=True, *,
    policy=None, filename="esi-epoch={epoch}-step={step}.ckpt", **guard_options)``.
    Without ``guard``, ``distributed_guard(policy=policy, **guard_options)`` is built
    in ``on_train_start``, once the strategy has set up torch.distributed (guard
    options: ``refresh_seconds``, ``client``, ``daemon_retry_seconds``, ``clock``,
    ``environ``, ``reducer``, ``group``). ``guard`` with ``policy`` or guard options
    is a ValueError. ``last_checkpoint_path``, ``saves`` and ``stopped`` say what it
    did; :func:`latest_checkpoint` finds the newest save on the next start.
    """

    def __init__(
        self,
        dirpath: Optional[PathLike] = None,
        guard: Optional[CheckpointGuard] = None,
        stop_after_save: bool = True,
        *,
        policy: Optional[SavePolicy] = None,
        filename: str = DEFAULT_FILENAME,
        monotonic: Callable[[], float] = time.monotonic,
        **guard_options: Any,
    ) -> None:
        check_callback_guard_arguments("EsiCheckpointCallback", guard, policy, guard_options)
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        self.guard = guard
        self.policy = policy
        self._guard_options = dict(guard_options)
        self.stop_after_save = stop_after_save
        self._monotonic = monotonic
        self._since: Optional[float] = None
        self._decided_step: Optional[int] = None
        self.last_checkpoint_path: Optional[str] = None
        self.saves = 0
        self.stopped = False
        self._restored: Optional[dict[str, Any]] = None  # guard state from a checkpoint

    def _guard(self) -> CheckpointGuard:
        if self.guard is None:
            # Built at first use: the strategy has initialised torch.distributed by then.
            self.guard = callback_guard(None, self.policy, self._guard_options)
        return self.guard

    def checkpoint_path(self, trainer: Any) -> str:
        """Where the next save goes: ``dirpath`` (default ``<default_root_dir>/checkpoints``)."""
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        name = self.filename.format(epoch=trainer.current_epoch, step=trainer.global_step)
        return os.path.join(dirpath, name)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Inside trainer.fit(), after the strategy set up torch.distributed: the reducer
        # is found now. A guard passed in is checked (a warning when it cannot agree).
        self.guard = callback_guard(self.guard, self.policy, self._guard_options)
        if self._restored is not None:
            self.guard.load_state_dict(self._restored)  # what it learned before the resume
            self._restored = None
        self._since = None
        self._decided_step = trainer.global_step

    # Lightning keeps a callback's state_dict in every checkpoint it writes and hands it
    # back before training starts when fit(ckpt_path=...) resumes: step and save times
    # travel with the checkpoint.
    def state_dict(self) -> dict[str, Any]:
        return {"guard": self._guard().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("guard")

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
            # Trained on towards a top-up that no longer fits: stop (and wait) now.
            # The decision is the reduced one, so every rank takes this branch alike.
            decision = guard.last_decision
            if self.stop_after_save and decision is not None and decision.stop:
                self._stop(trainer, guard)
                self._since = self._monotonic()
            return
        path = self.checkpoint_path(trainer)
        with guard.saving(step):  # timed and counted only if it returns
            _save_atomically(trainer, path)  # collective as well: every rank calls it here
        self.last_checkpoint_path = path
        self.saves += 1
        if self.stop_after_save:
            self._stop(trainer, guard)
        # Neither the save nor a wait for the release (a renewal resumes) is a step.
        self._since = self._monotonic()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is not None:  # the daemon no longer counts the job as running
            self.guard.finish("training ended" if not self.stopped
                              else "training stopped for the release")

    def exit_if_released(self) -> None:
        """After ``trainer.fit()``: ``raise SystemExit(EXIT_RELEASED)`` (75) when this
        callback stopped training for the release, so that the launcher resumes the job
        on the next machine instead of taking exit 0 for the end of training."""
        if self.stopped:
            raise SystemExit(EXIT_RELEASED)

    def _stop(self, trainer: Any, guard: CheckpointGuard) -> None:
        if guard.should_stop():  # collective; may wait for the release
            trainer.should_stop = True
            self.stopped = True


# -- the atomic save ----------------------------------------------------------------------


def _save_atomically(trainer: Any, path: str) -> None:
    """``trainer.save_checkpoint`` under a temporary name, renamed into place when complete.

    Collective: every rank calls it, with the same ``path``. Errors in the rename are
    raised on every rank (broadcast), so no rank is left waiting in a collective alone.
    """
    strategy = trainer.strategy
    if "://" in path or _writes_in_background(strategy):
        # os.replace cannot move a remote object; a background writer may not have
        # created the file yet when save_checkpoint returns.
        trainer.save_checkpoint(path)
        return
    # Rank 0's pid names the temporary: every rank must pass Lightning the same path.
    partial = strategy.broadcast(f"{path}{PARTIAL_MARK}{os.getpid()}")
    trainer.save_checkpoint(partial)  # ends with a barrier: every rank's part is written
    failure: Optional[OSError] = None
    if trainer.is_global_zero:  # the rank that writes in Lightning's default CheckpointIO
        try:
            _commit(partial, path)
        except OSError as exc:
            failure = exc
    message = strategy.broadcast(None if failure is None else f"{failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise OSError(f"rank 0 could not move checkpoint {partial} to {path}: {message}")


def _writes_in_background(strategy: Any) -> bool:
    checkpoint_io = getattr(strategy, "checkpoint_io", None)
    return any(cls.__name__ == "AsyncCheckpointIO" for cls in type(checkpoint_io).__mro__)


def _commit(partial: str, path: str) -> None:
    """fsync ``partial`` (a file or a sharded checkpoint's folder), rename it to ``path``,
    fsync the parent folder (ARCHITECTURE.md, "Writes that must survive a crash")."""
    sync_tree(partial)
    if os.path.isdir(path) and not os.path.islink(path):
        # os.replace cannot replace a folder holding files (a sharded checkpoint saved
        # under this name before): move the old one aside, then drop it.
        old = f"{path}{PARTIAL_MARK}{os.getpid()}-old"
        os.replace(path, old)
        rename_durably(partial, path, rename=os.replace)
        shutil.rmtree(old, ignore_errors=True)
    else:
        rename_durably(partial, path, rename=os.replace)


# -- finding the newest checkpoint ----------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _name_pattern(filename: str) -> re.Pattern[str]:
    """A regular expression for the names ``filename.format(epoch=E, step=S)`` produces."""
    parts: list[str] = []
    seen: set[str] = set()
    for literal, field, _spec, _conversion in string.Formatter().parse(filename):
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field not in ("epoch", "step"):
            raise ValueError(f"filename {filename!r}: unknown field {{{field}}} "
                             "(only {epoch} and {step})")
        parts.append(f"(?P={field})" if field in seen else rf"(?P<{field}>\d+)")
        seen.add(field)
    if "step" not in seen:
        raise ValueError(f"filename {filename!r} has no {{step}}: saves would share a name")
    return re.compile("".join(parts))


def checkpoint_step(path: PathLike, filename: str = DEFAULT_FILENAME) -> Optional[int]:
    """The global step in a name the callback gives its checkpoints, or None for another
    name (a temporary ``<name>.tmp-<pid>`` included). ``filename``: the callback's."""
    match = _name_pattern(filename).fullmatch(Path(path).name)
    return None if match is None else int(match["step"])


def latest_checkpoint(dirpath: PathLike, filename: str = DEFAULT_FILENAME) -> Optional[Path]:
    """The callback's newest complete checkpoint in ``dirpath`` (highest global step), or
    None when there is none (or no such folder), for ``trainer.fit(ckpt_path=...)``.

    Complete because the callback renames a save into place only once it is written and
    fsynced; a save cut short stays ``<name>.tmp-<pid>``, which is skipped (delete it
    when no save is running). ``filename``: the pattern the callback was given.
    """
    pattern = _name_pattern(filename)
    try:
        entries = list(os.scandir(dirpath))
    except (FileNotFoundError, NotADirectoryError):
        return None
    newest: Optional[tuple[int, int, str]] = None
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        epoch = match.groupdict().get("epoch")
        key = (int(match["step"]), -1 if epoch is None else int(epoch), entry.path)
        if newest is None or key > newest:
            newest = key
    return None if newest is None else Path(newest[2])

