"""The daemon's state file (``--state-file``): its one reader and its one writer.

What survives a restart comes in named sections, each dumped to and loaded from plain JSON
by its owner (the sources' last good deadlines: ``store_section``; the job events:
``events``; the volume's identity: ``upload.volume_section``); only this module opens
the file. It is written crash-safely
(``sidecar.checkpoint.durable``) at once when asked (a deadline changed, the shutdown), or
within WRITE_DELAY_SECONDS of a change it is told of (a flood of events costs one write
per 2 s). A damaged file, whatever its shape, is set aside as ``<name>.bad`` with one log
line and the daemon starts without it (issue 22, item 6).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import reprlib
import secrets
import stat
import threading
from pathlib import Path
from typing import Any, Optional, Protocol

from sidecar.checkpoint.durable import replace_atomically

__all__ = ["FORMAT_VERSION", "MAX_BYTES", "WRITE_DELAY_SECONDS", "Section", "StateFile"]

log = logging.getLogger("sidecar.host.statefile")

FORMAT_VERSION = 1
WRITE_DELAY_SECONDS = 2.0
# A real state file is well under a megabyte (500 events and a few deadlines): anything
# larger is not one, and is not read into memory.
MAX_BYTES = 16 << 20


class Section(Protocol):
    """A part of the state file, kept under its own top-level key."""

    name: str  # the key
    what: str  # a few words for log lines: "the deadline", "the job events"
    # A required section missing or bad sets the whole file aside; an optional one is
    # ignored with one log line and the rest is loaded.
    required: bool

    def dump(self) -> Any:
        """The section as JSON-able data (called from any thread)."""

    def load(self, section: Any) -> None:
        """Take a section an earlier run dumped; ValueError naming the first bad field,
        before anything is changed."""


class Damaged(Exception):
    """The file is not a state file this daemon can read."""


class StateFile:
    """One state file and its sections; every method is a no-op without a path."""

    def __init__(self, path: Optional[Path], *, delay: float = WRITE_DELAY_SECONDS) -> None:
        self.path = path
        self._delay = delay
        self._sections: list[Section] = []
        self._write_lock = threading.Lock()
        self._dirty = threading.Event()
        self._stopping = threading.Event()
        self._writer: Optional[threading.Thread] = None

    def add(self, *sections: Section) -> None:
        """Keep these sections in the file (before :meth:`load`)."""
        for section in sections:
            taken = {"version", *(s.name for s in self._sections)}
            if section.name in taken:
                raise ValueError(f"state file section {section.name!r} is taken")
            self._sections.append(section)

    # ------------------------------------------------------------------ reading

    def load(self) -> None:
        """Restore what an earlier run saved. A missing file is nothing to restore; a
        damaged one is set aside (nothing of it is loaded or written back); a bad optional
        section is ignored. Leftover temporary files of earlier writes are removed. Never
        raises for anything found on disk."""
        if self.path is None:
            return
        _remove_leftover_temps(self.path)
        try:
            raw = self._read()
            if raw is None:
                return
            data = _parse(raw)
            required = [s for s in self._sections if s.required]
            for section in required:
                if section.name not in data:
                    raise Damaged(f"no {section.name!r} section")
                _load(section, data[section.name], Damaged)
        except Damaged as exc:
            self._set_aside(str(exc))
            return
        kept = " and ".join(s.what for s in required) or "the rest"
        for section in self._sections:
            if section.required or section.name not in data:
                continue
            try:
                _load(section, data[section.name], ValueError)
            except ValueError as exc:
                log.warning("ignoring %s in state file %s (%s is kept): %s", section.what,
                            self.path, kept, _one_line(str(exc)))
        log.info("restored last known state from %s", self.path)

    def _read(self) -> Optional[bytes]:
        """The file's bytes; None when there is none. Never blocks (a FIFO in its place)
        and never reads more than MAX_BYTES."""
        assert self.path is not None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Damaged(f"cannot be read: {exc.strerror or exc}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Damaged("not a regular file")
            chunks, size = [], 0
            while size <= MAX_BYTES:
                chunk = os.read(fd, MAX_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            raise Damaged(f"cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        raw = b"".join(chunks)
        if len(raw) > MAX_BYTES:
            raise Damaged(f"larger than {MAX_BYTES} bytes")
        return raw

    def _set_aside(self, why: str) -> None:
        """The one place a damaged file is moved out of the way, with one log line."""
        assert self.path is not None
        aside = self.path.with_name(self.path.name + ".bad")
        try:
            os.replace(self.path, aside)
            where = f"kept as {aside.name}"
        except OSError as exc:
            where = f"could not set it aside: {exc.strerror or exc}"
        log.warning("ignoring state file %s (%s): %s", self.path, where, _one_line(why))

    # ------------------------------------------------------------------ writing

    def write(self) -> None:
        """Write every section now, atomically; a failure is logged, never raised."""
        if self.path is None:
            return
        with self._write_lock:
            self._dirty.clear()  # a change from here on is written by the next write
            try:
                body = json.dumps({"version": FORMAT_VERSION,
                                   **{s.name: s.dump() for s in self._sections}}, indent=1)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # A random part too: a daemon that is always PID 1 (a container) must not
                # meet the temporary file its last crash left behind.
                temp = f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                replace_atomically(self.path, body.encode(), temp)
            except OSError as exc:
                log.warning("could not write state file %s: %s", self.path, exc)
            except Exception as exc:  # a bug in a section must not stop its caller
                log.error("writing state file %s failed: %s", self.path, type(exc).__name__)

    def changed(self) -> None:
        """A section changed: written within WRITE_DELAY_SECONDS (cheap; any thread, the
        event loop too)."""
        self._dirty.set()

    def start(self) -> None:
        """Start writing changes in the background (:meth:`changed`)."""
        if self.path is None or self._writer is not None:
            return
        self._stopping.clear()
        self._writer = threading.Thread(target=self._write_changes, name="state-file",
                                        daemon=True)
        self._writer.start()

    def _write_changes(self) -> None:
        while not self._stopping.wait(self._delay):
            if self._dirty.is_set():
                self.write()

    def stop(self) -> None:
        """Stop the background writer and write the file one last time."""
        self._stopping.set()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self.write()


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise Damaged("not JSON: nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of 5,000 digits
        raise Damaged(f"not JSON: {exc}") from None
    except Exception as exc:  # whatever else the decoder may meet: still not a state file
        raise Damaged(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise Damaged("not a JSON object")
    if data.get("version") != FORMAT_VERSION:
        raise Damaged(f"unknown version {reprlib.repr(data.get('version'))}")
    return data


def _load(section: Section, value: Any, error: type[Exception]) -> None:
    """``section.load(value)``, anything it raises turned into ``error``: a value can be
    odd in ways a section's checks did not foresee (RecursionError, OverflowError)."""
    try:
        section.load(value)
    except ValueError as exc:
        raise error(str(exc)) from None
    except Exception as exc:
        raise error(f"{section.name}: unreadable ({type(exc).__name__})") from None


def _remove_leftover_temps(path: Path) -> None:
    """Temporary files of writes a crash cut short (``.state.json.<pid>.<random>.tmp``)."""
    try:
        leftovers = list(path.parent.glob(f".{path.name}.*.tmp"))
    except OSError:
        return
    for leftover in leftovers:
        with contextlib.suppress(OSError):
            leftover.unlink()


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
