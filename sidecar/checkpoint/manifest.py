"""On-disk format of a checkpoint folder.

Split out of :mod:`sidecar.checkpoint.folders` so that module holds the behaviour (commit,
discovery, retention) and this one the format: what ``MANIFEST.json`` says, how a folder
is made durable before it is described (with :mod:`sidecar.checkpoint.durable`), and how a
folder is checked against its manifest. Standard library only, like the training side.

A manifest is written last, after every file it lists has been fsynced; a folder without
one is never a checkpoint. That single rule is what makes a killed save harmless.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import reprlib
import stat
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Optional, Union

from sidecar.checkpoint.durable import sync_file, sync_tree
from sidecar.timeparse import TimestampError, format_rfc3339, parse_timestamp

# What every public function takes for a folder: a str or any os.PathLike (pathlib.Path).
PathLike = Union[str, "os.PathLike[str]"]
MANIFEST_NAME = "MANIFEST.json"
FORMAT_NAME = "esi-sidecar-checkpoint"
FORMAT_VERSION = 1
# Marker files that pin a checkpoint against retention. They come and go after the
# commit (the host-side uploader creates ``.uploading`` while it uploads), so they are
# never listed in a manifest: adding or removing one must not invalidate the folder. Any
# entry of the name pins (retention looks only for the name): the uploader creates its
# own exclusively and never writes through one that is there (host/upload/jobfiles.py).
UPLOADING_MARKER = ".uploading"  # created by the host-side uploader
KEEP_MARKER = ".keep"  # written by the user
PIN_MARKERS = (UPLOADING_MARKER, KEEP_MARKER)
_NOT_LISTED = frozenset((MANIFEST_NAME, *PIN_MARKERS))

_READ_CHUNK = 8 << 20
# The largest manifest read: about 300,000 files with their sha256 (some 200 bytes each),
# far beyond a real save; a bigger one is a job's attack on the root daemon's memory.
MAX_MANIFEST_BYTES = 64 << 20
# How a job's value is shown in a reason: short and shallow whatever it holds.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 80, 80


class CheckpointError(Exception):
    """A checkpoint could not be written, or a folder is not a valid checkpoint.

    ``reason`` is the short cause without the folder's path (what ``list_checkpoints``
    reports); the message names the folder.
    """

    def __init__(self, message: str, *, reason: Optional[str] = None) -> None:
        super().__init__(message)
        self.reason = reason if reason is not None else message


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to its folder ('/'-separated), size, hash."""

    path: str
    size: int
    sha256: Optional[str] = None


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint as its manifest describes it (validated when returned by the API)."""

    path: Path
    step: int
    created_at: datetime
    total_bytes: int
    metadata: dict[str, Any]
    files: tuple[FileEntry, ...]

    @property
    def name(self) -> str:
        return self.path.name


class Invalid(Exception):
    """Internal: why a folder is not a valid checkpoint (the reason alone, no path)."""


# -- durability ----------------------------------------------------------------------


def sync_checkpoint_files(
    folder: Path, *, checksum: bool, on_file: Callable[[str], None]
) -> list[FileEntry]:
    """fsync every regular file under ``folder`` and every sub-folder, then the folder.

    Returns the entries a manifest lists, sorted by path. Symbolic links and special
    files are left out of the manifest (and so not validated on resume): a link could
    point outside the checkpoint and dangle after the rename.
    """
    entries: list[FileEntry] = []

    def visit(full: Path) -> None:
        relative = full.relative_to(folder).as_posix()
        if relative in _NOT_LISTED:
            return
        size, digest = sync_file(full, checksum=checksum)
        entries.append(FileEntry(relative, size, digest))
        on_file(relative)

    sync_tree(folder, on_file=visit)
    return entries


def sha256_of(path: Path) -> str:
    with open(path, "rb", buffering=0) as handle:
        return _sha256_of_handle(handle)


def _sha256_of_handle(handle: Any) -> str:
    hasher = hashlib.sha256()
    for chunk in iter(lambda: handle.read(_READ_CHUNK), b""):
        hasher.update(chunk)
    return hasher.hexdigest()


# -- format --------------------------------------------------------------------------


def render_manifest(
    *,
    name: str,
    step: int,
    created_unix: float,
    entries: list[FileEntry],
    metadata: dict[str, Any],
    checksum: bool,
    started_unix: Optional[float] = None,
) -> bytes:
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "name": name,
        "step": step,
        "created_at": format_rfc3339(created_unix),
        "checksum": "sha256" if checksum else None,
        "total_bytes": sum(entry.size for entry in entries),
        "file_count": len(entries),
        "files": [
            {"path": e.path, "size": e.size, **({"sha256": e.sha256} if e.sha256 else {})}
            for e in entries
        ],
        "metadata": metadata,
    }
    if started_unix is not None:
        # When the save began: the training state it holds, which the GPU time a release
        # cost is counted from (sidecar.host.reclaim_cost).
        body["started_at"] = format_rfc3339(started_unix)
    return (json.dumps(body, indent=1, allow_nan=False) + "\n").encode("utf-8")


def _safe_relative(text: Any) -> str:
    if not isinstance(text, str) or not text:
        raise Invalid(f"manifest lists a file without a path: {_SHOWN.repr(text)}")
    pure = PurePosixPath(text)
    if pure.is_absolute() or any(part in ("", ".", "..") for part in text.split("/")):
        raise Invalid(f"manifest lists an unsafe path: {_SHOWN.repr(text)}")
    return text


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Invalid(f"manifest {what} is not a non-negative integer: {_SHOWN.repr(value)}")
    return value


def read_manifest(folder: Path) -> CheckpointInfo:
    """Parse ``folder/MANIFEST.json`` without looking at the files. Raises :class:`Invalid`,
    and nothing else, whatever the file holds (the job writes it: issue 35): too large
    (:data:`MAX_MANIFEST_BYTES`), nested too deeply, not a manifest."""
    try:
        raw = read_listed(folder, MANIFEST_NAME)
    except FileNotFoundError:
        raise Invalid(
            f"no {MANIFEST_NAME}: partial save, or not written by atomic_checkpoint"
        ) from None
    except OSError as exc:
        raise Invalid(f"{MANIFEST_NAME} unreadable: {exc}") from None
    try:
        return _parse(folder, raw)
    except Invalid:
        raise
    except RecursionError:  # json.loads on "[[[[...": nested deeper than Python recurses
        raise Invalid(f"{MANIFEST_NAME} nests too deeply to be a manifest") from None
    except Exception as exc:  # whatever a job's bytes make of the parser: not a checkpoint
        raise Invalid(f"{MANIFEST_NAME} could not be parsed ({type(exc).__name__})") from None


def _parse(folder: Path, raw: bytes) -> CheckpointInfo:
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise Invalid(f"{MANIFEST_NAME} is not valid JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise Invalid(f"{MANIFEST_NAME} is not an {FORMAT_NAME} manifest")
    if body.get("format_version") != FORMAT_VERSION:
        raise Invalid(f"unsupported manifest format_version {body.get('format_version')!r}")
    step = _integer(body.get("step"), "step")
    try:
        created = parse_timestamp(body.get("created_at")).when  # type: ignore[arg-type]
    except TimestampError as exc:
        raise Invalid(f"manifest created_at: {exc}") from None
    files = body.get("files")
    if not isinstance(files, list):
        raise Invalid("manifest has no file list")
    entries = []
    for item in files:
        if not isinstance(item, dict):
            raise Invalid(f"manifest file entry is not an object: {_SHOWN.repr(item)}")
        digest = item.get("sha256")
        if digest is not None and not isinstance(digest, str):
            raise Invalid(f"manifest sha256 is not a string: {_SHOWN.repr(digest)}")
        entries.append(
            FileEntry(_safe_relative(item.get("path")), _integer(item.get("size"), "size"), digest)
        )
    total = _integer(body.get("total_bytes"), "total_bytes")
    if total != sum(entry.size for entry in entries):
        raise Invalid("manifest total_bytes does not match the sum of its file sizes")
    metadata = body.get("metadata")
    if not isinstance(metadata, dict):
        raise Invalid("manifest metadata is not a JSON object")
    return CheckpointInfo(folder, step, created, total, metadata, tuple(entries))


_NO_FOLLOW = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def open_listed(folder: Path, relative: str) -> int:
    """Open the file ``relative`` of the checkpoint ``folder`` for reading, following no
    symbolic link on the way (:func:`open_under`; the folder itself is taken as given).
    A manifest never lists a link (``sync_checkpoint_files`` leaves them out), so a link
    found here was put in after the commit, and following it could read any file outside
    the checkpoint (issue 22, item 3). Returns a file descriptor; raises :class:`Invalid`
    with the reason, or ``OSError`` when the file cannot be read."""
    directory = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        return open_under(directory, relative)
    finally:
        os.close(directory)


def open_under(directory: int, relative: str) -> int:
    """Open ``relative`` below the open folder ``directory`` (left open): every sub-folder
    is opened with ``O_NOFOLLOW`` relative to the one above it, and the file itself must
    be a regular file (a FIFO does not block the open). Returns a file descriptor; raises
    :class:`Invalid` (a link, a missing file, not a regular file) or ``OSError``."""
    parts = _safe_relative(relative).split("/")
    current = directory
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            flags = _NO_FOLLOW | (0 if last else getattr(os, "O_DIRECTORY", 0))
            if last:
                flags |= getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block the open
            try:
                handle = os.open(part, flags, dir_fd=current)
            except FileNotFoundError:
                raise Invalid(f"file {relative} listed in the manifest is missing") from None
            except OSError as exc:
                where = "/".join(parts[:index + 1])
                if exc.errno == errno.ENOTDIR and _is_link(part, current):
                    exc.errno = errno.ELOOP  # O_DIRECTORY answers ENOTDIR for a link
                if exc.errno == errno.ELOOP:
                    raise Invalid(f"{where} is a symbolic link: {relative} is not a regular "
                                  "file of the checkpoint") from None
                if exc.errno == errno.ENOTDIR:
                    raise Invalid(f"{where} is not a folder (listed: {relative})") from None
                raise
            if current != directory:
                os.close(current)
            current = handle
        if not stat.S_ISREG(os.fstat(current).st_mode):
            raise Invalid(f"{relative} is not a regular file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(current, True)
    except BaseException:
        if current != directory:
            os.close(current)
        raise
    return current


def read_listed(folder: Path, relative: str, most: int = MAX_MANIFEST_BYTES) -> bytes:
    """The bytes of ``folder/relative`` read through :func:`open_listed` (no link
    followed). A missing file raises ``FileNotFoundError``; one of more than ``most``
    bytes :class:`Invalid`, unread (:func:`read_at_most`)."""
    try:
        handle = open_listed(folder, relative)
    except Invalid:
        if not os.path.lexists(Path(folder) / relative):
            raise FileNotFoundError(
                errno.ENOENT, "no such file", str(Path(folder) / relative)) from None
        raise
    return read_at_most(handle, most, relative)


def read_at_most(handle: int, most: int, shown: str) -> bytes:
    """Read the open file ``handle`` (closed after) when it holds at most ``most`` bytes;
    else :class:`Invalid`. Its size is asked of the descriptor before a byte is read (a
    sparse file costs no disk and would cost its whole size in memory), and no more than
    ``most`` bytes are read should it grow meanwhile."""
    with open(handle, "rb") as reader:
        size = os.fstat(handle).st_size
        data = b"" if size > most else reader.read(most + 1)
    if size > most or len(data) > most:
        raise Invalid(f"{shown} is {max(size, len(data))} bytes, more than the {most} "
                      "read of it")
    return data


def _is_link(name: str, directory: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=directory).st_mode)
    except OSError:
        return False


def check_files(info: CheckpointInfo, *, verify_checksums: bool) -> None:
    """Compare the files on disk with the manifest: sizes always, sha256 when asked.
    Each file is opened without following links (:func:`open_listed`)."""
    for entry in info.files:
        handle = open_listed(info.path, entry.path)
        try:
            size = os.fstat(handle).st_size
        finally:
            os.close(handle)
        if size != entry.size:
            raise Invalid(f"file {entry.path} is {size} bytes, the manifest says {entry.size}")
    if not verify_checksums:
        return
    for entry in info.files:
        if entry.sha256 is None:
            continue
        with open(open_listed(info.path, entry.path), "rb", buffering=0) as reader:
            if _sha256_of_handle(reader) != entry.sha256:
                raise Invalid(f"file {entry.path} does not match its sha256 in the manifest")
