"""One inotify instance for the whole uploader, read by one thread (issue 35, item 4).

watchdog opens an inotify instance and starts threads for every folder it watches, and
root may hold only ``max_user_instances`` (128 by default) instances on the whole host: a
job that made hundreds of folders named like saves in progress took them all. Here one
instance holds every watch, at most ``MAX_WATCHES`` of them, and one thread reads it.
Handlers run on that thread and must be quick (they record and wake the uploader). Linux
only: elsewhere :meth:`Inotify.open` raises ``OSError`` and the uploader polls.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
from typing import Any, Callable, Optional

__all__ = ["FOLDER_EVENTS", "IN_CLOSE_WRITE", "IN_CREATE", "IN_DONT_FOLLOW", "IN_IGNORED",
           "IN_ISDIR", "IN_ONLYDIR", "MAX_WATCHES", "Handler", "Inotify"]

log = logging.getLogger("sidecar.host.upload.inotify")

IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000  # the watch is gone (its folder deleted, or removed by us)
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_MASK_ADD = 0x20000000
IN_ISDIR = 0x40000000
# What changes a folder's listing or a file in it (never IN_OPEN / IN_ACCESS: the
# uploader's own reads must not wake it).
FOLDER_EVENTS = (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_CLOSE_WRITE
                 | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF)

MAX_WATCHES = 1024  # far above what the uploader asks for; a bound, not a budget
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_READ_BYTES = 64 * 1024

Handler = Callable[[int, int, str], None]  # (wd, mask, name): name "" for the folder itself


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        raise OSError(errno.ENOSYS, "inotify is not available on this system")
    return libc


class Inotify:
    """One inotify file descriptor, its watches, and the thread that reads it."""

    def __init__(self, fd: int, libc: Any, on_overflow: Callable[[], None]) -> None:
        self._fd = fd
        self._libc = libc
        self._on_overflow = on_overflow
        self._lock = threading.Lock()
        self._handlers: dict[int, Handler] = {}
        self._stop_fd = os.eventfd(0, os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._read_loop, name="esi-sidecar-inotify",
                                         daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, on_overflow: Callable[[], None]) -> Inotify:
        """A started instance; ``on_overflow`` runs when the kernel dropped events."""
        libc = _libc()
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        return cls(fd, libc, on_overflow)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def watches(self) -> int:
        with self._lock:
            return len(self._handlers)

    def add(self, path: str, mask: int, handler: Handler) -> int:
        """Watch ``path``; returns the watch descriptor. ``OSError`` when it cannot be."""
        with self._lock:
            if len(self._handlers) >= MAX_WATCHES:
                raise OSError(errno.ENOSPC, f"already {MAX_WATCHES} watches")
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask | IN_MASK_ADD)
            if wd < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code), path)
            if wd in self._handlers:  # the same folder twice (a bind mount, a moved folder)
                raise FileExistsError(errno.EEXIST, "already watched by another", path)
            self._handlers[wd] = handler
            return int(wd)

    def remove(self, wd: int) -> None:
        with self._lock:
            if self._handlers.pop(wd, None) is not None:
                self._libc.inotify_rm_watch(self._fd, wd)  # fails if the kernel dropped it

    def close(self, timeout: float = 2.0) -> None:
        """Stop the reader (it closes the inotify descriptor on its way out)."""
        if self._stop_fd < 0:
            return
        os.eventfd_write(self._stop_fd, 1)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # else it may still poll it: left open
            os.close(self._stop_fd)
            self._stop_fd = -1

    # ------------------------------------------------------------------ the reader thread

    def _read_loop(self) -> None:
        stop_fd = self._stop_fd
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(stop_fd, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if stop_fd in ready:
                    return
                try:
                    data = os.read(self._fd, _READ_BYTES)
                except BlockingIOError:
                    continue
                self._dispatch(data)
        except Exception:  # a bug must not leave a thread spinning; the uploader polls
            log.exception("inotify reader failed; the uploader polls from now on")
        finally:
            with self._lock:
                self._handlers.clear()
            os.close(self._fd)

    def _dispatch(self, data: bytes) -> None:
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _, length = _HEADER.unpack_from(data, offset)
            start = offset + _HEADER.size
            name = os.fsdecode(data[start:start + length].rstrip(b"\0"))
            offset = start + length
            if mask & IN_Q_OVERFLOW:
                self._on_overflow()
                continue
            with self._lock:
                handler: Optional[Handler] = (self._handlers.pop(wd, None) if mask & IN_IGNORED
                                              else self._handlers.get(wd))
            if handler is None:
                continue
            try:
                handler(wd, mask, name)
            except Exception:
                log.exception("an inotify handler failed")
