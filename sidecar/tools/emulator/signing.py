"""Server-side check of the Volcengine OpenAPI request signature (HMAC-SHA256, V4 style).

Written from the published algorithm, not from the SDK, so that the emulator is an
independent witness: if the SDK and this module disagree, a test fails.

    canonical request = METHOD \\n path \\n canonical query \\n
                        "name:value\\n" per signed header \\n signed names \\n sha256(body)
    string to sign    = "HMAC-SHA256" \\n X-Date \\n date/region/service/request \\n
                        sha256(canonical request)
    signing key       = HMAC(HMAC(HMAC(HMAC(secret, date), region), service), "request")

Failures raise :class:`AuthError` carrying the HTTP status and error code the real
service answers with (see the Volcengine "公共错误码" table).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

from sidecar.tools.emulator.hmac_v4 import derived_key, quote_unreserved, signature

__all__ = [
    "ALGORITHM",
    "AuthError",
    "Credentials",
    "canonical_query",
    "sign_headers",
    "signing_key",
    "verify",
]

ALGORITHM = "HMAC-SHA256"
# The service refuses a request signed more than this far from its own clock.
MAX_CLOCK_SKEW_SECONDS = 15 * 60

_AUTHORIZATION = re.compile(
    r"^HMAC-SHA256\s+Credential=(?P<credential>[^,\s]+),\s*"
    r"SignedHeaders=(?P<signed>[^,\s]+),\s*Signature=(?P<signature>[0-9a-fA-F]+)\s*$"
)
_X_DATE = "%Y%m%dT%H%M%SZ"
_EXPIRED = "The Signature of the request is expired."


class AuthError(Exception):
    """A request the service would refuse: HTTP status, error code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Credentials:
    """The one key pair (and optional STS session token) the emulated account accepts."""

    access_key: str
    secret_key: str
    session_token: Optional[str] = None


def canonical_query(pairs: Sequence[tuple[str, str]]) -> str:
    """Sorted, RFC 3986-quoted ``key=value`` pairs joined by ``&``.

    A repeated key keeps its last value, as the signers do when they build a mapping.
    """
    last: dict[str, str] = {}
    for key, value in pairs:
        last[key] = value
    quoted = sorted((quote_unreserved(key), quote_unreserved(value))
                    for key, value in last.items())
    return "&".join(f"{key}={value}" for key, value in quoted)


def signing_key(secret_key: str, date: str, region: str, service: str) -> bytes:
    """The per-day, per-region, per-service key derived from the secret key."""
    return derived_key(secret_key.encode("utf-8"), (date, region, service, "request"))


def _host_value(value: str) -> str:
    # Signers drop a default port from the signed Host value but still send it.
    host, sep, port = value.rpartition(":")
    if sep and port in ("80", "443"):
        return host
    return value


def _signature(
    *,
    secret_key: str,
    method: str,
    path: str,
    query: Sequence[tuple[str, str]],
    headers: Mapping[str, str],
    signed_names: Sequence[str],
    body_sha256: str,
    x_date: str,
    region: str,
    service: str,
) -> str:
    return signature(
        algorithm=ALGORITHM, key=signing_key(secret_key, x_date[:8], region, service),
        method=method, path=path, canonical_query=canonical_query(query), headers=headers,
        signed_names=signed_names, body_sha256=body_sha256, timestamp=x_date,
        scope=f"{x_date[:8]}/{region}/{service}/request")


def _lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    lowered = {name.lower(): value.strip() for name, value in headers.items()}
    if "host" in lowered:
        lowered["host"] = _host_value(lowered["host"])
    return lowered


