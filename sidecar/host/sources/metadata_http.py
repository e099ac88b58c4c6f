"""Helpers shared by the sources that read a cloud's instance metadata service over HTTP
(aws, gcp, azure): one request with its failures as one-line SourceErrors, one-line
excerpts of what a service answered, and why a probe failed."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import urllib3

from sidecar.host.sources.base import SourceError

__all__ = ["clip", "probe_failure", "request"]


def request(http: urllib3.PoolManager, method: str, url: str, *, place: str, cloud: str,
            timeout: urllib3.Timeout, **options: Any) -> Any:
    """``http.request`` without redirects, its failures as one line naming ``place``; a
    host that cannot reach the service is asked whether it runs on ``cloud`` at all."""
    import urllib3  # lazily: the settings table imports every source module
    try:
        return http.request(method, url, timeout=timeout, preload_content=True,
                            redirect=False, **options)
    except urllib3.exceptions.NewConnectionError:  # before its base class, the timeout
        raise SourceError(f"{place}: cannot connect: not on {cloud}?") from None
    except urllib3.exceptions.ConnectTimeoutError:
        raise SourceError(f"{place}: connect timed out ({timeout.connect_timeout:g} s): "
                          f"not on {cloud}?") from None
    except urllib3.exceptions.ReadTimeoutError:
        raise SourceError(f"{place}: no answer within {timeout.read_timeout:g} s") from None
    except urllib3.exceptions.HTTPError as exc:
        raise SourceError(f"{place}: {type(exc).__name__}") from None


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
