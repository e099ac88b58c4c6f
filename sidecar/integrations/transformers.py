"""Hugging Face ``Trainer`` callback: save before the machine is released, then stop.

    from sidecar.integrations.transformers import EsiCheckpointCallback
    esi = EsiCheckpointCallback()
    trainer = Trainer(..., callbacks=[esi])
    trainer.train()
    esi.exit_if_released()   # exit 75 after a stop for the release: the launcher resumes

How it maps onto the Trainer's events:

- ``on_step_end`` is the decision point (after the optimizer step, before the Trainer's
  own log/evaluate/save). It records the time since the previous decision point (data
  loading, the step, logging and evaluation all delay the next chance to save, so all
  count), asks ``guard.should_save()`` and, when true, sets ``control.should_save``: the
  Trainer then writes ``checkpoint-<step>`` through its own ``_save_checkpoint`` (model,
  optimizer, scheduler, RNG, trainer state), so resuming works as usual.
- ``on_save`` fires after that save on every process. The time since ``on_step_end`` is
  recorded as the save's duration; any save counts, also the Trainer's periodic ones,
  since each of them covers a near deadline just as well. When ``stop_after_save`` and
  the guard says no further step plus save fits (``should_stop()``), it sets
  ``control.should_training_stop``.

The save rule: ``EsiCheckpointCallback(policy=SavePolicy(save_seconds=..., ...))``; guard
options such as ``refresh_seconds`` or ``client`` are keywords too. The guard is built at
``on_train_begin`` from them, with ``distributed_guard()``: in multi-process training every
process runs the callbacks, and that guard gets a
:class:`~sidecar.integrations.distributed.TorchReducer` once ``torch.distributed`` is
initialised, so all ranks decide alike (the Trainer's save is collective). ``guard=``
takes a finished guard instead (not together with ``policy=``: a ValueError); build it
with ``distributed_guard()`` after the process group exists, for the same reason.

Resuming: the Trainer writes ``checkpoint-<step>`` in place, not atomically, and its
``get_last_checkpoint`` returns the highest step whether or not that save finished. A
job killed mid-save would resume from a half-written folder. :func:`latest_complete_checkpoint`
returns the newest folder whose ``trainer_state.json`` (the file ``_save_checkpoint`` writes
last, after model, optimizer, scheduler and RNG state) exists, parses and names that step.
The Trainer's "missing keys" warning after a resume leaves out keys tied to a loaded one
(GPT-2's ``lm_head.weight``), and is said only when a key is truly missing.

This module imports transformers (the class derives from ``TrainerCallback``, so that
IDEs and type checkers see it); ``import sidecar`` and ``import sidecar.integrations`` do not.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

from transformers import TrainerCallback

from sidecar.checkpoint.durable import replace_atomically
from sidecar.integrations.distributed import callback_guard, check_callback_guard_arguments
from sidecar.train.guard import EXIT_RELEASED, CheckpointGuard
from sidecar.train.policy import SavePolicy

__all__ = ["GUARD_STATE_FILE", "EsiCheckpointCallback", "latest_complete_checkpoint"]

# Kept in each checkpoint-N folder the Trainer writes: what the guard learned (step and
# save times, the upload estimate), loaded again when training resumes from that folder.
GUARD_STATE_FILE = "esi_sidecar_guard.json"

log = logging.getLogger("sidecar.integrations.transformers")

_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
_STATE_NAME = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written last


def latest_complete_checkpoint(output_dir: Any) -> Optional[str]:
    """The newest ``checkpoint-<step>`` the Trainer finished writing, or None.

    Pass it as ``trainer.train(resume_from_checkpoint=...)`` instead of
    ``get_last_checkpoint(output_dir)``. A folder is skipped, with a warning, when its
    trainer state is missing, does not parse, or gives another step.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        match = _CHECKPOINT_NAME.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    for step, folder in sorted(found, reverse=True):
        try:
            state = json.loads((folder / _STATE_NAME).read_text(encoding="utf-8"))
            complete = state.get("global_step") == step
            reason = f"its {_STATE_NAME} is for step {state.get('global_step')}"
        except (OSError, ValueError, AttributeError) as exc:
            complete, reason = False, f"no readable {_STATE_NAME} ({type(exc).__name__})"
        if complete:
            return str(folder)
        log.warning("skipping %s: %s (an interrupted save?)", folder, reason)
    return None


# The Trainer's warning after a resume (transformers' trainer.py, _issue_warnings_after_load).
_MISSING_KEYS = "There were missing keys in the checkpoint model loaded: "


def _tied_to_loaded(model: Any, missing: list[str]) -> set[str]:
    """The keys of ``missing`` whose tensor is also another key's that was loaded (GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``): loaded with it, not missing."""
    by_pointer: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        pointer = tensor.data_ptr()
        if pointer:  # 0: no storage (a meta tensor)
            by_pointer.setdefault(pointer, set()).add(name)
    return {name for names in by_pointer.values() if names - set(missing)
            for name in names & set(missing)}


