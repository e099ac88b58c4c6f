"""``torch.distributed.checkpoint`` (DCP) through the guard: sharded checkpoints that every
rank writes, committed atomically, and an asynchronous save that counts only once written.

DCP writes one checkpoint from every rank (each its own shards, rank 0 the ``.metadata``).
:class:`~sidecar.checkpoint.folders.atomic_checkpoint` alone cannot hold that: its temporary
folder is named by one writer. Here rank 0 opens the temporary folder and tells the other
ranks its name, every rank writes into it, and rank 0 commits it (fsync, ``MANIFEST.json``
last, rename, ``latest``) once DCP has finished on every rank; so the commit and
``latest_valid`` rules hold as for a one-writer checkpoint. The folder must be on storage
that every rank sees (a shared volume), as DCP itself needs for one checkpoint; that is
checked before anything is written.

    ckpt = DistributedCheckpoint("/mnt/shared/ckpt", guard=guard, keep_last=3)
    ckpt.load({"app": app_state})                     # resume (collective)
    for step in ...:
        with guard.step():
            train_step()
        if guard.should_save():
            ckpt.async_save({"app": app_state}, step)  # blocks only while staging
        if guard.should_stop():
            break
    ckpt.wait()                                        # the last one committed (collective)

With ``guard=``, each save is recorded: the blocking part as the save time, and an
asynchronous save counts as the final (or top-up) checkpoint only once it is committed; its
asynchronous part is budgeted like an upload (it must end before the release too).

Collective: every method but :meth:`PendingCheckpoint.committed` is called on every rank,
the same number of times, as DCP's own functions are. A rank that fails before DCP starts
(its ``state_dict()`` raises, it cannot see the folder) makes every rank raise
:class:`CheckpointError` rather than leaving the others waiting; DCP propagates failures
inside its own collectives the same way.

torch is imported inside the functions, like the other torch integrations.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar.checkpoint.folders import (
    CheckpointError,
    CheckpointInfo,
    atomic_checkpoint,
    latest_valid,
    validate,
)
from sidecar.checkpoint.manifest import PathLike
from sidecar.train.guard import CheckpointGuard

__all__ = ["DistributedCheckpoint", "PendingCheckpoint"]

_log = logging.getLogger("sidecar.integrations.dcp")

FORMAT = "torch.distributed.checkpoint"


class PendingCheckpoint:
    """An asynchronous save in flight: written in the background, committed by rank 0."""

    def __init__(self, name: str, step: int, path: Path, rank: int) -> None:
        self.name = name
        self.step = step
        self.path = path
        self._rank = rank
        self._finished = threading.Event()  # this rank's part is over (well or not)
        self._error: Optional[str] = None
        self._info: Optional[CheckpointInfo] = None  # rank 0, once committed
        self._seen_committed = False

    def done(self) -> bool:
        """This rank's asynchronous part is over (committed or failed)."""
        return self._finished.is_set()

    @property
    def error(self) -> Optional[str]:
        """Why this rank's asynchronous part failed, once done; None if it did not."""
        return self._error

    def committed(self) -> bool:
        """Is the checkpoint committed (complete on storage)? Never collective, never
        raises: the guard asks it from the training loop. Rank 0 knows it has committed;
        the other ranks look for the committed folder's manifest."""
        if self._seen_committed:
            return True
        if not self._finished.is_set() or self._error is not None:
            return False
        if self._rank == 0:
            self._seen_committed = self._info is not None
        else:
            try:
                self._seen_committed = validate(self.path).step == self.step
            except (CheckpointError, OSError):
                self._seen_committed = False
        return self._seen_committed

    def _finish(self, error: Optional[str], info: Optional[CheckpointInfo] = None) -> None:
        self._error, self._info = error, info
        self._finished.set()


