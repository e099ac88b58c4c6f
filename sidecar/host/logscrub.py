"""No credentials in the daemon's log, at any level (issue 13).

At DEBUG the libraries the daemon runs log what they send and receive: botocore each
request with its ``Authorization`` header (the access key in ``Credential=``, the
signature) and ``X-Amz-Security-Token``, then its canonical request and signature; the
Volcengine SDK each response body (an STS or instance-role answer holds ``AccessKeyId``,
``SecretAccessKey`` and ``SessionToken``); urllib3 each URL (a presigned one holds
``X-Amz-Signature``). :func:`install` rewrites every log record as it is made, before
any handler, filter or logger of any library sees it: the credentials found in the
environment are replaced wherever they appear, and so is anything shaped like a
credential (:data:`SHAPES`). Standard library only.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from collections.abc import Mapping
from typing import Any, Callable, Optional
from urllib.parse import quote

__all__ = ["REDACTED", "SHAPES", "install", "scrub"]

REDACTED = "***"

# Header and field names that carry a credential, and how their value ends.
_HEADERS = (r"authorization|x-amz-security-token|x-security-token|x-amz-signature"
            r"|x-amz-credential|x-aws-ec2-metadata-token|x-volc-ecs-metadata-token")
_FIELDS = (r"access_?key_?id|aws_access_key_id|secret_?access_?key|aws_secret_access_key"
           r"|secret_?key|access_?key|session_?token|aws_session_token|security_?token"
           r"|\btoken|password")
SHAPES: tuple[re.Pattern[str], ...] = (
    # A header's value: in "Name: value" lines, dict reprs ('Name': b'value'), JSON and
    # query strings (Name=value&...), up to its closing quote, the line's end or the next
    # parameter. An Authorization value holds commas, so those do not end it.
    re.compile(rf"((?:{_HEADERS})['\"]?\s*[:=]\s*b?['\"]?)[^'\"\r\n&]+", re.I),
    # Signing parts wherever they stand alone.
    re.compile(r"((?:Signature|Credential)=)[^,\s'\"&]+"),
    re.compile(r"(Signature:\s*)[0-9a-fA-F]{8,}"),  # botocore.auth: "Signature:\n<hex>"
    # A credential field of a body: JSON, a dict repr, a form, YAML-ish text...
    re.compile(rf"((?:{_FIELDS})['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,;&}}<]+", re.I),
    # ...and of an XML body (AWS STS).
    re.compile(r"(<(?:AccessKeyId|SecretAccessKey|SessionToken|SecurityToken)>)[^<]*", re.I),
)

# Variables whose value is a credential: these names, and any with these words in them
# (but not a path to one: *_FILE, *_PATH, *_DIR, *_URL).
_SECRET_VARIABLE = re.compile(r"SECRET|TOKEN|PASSWORD|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL")
_NOT_A_VALUE = ("_FILE", "_PATH", "_DIR", "_URL", "_ARN", "_TRN", "_NAME")
_SHORTEST_SECRET = 6  # shorter values ("true", "1") would blank out ordinary words


def secret_values(environ: Mapping[str, str]) -> frozenset[str]:
    """The credentials the environment holds, and their URL-encoded forms."""
    values: set[str] = set()
    for name, value in environ.items():
        upper = name.upper()
        if not _SECRET_VARIABLE.search(upper) or upper.endswith(_NOT_A_VALUE):
            continue
        value = value.strip()
        if len(value) >= _SHORTEST_SECRET:
            values.update((value, quote(value, safe="")))
    return frozenset(values)


def scrub(text: str, secrets: frozenset[str] = frozenset()) -> str:
    """``text`` with every value in ``secrets`` and every credential shape replaced."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    for shape in SHAPES:
        text = shape.sub(rf"\1{REDACTED}", text)
    return text


def _scrub_record(record: logging.LogRecord, secrets: frozenset[str]) -> None:
    try:
        message = record.getMessage()
    except Exception:  # arguments that do not fit: show none of them
        message = f"{record.msg} (its arguments are not shown: they do not fit the message)"
        record.args = None
    cleaned = scrub(message, secrets)
    if cleaned != message or record.args is None:
        record.msg, record.args = cleaned, None
    if record.exc_info and not record.exc_text:
        # Formatted here so the traceback's text (an exception may quote a request) is
        # scrubbed too; formatters use exc_text when it is set.
        record.exc_text = scrub("".join(traceback.format_exception(*record.exc_info)).rstrip(),
                                secrets)
    if record.stack_info:
        record.stack_info = scrub(record.stack_info, secrets)


def install(environ: Optional[Mapping[str, str]] = None) -> None:
    """Scrub every log record of this process from now on (idempotent; a second call
    reads the environment again)."""
    secrets = secret_values(os.environ if environ is None else environ)
    current: Any = logging.getLogRecordFactory()
    previous: Callable[..., logging.LogRecord] = getattr(current, "scrubbed_factory", current)

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _scrub_record(record, secrets)
        return record

    factory.scrubbed_factory = previous  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
