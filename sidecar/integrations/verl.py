"""verl drop-in: ``should_save_ckpt_esi`` that asks the sidecar daemon first.

verl's trainers (``verl/trainer/ppo/ray_trainer.py`` and the recipes) call, after every
step::

    esi_close_to_expiration = should_save_ckpt_esi(
        max_steps_duration=self.max_steps_duration,
        redundant_time=self.config.trainer.esi_redundant_time,
    )
    if self.config.trainer.save_freq > 0 and (... or esi_close_to_expiration):
        self._save_checkpoint()

verl's own function (``verl/utils/checkpoint/checkpoint_manager.py``) only reads
``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` / ``SAGEMAKER_..._TIMESTAMP``, which a
capacity-block platform sets when the container starts. On a reclaimable ESI / spot
machine nothing sets them: the release time is only known to the cloud's API, which the
daemon polls. This function keeps verl's signature and rule and takes the deadline from
the daemon, then from those same variables (seconds, milliseconds or RFC 3339).

Switching is one call, :func:`install`, in the process that runs verl's trainer
(verl's ``TaskRunner`` is a Ray actor, so pass it as Ray's ``worker_process_setup_hook``);
on verl 0.9's V1 trainer, which never calls this function, it also wraps the trainer's
step (``sidecar.integrations.verl_trainer``); see docs/integrations.md.

Behaviour kept from verl, on purpose, so that it is a drop-in: the answer is stateless
and stays True at every step inside the window (verl then saves at each of those steps,
as it does today), and False while ``max_steps_duration`` is 0 (before verl measured a
step): verl's rule for ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP``. Its
``SAGEMAKER_...`` branch also says True after the deadline and with no step measured; this
function does not (a save that starts after the release is lost). A fire drill
(docs/drill.md) is the one exception to statelessness: True once, then training goes on
(``sidecar.integrations.verl_drill``).

verl's single controller decides for every node, so point ``ESI_SIDECAR_URL`` at every
node's daemon (comma-separated): the earliest deadline wins, and a node whose daemon stops
answering keeps its last known deadline in that MIN.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

from sidecar.integrations.verl_drill import VerlDrill
from sidecar.train.client import DEFAULT_TIMEOUT_SECONDS, SidecarClient
from sidecar.train.deadline import DEFAULT_REFRESH_SECONDS, DEFAULT_RETRY_SECONDS, DeadlineTracker
from sidecar.train.policy import DEFAULT_SAVE_SECONDS, check_seconds, verl_rule
from sidecar.train.protection import JobFigures
from sidecar.train.release_wait import EXIT_RELEASED
from sidecar.train.routine import AUTO, RoutineSaves, check_routine

__all__ = [
    "VERL_FUNCTION",
    "VERL_MODULE",
    "configure",
    "exit_if_released",
    "install",
    "should_save_ckpt_esi",
    "uninstall",
]

logger = logging.getLogger("sidecar.integrations.verl")

VERL_MODULE = "verl.utils.checkpoint.checkpoint_manager"
VERL_FUNCTION = "should_save_ckpt_esi"



# The daemon's deadline, cached, with the same retry and env fallback as CheckpointGuard
# (one DeadlineTracker for both); the environment is read at every call, as verl does.
_cache_lock = threading.Lock()
_cache: Optional[DeadlineTracker] = None
_routine: list[Optional[RoutineSaves]] = [None]  # with the cache (configure)
_warned_internal = False
_drill: Optional[VerlDrill] = None  # the fire drill followed for the tracker in _cache


def configure(
    url: Union[str, Sequence[str], None] = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
    retry_seconds: float = DEFAULT_RETRY_SECONDS,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    environ: Optional[Mapping[str, str]] = None,
    routine_seconds: Union[str, float, None] = AUTO,
) -> None:
    """Set where :func:`should_save_ckpt_esi` asks and how often (optional).

    ``routine_seconds``: as :class:`~sidecar.train.policy.SavePolicy`'s. ``"auto"``
    (default): while a running source's notice is shorter than the step + save + upload,
    the function also answers True every Young/Daly interval (``sidecar.train.routine``),
    counted from the last True it gave (verl's own ``save_freq`` saves are not seen).

    Without a call, the first :func:`should_save_ckpt_esi` uses ``$ESI_SIDECAR_URL``
    (default ``http://127.0.0.1:8791``) and the defaults here. ``environ`` defaults to
    ``os.environ`` read at every call. Invalid arguments raise ``ValueError`` (this is
    the user's own code, at start-up); the function itself never raises.
    """
    global _cache
    refresh_seconds = check_seconds("refresh_seconds", refresh_seconds)
    retry_seconds = check_seconds("retry_seconds", retry_seconds)
    routine_seconds = check_routine(routine_seconds)
    tracker = DeadlineTracker(
        SidecarClient(url, timeout=timeout),
        refresh_seconds=refresh_seconds,
        daemon_retry_seconds=retry_seconds,
        clock=clock,
        monotonic=monotonic,
        environ=environ,
        live_environ=True,
    )
    routine = RoutineSaves.asking(tracker, routine_seconds, logger, monotonic)
    with _cache_lock:
        old, _cache = _cache, tracker
        _routine[0] = routine
    if old is not None:
        old.client.close()


def _current_cache() -> DeadlineTracker:
    with _cache_lock:
        cache = _cache
    if cache is None:
        configure()
        with _cache_lock:
            assert _cache is not None
            cache = _cache
    return cache


def _drill_for(cache: DeadlineTracker) -> VerlDrill:
    global _drill
    with _cache_lock:
        if _drill is None or _drill.tracker is not cache:
            _drill = VerlDrill(cache)
        return _drill


def should_save_ckpt_esi(
    max_steps_duration: float,
    save_ckpt_duration: float = DEFAULT_SAVE_SECONDS,
    redundant_time: float = 0,
) -> bool:
    """True when the machine is released before another step plus a save would fit.

    verl's signature and rule: ``0 < remaining <= max_steps_duration + save_ckpt_duration
    + redundant_time``, and False while ``max_steps_duration`` is not > 0. ``remaining``
    is measured to the daemon's deadline, else to the one in
    ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` /
    ``SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP``. No deadline known, or one
    already passed: False.

    Cheap enough for every step: the deadline is cached for a second (one loopback round
    trip per second otherwise). Never raises: a failure here must not stop training, so
    anything unexpected is logged once and answered False.
    """
    global _warned_internal
    try:
        cache = _current_cache()
        deadline, _source = cache.deadline()
        now = cache.clock()
        # With the daemon's uploader, a save counts once durable: local save + upload.
        save_seconds = float(save_ckpt_duration) + (cache.upload_seconds or 0.0)
        routine = _routine[0]
        if deadline is not None and verl_rule(deadline - now, float(max_steps_duration),
                                              save_seconds, float(redundant_time)):
            if routine is not None:
                routine.saved(now)
            return True
        # A fire drill (docs/drill.md): one save through verl's own, and training goes on.
        if _drill_for(cache).answer(float(max_steps_duration), save_seconds,
                                    float(redundant_time)):
            if routine is not None:
                routine.saved(now)
            return True
        if routine is None or float(max_steps_duration) <= 0 or (
                deadline is not None and deadline <= now):
            return False
        # No notice holds a save: a routine one at the Young/Daly interval (verl saves when
        # this answers True and its save_freq > 0).
        overdue = routine.overdue(now, JobFigures(float(max_steps_duration),
                                                  float(save_ckpt_duration),
                                                  cache.upload_seconds))
        if overdue is None or overdue < 0:
            return False
        logger.info("routine checkpoint now: no notice holds a save")
        routine.saved(now)
        return True
    except Exception:
        if not _warned_internal:
            _warned_internal = True
            logger.exception("should_save_ckpt_esi failed; answering False")
        return False


# ---------------------------------------------------------------------------- install

# verl's V1 trainer (0.9+): PPOTrainer.step is wrapped (sidecar.integrations.verl_trainer).
V1_MODULE = "verl.trainer.ppo.v1.trainer_base"
V1_CLASS = "PPOTrainer"
# verl <= 0.5 has no ray_kwargs in its config: the TaskRunner's Ray runtime_env is fixed,
# so install() cannot reach the process that runs the trainer.
FIRST_SUPPORTED = (0, 6)

# (module, verl's function) and the V1 classes we wrapped, for uninstall().
_replaced: list[tuple[types.ModuleType, Any]] = []
_wrapped_classes: list[type] = []
_install_lock = threading.RLock()


def _is_verl_original(value: Any) -> bool:
    return (
        callable(value)
        and value is not should_save_ckpt_esi
        and getattr(value, "__module__", None) == VERL_MODULE
        and getattr(value, "__name__", None) == VERL_FUNCTION
    )


def _patch_module(module: types.ModuleType) -> bool:
    # vars(), not getattr(): a module-level __getattr__ must not run (it may import).
    value = vars(module).get(VERL_FUNCTION)
    if not _is_verl_original(value):
        return False
    setattr(module, VERL_FUNCTION, should_save_ckpt_esi)
    _replaced.append((module, value))
    return True


def _patch_v1(module: types.ModuleType) -> bool:
    """Wrap ``PPOTrainer.step`` of verl's V1 trainer; False when already done. A verl
    whose V1 module has no such method is said so, once, loudly."""
    from sidecar.integrations.verl_trainer import wrap_step

    trainer = vars(module).get(V1_CLASS)
    step = vars(trainer).get("step") if isinstance(trainer, type) else None
    if not callable(step):
        logger.error("verl %s: %s.%s.step not found: the V1 trainer is NOT guarded "
                     "(a verl release moved its loop; please report it)",
                     _verl_version_text(), V1_MODULE, V1_CLASS)
        return False
    wrapped = wrap_step(step)
    if wrapped is step:
        return False
    assert isinstance(trainer, type)
    trainer.step = wrapped  # type: ignore[attr-defined]
    _wrapped_classes.append(trainer)
    return True


def _patch(module: types.ModuleType) -> list[str]:
    """What was patched in ``module``: the function, the V1 trainer, or nothing."""
    done = []
    if _patch_module(module):
        done.append(f"{module.__name__}.{VERL_FUNCTION}")
    if module.__name__ == V1_MODULE and _patch_v1(module):
        done.append(f"{V1_MODULE}.{V1_CLASS}.step")
    return done


def _patch_loaded_modules() -> list[str]:
    patched = []
    for _name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType):
            patched.extend(_patch(module))
    return patched


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the fresh module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        with _install_lock:
            done = _patch(module)
        if done:
            logger.info("guarded by the sidecar: %s", ", ".join(done))

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tools
        return getattr(self._loader, name)


class _VerlImportHook(importlib.abc.MetaPathFinder):
    """Patches verl's checkpoint_manager and V1 trainer as they are imported.

    Every later ``from verl.utils.checkpoint.checkpoint_manager import
    should_save_ckpt_esi`` (ray_trainer, recipes) then binds ours: this is what lets
    :func:`install` run before verl is imported, e.g. as Ray's worker setup hook.
    """

    def find_spec(
        self,
        fullname: str,
        path: Optional[Sequence[str]],
        target: Optional[types.ModuleType] = None,
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in (VERL_MODULE, V1_MODULE):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _verl_version() -> Optional[tuple[int, ...]]:
    """verl's installed version (from its metadata, without importing it), or None."""
    import importlib.metadata
    import re

    try:
        text = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _verl_version_text() -> str:
    version = _verl_version()
    return "(not installed)" if version is None else ".".join(map(str, version))


def exit_if_released(trainer: Any) -> None:
    """After ``trainer.fit()`` in a script that drives verl's V1 trainer in its own
    process: ``raise SystemExit(EXIT_RELEASED)`` (75) when the guard ended ``fit`` for the
    release (``trainer.esi_sidecar_released``), so that a launcher resumes the job on the
    next machine; returns when training ended on its own."""
    if getattr(trainer, "esi_sidecar_released", False) is True:
        logger.info("leaving with exit status %d: verl stopped for the release",
                    EXIT_RELEASED)
        raise SystemExit(EXIT_RELEASED)


def install() -> bool:
    """Guard verl's checkpoints with the sidecar, wherever verl is (or will be) loaded.

    - verl 0.9+ V1 trainer (``trainer.use_v1: true``, the default): ``PPOTrainer.step``
      is wrapped so that a :class:`~sidecar.train.guard.CheckpointGuard` decides when
      ``_save_checkpoint()`` runs (``sidecar.integrations.verl_trainer``);
    - the V0 trainer (verl 0.6-0.8, and ``use_v1=false``): ``should_save_ckpt_esi`` is
      replaced in ``verl.utils.checkpoint.checkpoint_manager`` and in every module that
      imported it by name (``ray_trainer``, the fully-async and separation trainers).

    Modules not imported yet are patched when they are (an import hook), so this may run
    before verl is imported, e.g. as Ray's ``worker_process_setup_hook``. verl <= 0.5 is
    refused with one error line (its Ray ``runtime_env`` cannot carry the hook). Returns
    True when installed. Idempotent; cheap and standard library only.
    """
    version = _verl_version()
    if version is not None and version < FIRST_SUPPORTED:
        logger.error("verl %s is not supported by the sidecar (0.6 or newer is: older "
                     "versions fix Ray's runtime_env, so no worker_process_setup_hook can "
                     "reach the trainer); install() changes nothing", _verl_version_text())
        return False
    with _install_lock:
        patched = _patch_loaded_modules()
        if not any(isinstance(finder, _VerlImportHook) for finder in sys.meta_path):
            sys.meta_path.insert(0, _VerlImportHook())
    if patched:
        logger.info("guarded by the sidecar: %s", ", ".join(patched))
    return True


def uninstall() -> None:
    """Undo :func:`install`: verl's function back wherever ours is bound (also in the
    modules imported after install), the V1 trainer unwrapped, the import hook gone."""
    from sidecar.integrations.verl_trainer import unwrap_step

    with _install_lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _VerlImportHook)]
        original = _replaced[0][1] if _replaced else None
        _replaced.clear()
        if original is not None:
            for module in list(sys.modules.values()):
                if isinstance(module, types.ModuleType) and module.__name__.startswith(
                        "verl") and vars(module).get(VERL_FUNCTION) is should_save_ckpt_esi:
                    setattr(module, VERL_FUNCTION, original)
        while _wrapped_classes:
            trainer = _wrapped_classes.pop()
            trainer.step = unwrap_step(vars(trainer)["step"])  # type: ignore[attr-defined]