class DistributedCheckpoint:
    """Save and load DCP checkpoints under ``root`` (``step_<N>`` folders), atomically.

    - ``guard``: record each save with it (see the module's docstring). Optional.
    - ``group``: the process group whose ranks write the checkpoint (default: the world).
      Two gloo groups over its ranks are made here (collective: build it on every rank),
      one for DCP's own collectives and one for this class's: an asynchronous save runs
      its collectives in a background thread, and sharing a group with the training
      loop's collectives could interleave them differently on different ranks.
    - ``keep_last``, ``checksum``: as for ``atomic_checkpoint`` (rank 0 prunes).
    - ``writer``: makes the DCP ``StorageWriter`` for a folder (default
      ``FileSystemWriter(path)``).
    - ``metadata``: free-form JSON kept in every manifest (rank 0's).

    Without ``torch.distributed`` initialised it works in one process (``no_dist``).
    """

    def __init__(
        self,
        root: PathLike,
        *,
        guard: Optional[CheckpointGuard] = None,
        group: Any = None,
        keep_last: Optional[int] = None,
        checksum: bool = False,
        writer: Optional[Callable[[Path], Any]] = None,
        metadata: Optional[Mapping[str, Any]] = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        import torch.distributed as dist

        self.root = Path(root)
        self.guard = guard
        self.keep_last = keep_last
        self.checksum = checksum
        self._writer = writer
        self.metadata = dict(metadata or {})
        self._clock = clock
        self._monotonic = monotonic
        self._pending: Optional[PendingCheckpoint] = None
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._dcp_group = dist.new_group(ranks=ranks, backend="gloo")
            self._control = dist.new_group(ranks=ranks, backend="gloo")
            self.rank = dist.get_rank(self._control)
            self.world_size = dist.get_world_size(self._control)
        else:
            self._dcp_group = self._control = None
            self.rank, self.world_size = 0, 1

    # ------------------------------------------------------------------ saving

    def save(self, state_dict: Mapping[str, Any], step: int) -> CheckpointInfo:
        """Write ``state_dict`` as the checkpoint of ``step`` and commit it; returns it.

        Waits for an asynchronous save still in flight first. Raises
        :class:`CheckpointError` on every rank when any rank failed; nothing is then
        committed and the newest valid checkpoint is unchanged."""
        import torch.distributed.checkpoint as dcp

        self._settle()
        started_unix, started = self._clock(), self._monotonic()
        commit, temp, path, prepared = self._open(state_dict, step)
        try:
            dcp.save(prepared, storage_writer=self._storage_writer(temp),
                     process_group=self._dcp_group, no_dist=not self._distributed)
        except BaseException as exc:
            if commit is not None:
                commit.__exit__(type(exc), exc, exc.__traceback__)
            raise CheckpointError(f"checkpoint step {step} not saved: {exc}") from exc
        info = self._commit_everywhere(commit, path, step)
        if self.guard is not None:
            self.guard.record_save(self._monotonic() - started, started_unix=started_unix,
                                   step=step)
        return info

    def async_save(self, state_dict: Mapping[str, Any], step: int) -> PendingCheckpoint:
        """Start writing ``state_dict`` as the checkpoint of ``step``; return at once after
        DCP has staged it (copied it off the training tensors).

        Rank 0 commits it when DCP's background write has finished on every rank. Only one
        save is in flight: a new one first waits for the previous. With a guard, the
        blocking part is recorded as the save, and the checkpoint counts as saved only
        once :meth:`PendingCheckpoint.committed`."""
        import torch.distributed.checkpoint as dcp

        self._settle()
        started_unix, started = self._clock(), self._monotonic()
        commit, temp, path, prepared = self._open(state_dict, step)
        pending = PendingCheckpoint(path.name, step, path, self.rank)
        try:
            response = dcp.async_save(
                prepared, storage_writer=self._storage_writer(temp),
                process_group=self._dcp_group, no_dist=not self._distributed,
            )
        except BaseException as exc:
            # Staging failed on this rank. Others may already be writing; their background
            # write fails or times out in DCP's collective, and rank 0 removes the folder.
            if commit is not None:
                commit.__exit__(type(exc), exc, exc.__traceback__)
            raise CheckpointError(f"checkpoint step {step} not started: {exc}") from exc
        future: Any = getattr(response, "upload_completion", response)  # Future or response
        staged = getattr(response, "staging_completion", None)
        if staged is not None:  # a stager that copies in the background: wait for the copy
            staged.result()
        blocking_end = self._monotonic()
        self._pending = pending

        def finished(done: Any) -> None:
            # DCP's background thread (or this one, if already done): commit on rank 0.
            try:
                done.result()
            except BaseException as exc:  # reported, never raised here
                if commit is not None:
                    commit.__exit__(type(exc), exc, exc.__traceback__)
                _log.error("checkpoint step %d: the asynchronous write failed: %s", step, exc)
                pending._finish(f"the asynchronous write failed: {exc}")
                return
            info = None
            if commit is not None:
                try:
                    commit.__exit__(None, None, None)
                    info = commit.info
                except BaseException as exc:
                    _log.error("checkpoint step %d not committed: %s", step, exc)
                    pending._finish(f"not committed: {exc}")
                    return
            if self.guard is not None:
                self.guard.record_async_write(max(0.0, self._monotonic() - blocking_end))
            pending._finish(None, info)

        future.add_done_callback(finished)
        if self.guard is not None:
            self.guard.record_save(blocking_end - started, started_unix=started_unix,
                                   step=step, committed=pending.committed)
        return pending

    def wait(self, timeout: Optional[float] = None) -> Optional[CheckpointInfo]:
        """Wait for the asynchronous save in flight; its committed checkpoint (None if
        none was in flight). Collective: rank 0's outcome is every rank's, so every rank
        returns or raises :class:`CheckpointError` alike. ``timeout`` bounds this rank's
        wait for its own part (CheckpointError when it runs out)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if not pending._finished.wait(timeout):
            self._pending = pending
            raise CheckpointError(f"checkpoint step {pending.step}: still writing after "
                                  f"{timeout} s")
        error = self._agree(pending.error)
        if error is not None:
            raise CheckpointError(f"checkpoint step {pending.step} not saved: {error}")
        return validate(pending.path)

    def close(self) -> None:
        """:meth:`wait`, logging a failure instead of raising (collective)."""
        self._settle()

    # ------------------------------------------------------------------ loading

    def load(self, state_dict: dict[str, Any]) -> Optional[CheckpointInfo]:
        """Load the newest valid checkpoint into ``state_dict`` in place (DCP's rules:
        tensors are filled, ``Stateful`` values get ``load_state_dict``); the checkpoint,
        or None when there is none. Rank 0 picks it, so every rank loads the same one."""
        import torch.distributed.checkpoint as dcp

        self._settle()
        info = latest_valid(self.root) if self.rank == 0 else None
        name = self._broadcast(None if info is None else info.name)
        if name is None:
            return None
        chosen = validate(self.root / name) if info is None else info
        dcp.load(state_dict, checkpoint_id=str(chosen.path), process_group=self._dcp_group,
                 no_dist=not self._distributed)
        return chosen

    # ------------------------------------------------------------------ internals

    def _storage_writer(self, path: Path) -> Any:
        if self._writer is not None:
            return self._writer(path)
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path)

    def _open(
        self, state_dict: Mapping[str, Any], step: int
    ) -> tuple[Optional[atomic_checkpoint], Path, Path, dict[str, Any]]:
        """Rank 0 opens the temporary folder; every rank learns its name (and the final
        one), checks that it sees it and prepares its state. Two collectives, entered by
        every rank even when one failed, so that all raise together instead of some
        waiting inside DCP. Returns (rank 0's commit, temporary folder, final folder,
        the prepared state)."""
        commit: Optional[atomic_checkpoint] = None
        opened: Optional[tuple[str, str]] = None
        error: Optional[str] = None
        if self.rank == 0:
            try:
                meta = {**self.metadata, "format": FORMAT, "world_size": self.world_size}
                commit = atomic_checkpoint(self.root, step, metadata=meta,
                                           checksum=self.checksum, keep_last=self.keep_last)
                opened = (commit.__enter__().name, commit.name)
            except (CheckpointError, OSError, ValueError) as exc:
                commit, error = None, str(exc)
        opened, error = self._broadcast((opened, error))
        if opened is None:
            raise CheckpointError(f"checkpoint step {step} not saved: {error}")
        # Each rank's own root: on nodes that do not share the storage it is not there.
        temp, path = self.root / opened[0], self.root / opened[1]
        prepared: dict[str, Any] = {}
        mine: Optional[str] = None
        if not temp.is_dir():
            mine = (f"rank {self.rank} cannot see {temp}: the checkpoint folder must be on "
                    "storage every rank shares")
        else:
            try:
                prepared = _plain(state_dict)
            except Exception as exc:  # the user's state_dict(); reported on every rank
                mine = f"rank {self.rank}: preparing its state failed: {exc!r}"
        failures = self._gather(mine)
        if failures:
            if commit is not None:
                commit.__exit__(CheckpointError, CheckpointError(failures[0]), None)
            raise CheckpointError(f"checkpoint step {step} not saved: " + "; ".join(failures))
        return commit, temp, path, prepared

    def _commit_everywhere(
        self, commit: Optional[atomic_checkpoint], path: Path, step: int
    ) -> CheckpointInfo:
        error: Optional[str] = None
        info: Optional[CheckpointInfo] = None
        if commit is not None:
            try:
                commit.__exit__(None, None, None)
                info = commit.info
            except (CheckpointError, OSError) as exc:
                error = str(exc)
        error = self._agree(error)
        if error is not None:
            raise CheckpointError(f"checkpoint step {step} not committed: {error}")
        if info is not None:
            return info
        return validate(path)

    def _settle(self) -> None:
        """Wait for the save in flight; log (on rank 0) rather than raise if it failed."""
        try:
            self.wait()
        except CheckpointError as exc:
            if self.rank == 0:
                _log.warning("%s", exc)

    def _agree(self, error: Optional[str]) -> Optional[str]:
        """Rank 0's outcome, on every rank."""
        result: Optional[str] = self._broadcast(error)
        return result

    def _broadcast(self, value: Any) -> Any:
        if not self._distributed:
            return value
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self._control, group_src=0)
        return box[0]

    def _gather(self, failure: Optional[str]) -> list[str]:
        """Every rank's failure (None for none), on every rank; the failures only."""
        if not self._distributed:
            return [] if failure is None else [failure]
        import torch.distributed as dist

        everyone: list[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(everyone, failure, group=self._control)
        return [text for text in everyone if text is not None]


def _plain(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's own first step, done before any collective: ``Stateful`` values become their
    ``state_dict()``, so a rank whose ``state_dict()`` raises says so to every rank."""
    from torch.distributed.checkpoint.stateful import Stateful

    return {key: value.state_dict() if isinstance(value, Stateful) else value
            for key, value in state_dict.items()}
