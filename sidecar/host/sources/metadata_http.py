"""Helpers shared by the sources that read a cloud's instance metadata service over HTTP
(aws, gcp, azure): one request with its failures as one-line SourceErrors, one-line
excerpts of what a service answered, and why a probe failed."""

from __future__ import annotations

import json
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import urllib3

from sidecar.host.sources.base import SourceError
from sidecar.host.sources.bounded import Calls, Unfinished

__all__ = ["clip", "probe_failure", "request"]


# Each pool's requests, bounded as a whole (``bounded.Calls``, by URL).
_CALLS: weakref.WeakKeyDictionary[Any, Calls] = weakref.WeakKeyDictionary()
_CALLS_LOCK = threading.Lock()
# Beyond the connect and read timeouts, the slack a whole answer may take.
WHOLE_REQUEST_SLACK_SECONDS = 1.0


def request(http: urllib3.PoolManager, method: str, url: str, *, place: str, cloud: str,
            timeout: urllib3.Timeout, **options: Any) -> Any:
    """``http.request`` without redirects, its failures as one line naming ``place``; a
    host that cannot reach the service is asked whether it runs on ``cloud`` at all.

    The whole request is bounded (connect + read timeout + 1 s): urllib3's timeouts bound
    each socket read, so a service that trickles a byte every half second would hold the
    source's poll forever and a real notice behind it would be missed (issue 22). The
    request runs in a thread (``bounded.Calls``); one that overruns is left to end by
    itself, and no new request to that URL starts until it has."""
    with _CALLS_LOCK:
        calls = _CALLS.setdefault(http, Calls("esi-sidecar-metadata"))
    bound = (_seconds(timeout.connect_timeout) + _seconds(timeout.read_timeout)
             + WHOLE_REQUEST_SLACK_SECONDS)
    try:
        return calls.run(
            lambda: http.request(method, url, timeout=timeout, preload_content=True,
                                 redirect=False, **options),
            bound, key=url,
            busy=f"{place}: the previous request has not ended yet "
                 "(the service trickles its answer)",
            late=f"{place}: no whole answer within {bound:g} s "
                 "(the service trickles its answer)")
    except Unfinished:
        raise
    except Exception as exc:
        raise _one_line(exc, place, cloud, timeout) from None


def _seconds(value: Any) -> float:
    """A urllib3 timeout part in seconds (0 when unset or urllib3's default sentinel)."""
    return float(value) if isinstance(value, (int, float)) else 0.0


def _one_line(exc: Exception, place: str, cloud: str, timeout: urllib3.Timeout) -> Exception:
    """A failed request as one SourceError line."""
    import urllib3  # lazily: the settings table imports every source module
    try:
        raise exc
    except urllib3.exceptions.NewConnectionError:  # before its base class, the timeout
        return SourceError(f"{place}: cannot connect: not on {cloud}?")
    except urllib3.exceptions.ConnectTimeoutError:
        return SourceError(f"{place}: connect timed out ({timeout.connect_timeout:g} s): "
                           f"not on {cloud}?")
    except urllib3.exceptions.ReadTimeoutError:
        return SourceError(f"{place}: no answer within {timeout.read_timeout:g} s")
    except urllib3.exceptions.HTTPError as error:
        return SourceError(f"{place}: {type(error).__name__}")
    except Exception as error:
        return error


def clip(value: Any, limit: int = 120) -> str:
    """``value`` as one line of at most ``limit`` characters, for an error message."""
    text = value if isinstance(value, str) else json.dumps(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def probe_failure(exc: Exception, timeout: float) -> str:
    """Why a probe's request failed, in a few words."""
    import urllib3  # lazily: the settings table imports every source module
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        return "cannot connect"
    if isinstance(exc, urllib3.exceptions.TimeoutError):
        return f"no answer within {timeout:g} s"
    return type(exc).__name__
