"""One JSON request to a daemon, for the commands that post to it (``esi-sidecar drill``,
the account ``esi-sidecar restore`` closes), and why a daemon could not be asked.

Standard library only; moved out of the drill command so the host's restore account uses it
without importing the CLI.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from typing import Any, Optional

from sidecar.train.client import ENV_TOKEN

__all__ = ["daemon_request", "unreachable_reason"]


def daemon_request(url: str, method: str, body: Optional[dict[str, Any]] = None,
                  timeout: float = 5.0, path: str = "/v1/drill") -> tuple[Optional[int], Any]:
    """(HTTP status, JSON body) of ``method path`` (``/v1/drill`` unless told) on ``url``;
    (None, why) when the daemon cannot be reached. Sends ``$ESI_SIDECAR_TOKEN`` as the
    client does."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    token = os.environ.get(ENV_TOKEN, "").strip()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read(1 << 20))
    except urllib.error.HTTPError as exc:
        with exc:
            try:
                return exc.code, json.loads(exc.read(1 << 16))
            except ValueError:
                return exc.code, {"error": f"HTTP {exc.code}"}
    except (OSError, ValueError) as exc:
        return None, unreachable_reason(exc, timeout)


def unreachable_reason(exc: BaseException, timeout: float) -> str:
    """Why a daemon could not be asked, in a few words: ``connection refused``, ``no
    answer within 5 s``, the resolver's or the socket's own message; never a repr."""
    reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is `esi-sidecar serve` running?)"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[:1].lower() + reason.strerror[1:]
    if isinstance(exc, ValueError) and not isinstance(exc, urllib.error.URLError):
        return f"not a JSON answer ({exc})"[:200]
    return str(reason)[:200] or type(exc).__name__
