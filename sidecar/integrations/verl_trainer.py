"""verl's V1 trainer (verl 0.9+, ``trainer.use_v1: true``, the default): the guard decides
when ``_save_checkpoint()`` runs, as in every other integration.

The V1 loop (``verl/trainer/ppo/v1/trainer_base.py``, ``PPOTrainer.fit``) saves only on
``trainer.save_freq`` and never asks ``should_save_ckpt_esi``. Of its hooks we wrap
``PPOTrainer.step``, the one method every V1 trainer (sync, colocated async, separate
async) inherits unchanged and that ``fit`` calls once per step, right before verl's own
``save_freq`` save. Why not the others: ``on_step_begin``/``on_step_end`` are overridden
by the subclasses (without ``super()``), so a hook there would miss some modes; the
``trainer.checkpoint_callback_class`` hook runs only after a save, so it cannot cause one;
patching ``fit`` would mean copying verl's loop.

After each step the wrapper (one :class:`CheckpointGuard` per trainer, on the driver):

- times the step (``guard.step()``) and asks ``should_save()``: the final save near the
  deadline, once, then a top-up when one fits. It runs ``self._save_checkpoint()`` timed
  as that save; when verl's own ``save_freq`` save falls on the same step, verl's call
  is skipped, so the step is never saved twice. Every other ``save_freq`` save is timed,
  so the guard knows the save time before it matters;
- asks ``should_stop()``: after the final save it waits for the release (a renewal
  resumes training, the rule re-armed); when the release comes it ends ``fit`` after this
  step (``total_training_steps`` is set to the current step: the loop's own exit, so
  ``on_train_end`` runs) and sets ``trainer.esi_sidecar_released``.

Settings: the daemon at ``$ESI_SIDECAR_URL`` (every node's daemon, comma-separated, for a
job that spans nodes: the earliest deadline wins); without it, in a Ray cluster of several
nodes, every node's own daemon through a small actor per node
(``sidecar.integrations.ray_nodes``); ``trainer.esi_redundant_time`` as the
margin when it is above 0 (verl's default 0 keeps ours, 120 s); ``+trainer.esi_save_seconds``
(ours) as the save time assumed until a save was measured (default 60 s). The wrapper never raises
into verl: a failure of its own is logged once and training goes on (a save that fails
raises, as verl's own save would).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable, Optional

from sidecar.train.client import ENV_URL
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

__all__ = ["GUARD_ATTRIBUTE", "RELEASED_ATTRIBUTE", "guard_for", "unwrap_step", "wrap_step"]

logger = logging.getLogger("sidecar.integrations.verl_trainer")

GUARD_ATTRIBUTE = "esi_sidecar_guard"
RELEASED_ATTRIBUTE = "esi_sidecar_released"
_WRAPPED = "__esi_sidecar_wrapped__"


def guard_for(trainer: Any) -> CheckpointGuard:
    """The trainer's guard, built on first use from its config."""
    guard: Optional[CheckpointGuard] = trainer.__dict__.get(GUARD_ATTRIBUTE)
    if guard is None:
        options: dict[str, Any] = {}
        for key, option in (("esi_redundant_time", "redundant_seconds"),
                            ("esi_save_seconds", "save_seconds")):
            value = _config_value(trainer, key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                options[option] = float(value)
        guard = CheckpointGuard(_cluster_client(), policy=SavePolicy(**options))
        setattr(trainer, GUARD_ATTRIBUTE, guard)
    return guard


def _cluster_client() -> Any:
    """Every node's daemon through Ray (``sidecar.integrations.ray_nodes``) when this
    process is in a Ray cluster of several nodes and ``ESI_SIDECAR_URL`` does not say
    otherwise; else None (the guard asks ``$ESI_SIDECAR_URL``, default this host's)."""
    ray = sys.modules.get("ray")
    if ENV_URL in os.environ or ray is None or not ray.is_initialized():
        return None
    alive = [node for node in ray.nodes() if node.get("Alive")]
    if len(alive) < 2:
        return None
    from sidecar.integrations.ray_nodes import NodeDeadlines

    logger.info("a Ray cluster of %d nodes: asking every node's daemon", len(alive))
    return NodeDeadlines()


def wrap_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``PPOTrainer.step`` with the guard's decision after it (idempotent)."""
    if getattr(step, _WRAPPED, None) is not None:
        return step

    @functools.wraps(step)
    def guarded_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = _safely(lambda: guard_for(self))
        if guard is None:
            return step(self, *args, **kwargs)
        with guard.step():
            batch = step(self, *args, **kwargs)
        # The guard never raises; a save that fails raises as verl's own save would.
        _after_step(self, guard)
        return batch

    setattr(guarded_step, _WRAPPED, step)
    return guarded_step


def unwrap_step(step: Callable[..., Any]) -> Callable[..., Any]:
    original: Optional[Callable[..., Any]] = getattr(step, _WRAPPED, None)
    return step if original is None else original


def _after_step(trainer: Any, guard: CheckpointGuard) -> None:
    step = int(trainer.global_steps)
    routine = _routine_save_due(trainer)
    if guard.should_save():
        with guard.saving(step):
            trainer._save_checkpoint()
        if routine:  # verl's own save of this same step, right after: already done
            _skip_the_next_save(trainer, step)
    elif routine:
        _time_the_next_save(trainer, guard, step)  # it teaches the guard the save time
    if guard.should_stop():
        if guard.released:
            setattr(trainer, RELEASED_ATTRIBUTE, True)
        logger.info("ending verl's training loop after step %d: %s", step,
                    guard.status().reason)
        trainer.total_training_steps = step  # the loop's own exit: on_train_end runs


def _routine_save_due(trainer: Any) -> bool:
    """verl's own condition in ``fit``: ``save_freq > 0`` and (last step or a multiple)."""
    save_freq = _config_value(trainer, "save_freq")
    if not isinstance(save_freq, int) or save_freq <= 0:
        return False
    step = int(trainer.global_steps)
    return step >= int(trainer.total_training_steps) or step % save_freq == 0


def _time_the_next_save(trainer: Any, guard: CheckpointGuard, step: int) -> None:
    """Time verl's own save of this step as the guard's save: an instance attribute that
    shadows the method for one call."""
    method = type(trainer)._save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> Any:
        trainer.__dict__.pop("_save_checkpoint", None)
        with guard.saving(step):
            return method(trainer, *args, **kwargs)

    trainer._save_checkpoint = timed_save


def _skip_the_next_save(trainer: Any, step: int) -> None:
    def already_saved(*args: Any, **kwargs: Any) -> None:
        trainer.__dict__.pop("_save_checkpoint", None)
        logger.info("step %d is saved already (the final checkpoint): verl's save_freq save "
                    "of it is skipped", step)

    trainer._save_checkpoint = already_saved


def _config_value(trainer: Any, key: str) -> Any:
    try:
        return trainer.config.trainer.get(key)
    except Exception:
        return None


_warned = False


def _safely(action: Callable[[], Any]) -> Any:
    global _warned
    try:
        return action()
    except Exception:
        if not _warned:
            _warned = True
            logger.exception("esi-sidecar's verl hook failed; training goes on without it")
        return None
