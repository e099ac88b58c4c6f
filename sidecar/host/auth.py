"""Who may ask the daemon: any process on this host, and beyond it only with the token.

Loopback stays open, as it always was: the training loop on the host asks every step and
needs no secret. A daemon listening on another address (a container on a bridge network,
a Kubernetes node IP) requires ``Authorization: Bearer <token>`` from every peer that is
not on loopback; the settings refuse such an address without a token
(:func:`check_exposure`). The token comes from ``ESI_SIDECAR_TOKEN`` or from a file that
only the service can read (``--token-file``), and is compared in constant time.

``/healthz`` answers its status code to anyone, so that a kubelet or load-balancer probe
works without the secret; a peer without the token gets ``{"status": ...}`` only, none of
the details (source errors, uploads).

Where loopback is not this host alone (a pod with ``hostNetwork``: every pod on the node
is on the node's loopback), ``--writes-need-token`` makes every request but a GET or HEAD
need the token from loopback too: reading stays open, and no local process can post
events, accounts or drills without the secret (issue 35, item 7).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = [
    "MIN_TOKEN_LENGTH", "READ_METHODS", "RequireToken", "check_exposure", "check_token",
    "is_loopback", "read_token_file",
]

MIN_TOKEN_LENGTH = 16  # characters: `openssl rand -hex 16` gives 32
MAX_TOKEN_LENGTH = 4096
HEALTH_PATH = "/healthz"
READ_METHODS = ("GET", "HEAD")  # open on loopback even when writes need the token


def check_token(token: str) -> str:
    """The token if usable (16 to 4096 printable ASCII characters, no spaces), else
    ValueError. The message never shows the token."""
    if not MIN_TOKEN_LENGTH <= len(token) <= MAX_TOKEN_LENGTH:
        raise ValueError(f"a token has {MIN_TOKEN_LENGTH} to {MAX_TOKEN_LENGTH} characters, "
                         f"this one {len(token)} (make one: openssl rand -hex 16)")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError("a token is printable ASCII without spaces")
    return token


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace stripped); ValueError when the file is
    missing, readable or writable by group or others, or holds no usable token."""
    try:
        info = os.stat(path)
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(f"{path} is readable or writable by others (mode "
                             f"{stat.S_IMODE(info.st_mode):04o}): chmod 600 it")
        with open(path, encoding="ascii", errors="replace") as handle:
            text = handle.read(MAX_TOKEN_LENGTH + 2)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    return check_token(text.strip())


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ::ffff:127.x.y.z; "localhost" too. Wildcards (0.0.0.0, ::)
    are not: they listen everywhere."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def check_exposure(listen: Sequence[tuple[str, int]], token: Optional[str],
                   writes_need_token: bool = False) -> Optional[str]:
    """Why these listen addresses cannot be served as configured (one line), or None."""
    if writes_need_token and token is None:
        return ("--writes-need-token needs the token: set ESI_SIDECAR_TOKEN or --token-file "
                "(docs/deploy.md, \"Containers\")")
    beyond = [f"{host}:{port}" for host, port in listen if not is_loopback(host)]
    if beyond and token is None:
        return (f"--listen {','.join(beyond)} is beyond loopback: anyone who can reach it "
                "could read the deadline and the uploads; set ESI_SIDECAR_TOKEN or "
                "--token-file (docs/deploy.md, \"Containers\"), or listen on 127.0.0.1")
    return None


class RequireToken:
    """ASGI wrapper, outermost: peers off loopback need the bearer token (401 otherwise),
    and with ``writes_need_token`` so do writes from loopback; ``health()`` gives
    ``/healthz``'s (status code, status) for those without it."""

    def __init__(self, app: Any, token: str, health: Callable[[], tuple[int, str]],
                 writes_need_token: bool = False) -> None:
        self.app = app
        self._token = token.encode("ascii")
        self._health = health
        self._writes_need_token = writes_need_token

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope.get("path") == HEALTH_PATH and scope.get("method") in ("GET", "HEAD"):
            code, status = self._health()
            await _answer(send, code, {"status": status}, scope["method"] == "HEAD")
            return
        await _answer(send, 401, {"error": "this daemon needs Authorization: Bearer <token> "
                                           "from beyond loopback, and for writes from "
                                           "loopback too with --writes-need-token "
                                           "(ESI_SIDECAR_TOKEN)"},
                      scope.get("method") == "HEAD",
                      extra=[(b"www-authenticate", b'Bearer realm="esi-sidecar"')])

    def _allowed(self, scope: Any) -> bool:
        client = scope.get("client")
        reading = scope.get("method") in READ_METHODS
        if client and is_loopback(str(client[0])) and (reading or not self._writes_need_token):
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":  # the scheme is case-insensitive (RFC 9110)
                scheme, _, credentials = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    credentials.strip(), self._token)
        return False


async def _answer(send: Any, code: int, body: dict[str, Any], head: bool,
                  extra: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": code, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *(extra or []),
    ]})
    await send({"type": "http.response.body", "body": b"" if head else data})
