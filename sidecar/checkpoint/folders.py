"""Atomic, validated checkpoints, and resume from the newest valid one (standard library only).

A checkpoint appears complete or not at all, even when the machine is killed in the middle
of ``torch.save``: :class:`atomic_checkpoint` writes into a hidden folder and commits it
with ``MANIFEST.json`` written last; :func:`latest_valid` resumes from the newest folder
whose files match its manifest; :func:`prune` keeps the newest few. How to use it, what a
complete checkpoint holds, and what happens on disk and after a kill: docs/checkpoints.md.

This module is the public API. Beside it: :mod:`sidecar.checkpoint.manifest` (the manifest format
and the fsync helpers), :mod:`sidecar.checkpoint.leftovers` (who owns a killed save's leftovers,
and cleaning them) and :mod:`sidecar.checkpoint.rng` (RNG state), whose public names are
re-exported here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional

from sidecar.checkpoint.durable import (
    fsync_path,
    rename_durably,
    replace_atomically,
    write_durably,
)
from sidecar.checkpoint.leftovers import (
    FOREIGN_LEFTOVER_AFTER_SECONDS,
    clean_leftovers,
    clean_quietly,
    remove_path,
    writer_tag,
)
from sidecar.checkpoint.manifest import (
    MANIFEST_NAME,
    PIN_MARKERS,
    CheckpointError,
    CheckpointInfo,
    FileEntry,
    Invalid,
    PathLike,
    check_files,
    read_listed,
    read_manifest,
    render_manifest,
    sync_checkpoint_files,
)
from sidecar.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "FOREIGN_LEFTOVER_AFTER_SECONDS",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "PIN_MARKERS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointListing",
    "FileEntry",
    "atomic_checkpoint",
    "capture_rng_state",
    "clean_leftovers",
    "latest_valid",
    "list_checkpoints",
    "prune",
    "restore_rng_state",
    "validate",
]

_log = logging.getLogger("sidecar.checkpoint")

LATEST_NAME = "latest"
# Folders without a manifest that still look like checkpoints (and so are reported as
# partial rather than ignored): step_00000100, global_step_100, checkpoint-100.
_STEP_LIKE = re.compile(r"(?:step|checkpoint)[-_]?(\d+)$", re.IGNORECASE)

# Test seam: called with (phase, detail) at each step of a commit, so the crash tests can
# kill a subprocess at an exact point without sleeping. Never set in production.
_phase_hook: Optional[Callable[[str, str], None]] = None


def _phase(name: str, detail: str = "") -> None:
    if _phase_hook is not None:
        _phase_hook(name, detail)


# -- discovery -----------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointListing:
    """One folder of ``root`` as :func:`list_checkpoints` sees it.

    ``info`` is set when the folder is a valid checkpoint; ``reason`` says why not
    otherwise. ``step`` comes from the manifest, else from the name, else None.
    """

    path: Path
    step: Optional[int]
    info: Optional[CheckpointInfo]
    reason: Optional[str]

    @property
    def valid(self) -> bool:
        return self.info is not None


@dataclass(frozen=True)
class _Candidate:
    path: Path
    step: Optional[int]
    manifest: Optional[CheckpointInfo]  # parsed, files not yet checked
    reason: Optional[str]


def _candidates(root: Path) -> list[_Candidate]:
    """Folders that are, or look like, checkpoints; newest (step, created) first."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        folder = Path(entry.path)
        try:
            manifest = read_manifest(folder)
        except Invalid as exc:
            looks_like = _STEP_LIKE.search(entry.name)
            if looks_like is None and not os.path.lexists(folder / MANIFEST_NAME):
                continue  # not a checkpoint at all: someone else's folder
            step = int(looks_like.group(1)) if looks_like else None
            found.append(_Candidate(folder, step, None, str(exc)))
        else:
            found.append(_Candidate(folder, manifest.step, manifest, None))

    def newest_first(candidate: _Candidate) -> tuple[int, float, str]:
        created = candidate.manifest.created_at.timestamp() if candidate.manifest else 0.0
        step = -1 if candidate.step is None else candidate.step
        return (step, created, candidate.path.name)

    found.sort(key=newest_first, reverse=True)
    return found


