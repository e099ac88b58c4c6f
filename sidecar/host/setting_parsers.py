"""The settings' value parsers: text in, a value out, or ValueError with a plain reason.

``sidecar.host.settings`` names one of these in each row of its table; the error becomes
one line naming the flag and the variable there. The parsers of a source's own rows live
in ``sidecar.host.sources.spec``; those that read the source registry stay in the table's
module.
"""

from __future__ import annotations

import ipaddress
import math
import re
from datetime import timedelta, timezone, tzinfo
from pathlib import Path
from urllib.parse import urlsplit

__all__ = [
    "is_loopback_url",
    "parse_address",
    "parse_addresses",
    "parse_addressing_style",
    "parse_api_rate",
    "parse_bandwidth",
    "parse_destination",
    "parse_log_level",
    "parse_part_size",
    "parse_poll_schedule",
    "parse_positive_int",
    "parse_positive_seconds",
    "parse_token",
    "parse_zone",
]


def parse_poll_schedule(text: str) -> str:
    value = text.strip().lower()
    if value not in ("adaptive", "fixed"):
        raise ValueError("must be adaptive or fixed")
    return value


def parse_api_rate(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 1:
        raise ValueError("must be at least 1 call per hour")
    return value


def parse_positive_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive number of seconds")
    return value


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); ValueError with a plain reason."""
    text = text.strip()
    if text.startswith("["):  # [::1]:8791
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError("IPv6 addresses are written [::1]:8791")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:8791")
    if not host:
        raise ValueError("the host is empty (use 0.0.0.0 to listen everywhere)")
    if not port.isdigit():
        raise ValueError(f"the port must be a number, got {port!r}")
    number = int(port)
    if not 0 <= number <= 65535:
        raise ValueError("port out of range")
    return host, number


def parse_addresses(text: str) -> tuple[tuple[str, int], ...]:
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError("no address given")
    return tuple(parse_address(part) for part in parts)


def parse_token(text: str) -> str:
    from sidecar.host.auth import check_token

    return check_token(text.strip())


def parse_positive_int(text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError("must be an integer >= 1")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2,
               "mb": 1000**2, "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}


def _size(text: str, example: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", text.strip().lower().replace(" ", ""))
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"expected {example}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def parse_part_size(text: str) -> int:
    """``64MiB``, ``8MB``, ``16777216``: one part of a multipart upload (S3: 5 MiB-5 GiB)."""
    value = _size(text, "a size such as 64MiB, 8MB or 16777216")
    if not (5 << 20) <= value <= (5 << 30):
        raise ValueError("must be between 5MiB and 5GiB (the S3 limits for one part)")
    return value


def parse_bandwidth(text: str) -> int:
    """``200MiB``, ``50MB``, ``100000000``: bytes per second (``/s`` may follow)."""
    text = text.strip().lower()
    for suffix in ("/s", "ps"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
    value = _size(text, "bytes per second such as 200MiB, 50MB or 100000000")
    if value < 64 * 1024:
        raise ValueError("must be at least 64KiB per second")
    return value


def parse_destination(text: str) -> str:
    from sidecar.host.upload.location import parse_destination  # standard library only

    parsed = parse_destination(text)
    return parsed.as_uri() if isinstance(parsed, Path) else parsed.url


def parse_addressing_style(text: str) -> str:
    style = text.strip().lower()
    if style not in ("auto", "path", "virtual"):
        raise ValueError("must be auto, path or virtual")
    return style


def parse_log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


def parse_zone(text: str) -> tzinfo:
    text = text.strip()
    if text.upper() in ("UTC", "Z"):
        return timezone.utc
    if text[:1] in "+-":  # a fixed offset such as +08:00
        sign = -1 if text[0] == "-" else 1
        hours, _, minutes = text[1:].partition(":")
        return timezone(sign * timedelta(hours=int(hours), minutes=int(minutes or 0)))
    from zoneinfo import ZoneInfo

    try:
        return ZoneInfo(text)
    except Exception:
        raise ValueError("unknown time zone (use an IANA name such as Asia/Shanghai)") from None
