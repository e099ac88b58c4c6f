"""Server-side check of an AWS Signature Version 4 request signature, for the EC2 stand-in.

Written from AWS's published algorithm ("Create a signed AWS API request"), not from
botocore, so that the stand-in is an independent witness of botocore's signing:

    canonical request = METHOD \\n path \\n canonical query \\n
                        "name:value\\n" per signed header \\n signed names \\n sha256(body)
    string to sign    = "AWS4-HMAC-SHA256" \\n X-Amz-Date \\n date/region/service/aws4_request
                        \\n sha256(canonical request)
    signing key       = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), service),
                        "aws4_request")

A refusal raises :class:`SigV4Error` with the code EC2 answers (``AuthFailure`` for a key
it does not know or a signature that does not match, ``RequestExpired`` for a clock off
by more than five minutes). Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional

from sidecar.tools.emulator.hmac_v4 import derived_key, quote_unreserved, signature

__all__ = ["ALGORITHM", "MAX_CLOCK_SKEW_SECONDS", "AwsCredentials", "SigV4Error", "verify"]

ALGORITHM = "AWS4-HMAC-SHA256"
MAX_CLOCK_SKEW_SECONDS = 5 * 60  # EC2's RequestExpired bound
_AUTHORIZATION = re.compile(
    r"^AWS4-HMAC-SHA256\s+Credential=(?P<credential>[^,\s]+),\s*"
    r"SignedHeaders=(?P<signed>[^,\s]+),\s*Signature=(?P<signature>[0-9a-f]{64})\s*$"
)
_AUTH_FAILURE = "AWS was not able to validate the provided access credentials"


class SigV4Error(Exception):
    """A request EC2 would refuse: its HTTP status, error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class AwsCredentials:
    """The one key pair (and optional session token) the emulated account accepts."""

    access_key: str
    secret_key: str
    session_token: Optional[str] = None


def _canonical_query(pairs: Sequence[tuple[str, str]]) -> str:
    quoted = sorted((quote_unreserved(k), quote_unreserved(v)) for k, v in pairs)
    return "&".join(f"{k}={v}" for k, v in quoted)


def _header_value(headers: Any, name: str) -> Optional[str]:
    """A header as SigV4 canonicalises it: every value, inner spaces folded, joined by
    commas; None when the request does not carry it."""
    values = headers.get_all(name) if hasattr(headers, "get_all") else (
        [headers[name]] if name in headers else None)
    if not values:
        return None
    return ",".join(" ".join(str(value).split()) for value in values)


def verify(credentials: AwsCredentials, *, method: str, path: str,
           query: Sequence[tuple[str, str]], headers: Any, body: bytes, region: str,
           service: str, now: Optional[float] = None) -> None:
    """Return when the request is signed with ``credentials`` for ``region`` and
    ``service``; raise SigV4Error with EC2's code otherwise."""
    match = _AUTHORIZATION.match(_header_value(headers, "Authorization") or "")
    if match is None:
        raise SigV4Error(401, "AuthFailure", "the request is not signed with "
                         f"{ALGORITHM} (no or malformed Authorization header)")
    access_key, _, scope = match["credential"].partition("/")
    date, _, rest = scope.partition("/")
    if access_key != credentials.access_key:
        raise SigV4Error(401, "AuthFailure", _AUTH_FAILURE)
    if rest != f"{region}/{service}/aws4_request":
        raise SigV4Error(401, "AuthFailure", f"credential scope {scope!r} is not "
                         f"<date>/{region}/{service}/aws4_request")
    amz_date = _header_value(headers, "X-Amz-Date") or ""
    try:
        signed_at = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise SigV4Error(401, "AuthFailure", "no valid X-Amz-Date header") from None
    if amz_date[:8] != date:
        raise SigV4Error(401, "AuthFailure", "the credential scope's date is not X-Amz-Date's")
    current = now if now is not None else datetime.now(timezone.utc).timestamp()
    if abs(current - signed_at.timestamp()) > MAX_CLOCK_SKEW_SECONDS:
        raise SigV4Error(400, "RequestExpired", f"Request has expired: signed at {amz_date}")
    names = match["signed"].split(";")
    if "host" not in names or names != sorted(names):
        raise SigV4Error(401, "AuthFailure", "SignedHeaders must be sorted and include host")
    if credentials.session_token is not None and (
            _header_value(headers, "X-Amz-Security-Token") != credentials.session_token
            or "x-amz-security-token" not in names):
        raise SigV4Error(401, "AuthFailure", _AUTH_FAILURE)
    values = {}
    for name in names:
        value = _header_value(headers, name)
        if value is None:
            raise SigV4Error(401, "AuthFailure", f"signed header {name!r} is missing")
        values[name] = value
    key = derived_key(("AWS4" + credentials.secret_key).encode("utf-8"),
                      (date, region, service, "aws4_request"))
    expected = signature(algorithm=ALGORITHM, key=key, method=method, path=path,
                         canonical_query=_canonical_query(query), headers=values,
                         signed_names=names, body_sha256=hashlib.sha256(body).hexdigest(),
                         timestamp=amz_date, scope=scope)
    if not hmac.compare_digest(expected, match["signature"]):
        raise SigV4Error(401, "AuthFailure", _AUTH_FAILURE)