def _checked(candidate: _Candidate, verify_checksums: bool) -> tuple[Optional[CheckpointInfo], str]:
    if candidate.manifest is None:
        return None, candidate.reason or "not a checkpoint"
    try:
        check_files(candidate.manifest, verify_checksums=verify_checksums)
    except Invalid as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"could not read its files: {exc}"
    return candidate.manifest, ""


def _read_pointer(root: Path) -> Optional[str]:
    try:  # no link followed, a FIFO never blocks (the root daemon prunes too: issue 35)
        name = read_listed(root, LATEST_NAME).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError, Invalid):
        return None
    return name or None


def list_checkpoints(root: PathLike, *, verify_checksums: bool = False) -> list[CheckpointListing]:
    """Every checkpoint-like folder in ``root``, valid or not, newest first, with the reason.

    Read-only: unlike :func:`latest_valid` it cleans nothing, so it is safe for tools
    that only look (the uploader, ``esi-sidecar status``).
    """
    listings = []
    for candidate in _candidates(Path(root)):
        info, reason = _checked(candidate, verify_checksums)
        listings.append(CheckpointListing(candidate.path, candidate.step, info, reason or None))
    return listings


def validate(path: PathLike, verify_checksums: bool = False) -> CheckpointInfo:
    """The checkpoint in ``path``, checked against its manifest; raises CheckpointError."""
    folder = Path(path)
    try:
        info = read_manifest(folder)
        check_files(info, verify_checksums=verify_checksums)
    except Invalid as exc:
        reason = str(exc)
    except OSError as exc:
        reason = f"could not read its files: {exc}"
    else:
        return info
    raise CheckpointError(f"{folder} is not a valid checkpoint: {reason}", reason=reason)


def latest_valid(
    root: PathLike, *, verify_checksums: bool = False, clean: bool = True
) -> Optional[CheckpointInfo]:
    """The newest checkpoint (by step, then created time) whose files match its manifest.

    Skipped folders (partial, corrupt) get one warning each, naming the reason. With
    ``verify_checksums`` the sha256 of every file is compared too (when the save recorded
    them), which reads every byte: use it when the storage itself is in doubt. ``clean``
    first removes dead writers' leftovers (see :func:`clean_leftovers`). Returns None when
    there is no valid checkpoint.
    """
    base = Path(root)
    if clean:
        clean_quietly(base)
    pointer = _read_pointer(base)
    for candidate in _candidates(base):
        info, reason = _checked(candidate, verify_checksums)
        if info is None:
            _log.warning("skipping checkpoint %s: %s", candidate.path, reason)
            continue
        if pointer is not None and pointer != info.name:
            exists = (base / pointer).is_dir()
            _log.log(
                logging.INFO if exists else logging.WARNING,
                "the %r pointer names %s%s; the newest valid checkpoint is %s",
                LATEST_NAME,
                pointer,
                "" if exists else " (missing)",
                info.name,
            )
        return info
    return None


# -- retention -----------------------------------------------------------------------


def _is_pinned(folder: Path) -> bool:
    return any(os.path.lexists(folder / marker) for marker in PIN_MARKERS)


def _retire(folder: Path) -> None:
    """Delete a checkpoint: first rename it out of sight, so a kill midway never leaves a
    half-deleted folder under a checkpoint's name."""
    token = os.urandom(4).hex()
    hidden = folder.with_name(f".del-{folder.name}.{writer_tag()}.{token}")
    os.rename(folder, hidden)
    _phase("retired", folder.name)
    remove_path(hidden)


