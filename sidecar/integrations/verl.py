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

Switching is one call, :func:`install`, in the process that runs verl's trainer (verl's
``TaskRunner`` is a Ray actor, so pass it as Ray's ``worker_process_setup_hook``); see
docs/integrations.md.

Behaviour kept from verl, on purpose, so that it is a drop-in: the answer is stateless
and stays True at every step inside the window (verl then saves at each of those steps,
as it does today), and False while ``max_steps_duration`` is 0 (before verl measured a
step). For save-once-then-stop, use :class:`sidecar.train.guard.CheckpointGuard`.

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

from sidecar.train.client import DEFAULT_TIMEOUT_SECONDS, SidecarClient
from sidecar.train.deadline import DEFAULT_REFRESH_SECONDS, DEFAULT_RETRY_SECONDS, DeadlineTracker
from sidecar.train.policy import DEFAULT_SAVE_SECONDS, check_seconds, verl_rule

__all__ = [
    "VERL_FUNCTION",
    "VERL_MODULE",
    "configure",
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
_warned_internal = False


def configure(
    url: Union[str, Sequence[str], None] = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
    retry_seconds: float = DEFAULT_RETRY_SECONDS,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    environ: Optional[Mapping[str, str]] = None,
) -> None:
    """Set where :func:`should_save_ckpt_esi` asks and how often (optional).

    Without a call, the first :func:`should_save_ckpt_esi` uses ``$ESI_SIDECAR_URL``
    (default ``http://127.0.0.1:8791``) and the defaults here. ``environ`` defaults to
    ``os.environ`` read at every call. Invalid arguments raise ``ValueError`` (this is
    the user's own code, at start-up); the function itself never raises.
    """
    global _cache
    refresh_seconds = check_seconds("refresh_seconds", refresh_seconds)
    retry_seconds = check_seconds("retry_seconds", retry_seconds)
    tracker = DeadlineTracker(
        SidecarClient(url, timeout=timeout),
        refresh_seconds=refresh_seconds,
        daemon_retry_seconds=retry_seconds,
        clock=clock,
        monotonic=monotonic,
        environ=environ,
        live_environ=True,
    )
    with _cache_lock:
        old, _cache = _cache, tracker
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
        if deadline is None:
            return False
        # With the daemon's uploader, a save counts once durable: local save + upload.
        save_seconds = float(save_ckpt_duration) + (cache.upload_seconds or 0.0)
        return verl_rule(deadline - cache.clock(), float(max_steps_duration), save_seconds,
                         float(redundant_time))
    except Exception:
        if not _warned_internal:
            _warned_internal = True
            logger.exception("should_save_ckpt_esi failed; answering False")
        return False


# ---------------------------------------------------------------------------- install

# (module, attribute value before we replaced it), for uninstall().
_replaced: list[tuple[types.ModuleType, Any]] = []


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


def _patch_loaded_modules() -> list[str]:
    patched = []
    for name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType) and _patch_module(module):
            patched.append(name)
    return patched


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then replaces the function in the fresh module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        if _patch_module(module):
            logger.info("replaced %s.%s by the sidecar's", VERL_MODULE, VERL_FUNCTION)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tools
        return getattr(self._loader, name)


class _VerlImportHook(importlib.abc.MetaPathFinder):
    """Patches verl's checkpoint_manager as it is imported.

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
        if fullname != VERL_MODULE:
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


def install() -> None:
    """Use the sidecar's ``should_save_ckpt_esi`` wherever verl's is (or will be) bound.

    Replaces the function in ``verl.utils.checkpoint.checkpoint_manager`` and in every
    already imported module that imported it by name (``verl.trainer.ppo.ray_trainer``,
    recipes), and, for verl modules not imported yet, installs an import hook that does
    the same when they are. Idempotent; cheap and standard library only, so it is fit
    for Ray's ``worker_process_setup_hook`` (which runs it in every worker process).
    """
    patched = _patch_loaded_modules()
    if patched:
        logger.info("replaced %s in %s by the sidecar's", VERL_FUNCTION, ", ".join(patched))
    if not any(isinstance(finder, _VerlImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _VerlImportHook())


def uninstall() -> None:
    """Undo :func:`install`: restore verl's function and remove the import hook."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _VerlImportHook)]
    while _replaced:
        module, original = _replaced.pop()
        if vars(module).get(VERL_FUNCTION) is should_save_ckpt_esi:
            setattr(module, VERL_FUNCTION, original)