def verify(
    *,
    method: str,
    path: str,
    query: Sequence[tuple[str, str]],
    headers: Mapping[str, str],
    body: bytes,
    credentials: Credentials,
    region: str,
    service: str,
    now: Optional[float] = None,
) -> None:
    """Accept the request or raise :class:`AuthError` as the service would.

    ``headers`` may use any case. The signature is recomputed with the *server's* region
    and service, so a client that signed for another region gets SignatureDoesNotMatch,
    as it does in the cloud.
    """
    lowered = _lower_headers(headers)
    authorization = lowered.get("authorization")
    if not authorization:
        raise AuthError(
            401, "MissingAuthenticationToken", "Request is missing Authentication Token."
        )
    match = _AUTHORIZATION.match(authorization)
    if match is None:
        raise AuthError(
            400,
            "InvalidAuthorization",
            "Invalid 'Authorization' header, Pls check authorization header.",
        )
    scope = match["credential"].split("/")
    if len(scope) != 5 or scope[4] != "request" or not scope[0]:
        raise AuthError(
            400,
            "InvalidCredential",
            "Invalid credential in 'Authorization', Pls check credential in authorization header.",
        )
    access_key, scope_date = scope[0], scope[1]

    x_date = lowered.get("x-date")
    if not x_date:
        raise AuthError(400, "MissingRequestInfo", "The request is missing X-Date information.")
    try:
        signed_at = datetime.strptime(x_date, _X_DATE).replace(tzinfo=timezone.utc)
    except ValueError:
        raise AuthError(400, "InvalidTimestamp", _EXPIRED) from None
    clock = datetime.now(timezone.utc).timestamp() if now is None else now
    if abs(clock - signed_at.timestamp()) > MAX_CLOCK_SKEW_SECONDS:
        raise AuthError(400, "InvalidTimestamp", _EXPIRED)

    if not hmac.compare_digest(access_key.encode(), credentials.access_key.encode()):
        raise AuthError(
            401,
            "InvalidAccessKey",
            f"The accesskey [{access_key}] included in the request is invalid.",
        )

    signed_names = [name.lower() for name in match["signed"].split(";")]
    token = lowered.get("x-security-token")
    if credentials.session_token:
        if not token or not hmac.compare_digest(token.encode(), credentials.session_token.encode()):
            raise AuthError(
                401, "InvalidSecretToken", "Invalid secret token, msg: token missing or unknown."
            )
        if "x-security-token" not in signed_names:
            raise AuthError(
                401, "InvalidSecretToken", "Invalid secret token, msg: token is not signed."
            )
    elif token:
        # A long-term key pair never comes with a session token.
        raise AuthError(
            401, "InvalidSecretToken", "Invalid secret token, msg: no session for this key."
        )

    mismatch = AuthError(
        401,
        "SignatureDoesNotMatch",
        "The request signature we calculated does not match the signature you provided. "
        "Check your Secret Access Key and signing method. "
        "Consult the service documentation for details.",
    )
    if (
        scope_date != x_date[:8]
        or "host" not in signed_names
        or any(name not in lowered for name in signed_names)
    ):
        raise mismatch
    expected = _signature(
        secret_key=credentials.secret_key,
        method=method,
        path=path,
        query=query,
        headers=lowered,
        signed_names=signed_names,
        body_sha256=hashlib.sha256(body).hexdigest(),
        x_date=x_date,
        region=region,
        service=service,
    )
    if not hmac.compare_digest(expected, match["signature"].lower()):
        raise mismatch


def sign_headers(
    *,
    method: str,
    host: str,
    query: Sequence[tuple[str, str]],
    credentials: Credentials,
    region: str,
    service: str,
    body: bytes = b"",
    path: str = "/",
    now: Optional[datetime] = None,
) -> dict[str, str]:
    """Headers that sign one request: for tests that need a hand-made request
    (a skewed clock, a tampered query) that no SDK would send."""
    when = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    x_date = when.strftime(_X_DATE)
    headers = {
        "Content-Type": "text/plain",
        "Host": host,
        "X-Date": x_date,
        "X-Content-Sha256": hashlib.sha256(body).hexdigest(),
    }
    if credentials.session_token:
        headers["X-Security-Token"] = credentials.session_token
    lowered = _lower_headers(headers)
    signed_names = sorted(lowered)
    signature = _signature(
        secret_key=credentials.secret_key,
        method=method,
        path=path,
        query=query,
        headers=lowered,
        signed_names=signed_names,
        body_sha256=headers["X-Content-Sha256"],
        x_date=x_date,
        region=region,
        service=service,
    )
    headers["Authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key}/{x_date[:8]}/{region}/{service}/request, "
        f"SignedHeaders={';'.join(signed_names)}, Signature={signature}"
    )
    return headers