def prune(
    root: PathLike,
    keep_last: int,
    *,
    protect: Optional[Callable[[CheckpointInfo], bool]] = None,
) -> list[Path]:
    """Delete valid checkpoints older than the ``keep_last`` newest; returns what went.

    Never deleted: the newest valid checkpoint (``keep_last`` is at least 1), one pinned
    by a ``.uploading`` or ``.keep`` file inside it, one for which ``protect(info)`` is
    true, and the folder the ``latest`` pointer names. Pinned folders do not count
    towards ``keep_last``. Invalid folders are left alone: they may be another tool's,
    and :func:`latest_valid` already reports them.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    base = Path(root)
    pointer = _read_pointer(base)
    valid = [listing.info for listing in list_checkpoints(base) if listing.info is not None]
    removed = []
    kept = 0
    for index, info in enumerate(valid):  # newest first
        if _is_pinned(info.path) or (protect and protect(info)):
            _log.debug("keeping pinned checkpoint %s", info.path)
            continue  # pinned ones do not use up keep_last
        # The newest valid one and the one `latest` names are kept whatever keep_last says.
        if kept < keep_last or index == 0 or info.name == pointer:
            kept += 1
            continue
        _retire(info.path)
        _log.info("pruned checkpoint %s (keep_last=%d)", info.path, keep_last)
        removed.append(info.path)
    return removed


# -- the save ------------------------------------------------------------------------


def _human(count: float) -> str:
    if abs(count) < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if abs(count) < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} TiB"


def _check_name(name: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or name == LATEST_NAME
        or "/" in name
        or "\0" in name
        or (os.altsep is not None and os.altsep in name)
        or os.sep in name
    ):
        raise ValueError(f"not a usable checkpoint folder name: {name!r}")
    return name


class atomic_checkpoint:
    """Context manager: write a checkpoint into a temporary folder, commit it atomically.

    ``with atomic_checkpoint(root, step) as d:`` gives ``d``, a :class:`pathlib.Path`
    to an empty hidden folder in ``root``; write anything into it. On a clean exit the
    folder is fsynced, described by ``MANIFEST.json`` (written last), renamed to
    ``root/name`` (default ``step_{step:08d}``; ``name=`` for layouts such as
    ``global_step_{N}``), and ``latest`` is pointed at it. Re-saving an existing name
    replaces it: the old folder is moved aside first and removed after, and restored by
    the next call if a kill falls in between. On an exception the temporary folder is
    removed and the exception propagates. Afterwards ``.info`` holds the committed
    :class:`CheckpointInfo`.

    ``metadata`` is free-form JSON stored in the manifest; it may be updated inside the
    block (``ckpt.metadata["loss"] = ...``). ``checksum=True`` also records each file's
    sha256 (one more read of every byte, done in the same pass as the fsync).
    ``keep_last=N`` prunes after the commit (see :func:`prune`; ``protect`` is passed on).

    Before anything is written, free disk is checked: the last valid checkpoint's size
    plus ``free_margin`` (and at least ``min_free_bytes``) must be free, else
    :class:`CheckpointError` names the folder, the bytes needed and free, so a save that
    cannot fit fails in milliseconds instead of after minutes of writing.
    ``disk_usage`` is injectable for tests.
    """

    def __init__(
        self,
        root: PathLike,
        step: int,
        *,
        name: Optional[str] = None,
        metadata: Optional[dict[str, Any]] = None,
        checksum: bool = False,
        keep_last: Optional[int] = None,
        protect: Optional[Callable[[CheckpointInfo], bool]] = None,
        min_free_bytes: int = 0,
        free_margin: float = 0.10,
        disk_usage: Callable[[str], Any] = shutil.disk_usage,
    ) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ValueError(f"keep_last must be None or an integer >= 1, got {keep_last!r}")
        if not (math.isfinite(free_margin) and free_margin >= 0):
            raise ValueError(f"free_margin must be >= 0, got {free_margin!r}")
        self.root = Path(root)
        self.step = step
        self.name = _check_name(name if name is not None else f"step_{step:08d}")
        self.path = self.root / self.name
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._metadata_json()  # fail before any writing, not after
        self.checksum = checksum
        self.keep_last = keep_last
        self.protect = protect
        self.min_free_bytes = min_free_bytes
        self.free_margin = free_margin
        self._disk_usage = disk_usage
        self.info: Optional[CheckpointInfo] = None
        self._temp: Optional[Path] = None
        self._previous: Optional[CheckpointInfo] = None
        self._tag = ""
        self._token = ""

    def _metadata_json(self) -> dict[str, Any]:
        try:
            copied: dict[str, Any] = json.loads(json.dumps(self.metadata, allow_nan=False))
            return copied
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint metadata must be JSON-serialisable: {exc}") from None

    def __enter__(self) -> Path:
        if self._temp is not None:
            raise RuntimeError("an atomic_checkpoint can be entered only once")
        self.root.mkdir(parents=True, exist_ok=True)
        clean_quietly(self.root)
        self._previous = latest_valid(self.root, clean=False)
        self._check_free_space()
        self._started = time.time()  # the state the checkpoint holds (manifest started_at)
        self._tag = writer_tag()
        self._token = os.urandom(4).hex()
        temp = self.root / f".tmp-{self.name}.{self._tag}.{self._token}"
        temp.mkdir()
        self._temp = temp
        return temp

    def _check_free_space(self) -> None:
        needed = max(0, int(self.min_free_bytes))
        basis = f"min_free_bytes={self.min_free_bytes}"
        last = self._previous
        if last is not None:
            estimate = math.ceil(last.total_bytes * (1 + self.free_margin))
            if estimate >= needed:
                needed = estimate
                basis = (
                    f"the last valid checkpoint {last.name} holds {last.total_bytes} bytes, "
                    f"plus {self.free_margin:.0%} margin"
                )
        if needed == 0:
            return
        try:
            free = int(self._disk_usage(str(self.root)).free)
        except OSError as exc:
            _log.warning("could not check free disk on %s: %s", self.root, exc)
            return
        if free < needed:
            raise CheckpointError(
                f"not enough free disk to save checkpoint {self.path}: needs {needed} bytes "
                f"({_human(needed)}; {basis}), only {free} bytes ({_human(free)}) free"
            )

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        temp = self._temp
        assert temp is not None, "__exit__ without __enter__"
        if exc_type is not None:
            self._discard(temp)
            return
        try:
            self.info = self._commit(temp)
        except BaseException:
            self._discard(temp)
            raise

    def _discard(self, temp: Path) -> None:
        # Never mask the exception that got us here; a leftover is cleaned next time.
        try:
            remove_path(temp)
        except OSError as exc:
            _log.warning("could not remove the unfinished %s: %s", temp, exc)

    def _commit(self, temp: Path) -> CheckpointInfo:
        _phase("user-done")
        try:
            entries = sync_checkpoint_files(
                temp, checksum=self.checksum, on_file=lambda rel: _phase("file-synced", rel)
            )
            _phase("tree-synced")
            created = time.time()
            manifest = render_manifest(
                name=self.name,
                step=self.step,
                created_unix=created,
                entries=entries,
                metadata=self._metadata_json(),
                checksum=self.checksum,
                started_unix=self._started,
            )
            write_durably(temp / MANIFEST_NAME, manifest)
            fsync_path(temp)
            _phase("manifest-written")
            self._move_into_place(temp)
        except OSError as exc:
            raise CheckpointError(f"could not commit checkpoint {self.path}: {exc}") from exc
        info = CheckpointInfo(
            path=self.path,
            step=self.step,
            created_at=datetime.fromtimestamp(created, timezone.utc),
            total_bytes=sum(entry.size for entry in entries),
            metadata=json.loads(manifest)["metadata"],
            files=tuple(entries),
        )
        if self._previous is None or self.step >= self._previous.step:
            try:
                replace_atomically(
                    self.root / LATEST_NAME,
                    f"{self.name}\n".encode(),
                    temp_name=f".tmp-{LATEST_NAME}.{self._tag}.{self._token}",
                )
            except OSError as exc:  # the checkpoint is durable; the pointer is a hint
                _log.warning(
                    "checkpoint %s saved, but %r not updated: %s", self.path, LATEST_NAME, exc
                )
            _phase("pointer-updated")
        if self.keep_last is not None:
            try:
                prune(self.root, self.keep_last, protect=self.protect)
            except OSError as exc:
                _log.warning("checkpoint %s saved, but pruning failed: %s", self.path, exc)
            _phase("pruned")
        return info

    def _move_into_place(self, temp: Path) -> None:
        aside = None
        if os.path.lexists(self.path):
            if _is_pinned(self.path):
                _log.warning("replacing %s although it is pinned (being uploaded?)", self.path)
            aside = self.root / f".old-{self.name}.{self._tag}.{self._token}"
            os.rename(self.path, aside)
            _phase("old-moved-aside")

        def put_back() -> None:  # an interrupt too: never leave neither name in place
            if aside is not None:
                os.rename(aside, self.path)

        rename_durably(temp, self.path, undo=put_back, after_rename=lambda: _phase("renamed"))
        _phase("parent-synced")
        if aside is not None:
            try:
                remove_path(aside)
            except OSError as exc:
                _log.warning("could not remove the replaced %s: %s", aside, exc)
            _phase("old-removed")