class _TiedKeysFilter(logging.Filter):
    """On transformers' Trainer logger: a resume's "missing keys" warning leaves out the
    keys tied to a loaded one, and is dropped when no other key is missing."""

    def __init__(self) -> None:
        super().__init__()
        self.model: Callable[[], Any] = lambda: None  # a weak reference to the model

    def filter(self, record: logging.LogRecord) -> bool:
        message, model = record.getMessage(), self.model()
        if model is None or not message.startswith(_MISSING_KEYS):
            return True
        try:
            keys = ast.literal_eval(message[len(_MISSING_KEYS):].rstrip("."))
            missing = [key for key in keys if isinstance(key, str)]
            tied = _tied_to_loaded(model, missing)
        except Exception:  # another message than the one we know: leave it as it is
            return True
        missing = [key for key in missing if key not in tied]
        record.msg, record.args = f"{_MISSING_KEYS}{missing}.", ()
        return bool(missing)


_TIED_KEYS = _TiedKeysFilter()


class EsiCheckpointCallback(TrainerCallback):
    """``TrainerCallback`` that saves once before the release and then stops.

    ``EsiCheckpointCallback(guard=None, stop_after_save=True, *, policy=None,
    **guard_options)``: without ``guard``, ``distributed_guard(policy=policy,
    **guard_options)`` is built at the start of training (guard options:
    ``refresh_seconds``, ``client``, ``daemon_retry_seconds``, ``clock``, ``environ``,
    ``reducer``, ``group``). ``guard`` with ``policy`` or guard options is a
    ValueError. ``saves_requested``, ``saves_recorded`` and ``stopped`` say what it did.
    """

    def __init__(
        self,
        guard: Optional[CheckpointGuard] = None,
        stop_after_save: bool = True,
        *,
        policy: Optional[SavePolicy] = None,
        monotonic: Callable[[], float] = time.monotonic,
        **guard_options: Any,
    ) -> None:
        check_callback_guard_arguments("EsiCheckpointCallback", guard, policy, guard_options)
        self.guard = guard
        self.policy = policy
        self._guard_options = dict(guard_options)
        self.stop_after_save = stop_after_save
        self._monotonic = monotonic
        self._since: Optional[float] = None  # monotonic start of the step being timed
        self._decided_at: Optional[float] = None  # monotonic, at the step end
        self.saves_requested = 0
        self.saves_recorded = 0
        self.stopped = False
        self.restored_from: Optional[str] = None  # the guard state file loaded at train begin

    def _guard(self) -> CheckpointGuard:
        if self.guard is None:
            # Built at first use, not in __init__: torch.distributed is initialised by
            # then (TrainingArguments sets it up), so the reducer is chosen correctly.
            self.guard = callback_guard(None, self.policy, self._guard_options)
        return self.guard

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # Before train() loads a checkpoint: its warning says only truly missing keys.
        model = kwargs.get("model")
        if model is not None and hasattr(model, "state_dict"):
            _TIED_KEYS.model = weakref.ref(model)
            logging.getLogger("transformers.trainer").addFilter(_TIED_KEYS)
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # A guard passed in is checked here (a warning when it cannot agree across ranks).
        self.guard = callback_guard(self.guard, self.policy, self._guard_options)
        self._since = None
        self._decided_at = None
        # Resumed from checkpoint-N: seed the guard with what it had learned by then.
        saved = Path(args.output_dir) / f"checkpoint-{state.global_step}" / GUARD_STATE_FILE
        if state.global_step > 0 and saved.is_file():
            try:
                loaded = json.loads(saved.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                log.warning("ignoring %s: %s", saved, exc)
            else:
                if self.guard.load_state_dict(loaded):
                    self.restored_from = str(saved)
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._since is None:
            self._since = self._monotonic()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        guard = self._guard()
        now = self._monotonic()
        if self._since is not None:
            guard.record_step(max(0.0, now - self._since))
        self._since = now
        self._decided_at = now
        if guard.should_save():  # collective with a reducer: every rank calls it here
            control.should_save = True
            self.saves_requested += 1
        elif self.stop_after_save and guard.last_decision is not None and (
            guard.last_decision.stop
        ):
            # Trained on towards a top-up that no longer fits: stop (and wait) now. The
            # decision is the reduced one, so every rank takes this branch alike.
            self._stop(guard, control)
            self._since = self._monotonic()
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        guard = self._guard()
        now = self._monotonic()
        if self._decided_at is not None:
            # The guard dates the save's start on its own wall clock (now - seconds).
            guard.record_save(max(0.0, now - self._decided_at), step=state.global_step)
            self.saves_recorded += 1
        if state.is_world_process_zero:
            # Step and save times travel with the checkpoint the Trainer just wrote.
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                try:
                    replace_atomically(folder / GUARD_STATE_FILE,
                                       json.dumps(guard.state_dict()).encode(),
                                       f".{GUARD_STATE_FILE}.tmp")
                except OSError as exc:
                    log.warning("could not keep the guard state in %s: %s", folder, exc)
        self._decided_at = None
        if self.stop_after_save:
            self._stop(guard, control)
        # Neither the save nor a wait for the release (a renewal resumes) is a step.
        self._since = self._monotonic()
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.guard is not None:  # the daemon no longer counts the job as running
            self.guard.finish("training ended" if not self.stopped
                              else "training stopped for the release")
        return control

    def exit_if_released(self) -> None:
        """After ``trainer.train()``: ``raise SystemExit(EXIT_RELEASED)`` (75) when this
        callback stopped training for the release, so that the launcher resumes the job
        on the next machine instead of taking exit 0 for the end of training."""
        if self.stopped:
            raise SystemExit(EXIT_RELEASED)

    def _stop(self, guard: CheckpointGuard, control: Any) -> None:
        if guard.should_stop():  # collective; may wait for the release
            control.should_training_stop = True
            self.stopped = True

