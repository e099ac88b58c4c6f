"""The V4-style HMAC-SHA256 signature both cloud stand-ins check (Volcengine's and SigV4).

The two differ only in their names and constants (algorithm, key seed, scope's last
part) and in how they canonicalise the query; the shape is one:

    canonical request = METHOD \\n path \\n canonical query \\n
                        "name:value\\n" per signed header \\n signed names \\n sha256(body)
    string to sign    = algorithm \\n timestamp \\n scope \\n sha256(canonical request)
    signing key       = HMAC(...HMAC(HMAC(seed, date), region)..., last scope part)

Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from urllib.parse import quote

__all__ = ["derived_key", "quote_unreserved", "signature"]


def quote_unreserved(text: str) -> str:
    """RFC 3986 unreserved characters as they are; everything else %XX (UTF-8)."""
    return quote(text, safe="-_.~")


def derived_key(seed: bytes, parts: Sequence[str]) -> bytes:
    """The signing key: ``seed`` HMAC-chained through the scope's ``parts`` in order."""
    key = seed
    for part in parts:
        key = hmac.new(key, part.encode("utf-8"), hashlib.sha256).digest()
    return key


def signature(*, algorithm: str, key: bytes, method: str, path: str, canonical_query: str,
              headers: Mapping[str, str], signed_names: Sequence[str], body_sha256: str,
              timestamp: str, scope: str) -> str:
    """The hex signature of one request; ``headers`` holds each signed name's
    canonical value."""
    header_lines = "".join(f"{name}:{headers[name]}\n" for name in signed_names)
    canonical = "\n".join([method.upper(), path or "/", canonical_query, header_lines,
                           ";".join(signed_names), body_sha256])
    to_sign = "\n".join(
        [algorithm, timestamp, scope, hashlib.sha256(canonical.encode("utf-8")).hexdigest()])
    return hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
