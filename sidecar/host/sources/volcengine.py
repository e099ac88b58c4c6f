"""The Volcengine ESI source: when will the cloud release this Elastic Scheduled Instance?

One poll asks the ECS OpenAPI, through the official SDK (``volcenginesdkecs``):

1. instance id and region: from settings, else the ECS metadata service (cached);
2. ``DescribeInstances`` -> the instance's ``ScheduledInstanceId`` (cached once found;
   skipped when settings name the scheduled instance);
3. ``DescribeScheduledInstances`` -> ``AutoReleaseAt``, every poll.

A source polls once and never sleeps or retries across polls: the poller owns the
schedule and the backoff, so the SDK's own retries are switched off. A time without an
offset is read as UTC+8, the API's own zone and the earliest reading (``--timezone`` sets
another); the observation says so in ``assumed_timezone``. Every failure
becomes one :class:`SourceError` line with credentials removed.
"""

from __future__ import annotations

import ast
import ipaddress
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from sidecar.host.sources.base import Observation, SourceError, SourceRefused, where
from sidecar.host.sources.spec import Option, SourceSpec, SourceTraits, parse_text, parse_url
from sidecar.models import DEFAULT_METADATA_URL, KIND_SCHEDULED_RELEASE
from sidecar.timeparse import VOLCENGINE_TIMEZONE, ParsedTime, TimestampError, parse_timestamp

__all__ = ["SPEC", "VolcengineConfig", "VolcengineEsiSource", "build", "build_options", "probe"]

logger = logging.getLogger("sidecar.host.sources.volcengine")

ENV_ACCESS_KEY = "VOLCENGINE_ACCESS_KEY"
ENV_SECRET_KEY = "VOLCENGINE_SECRET_KEY"
ENV_SESSION_TOKEN = "VOLCENGINE_SESSION_TOKEN"

_NO_CREDENTIALS = (
    f"no Volcengine credentials: set {ENV_ACCESS_KEY} and {ENV_SECRET_KEY} "
    f"(plus {ENV_SESSION_TOKEN} for STS credentials), or attach an IAM role to this instance"
)
# What the metadata service may answer for an id or a region; anything else (an HTML
# page from a captive proxy, say) is refused rather than sent to the API.
_METADATA_VALUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_METADATA_SETTING = {"instance_id": "ESI_SIDECAR_INSTANCE_ID", "region_id": "ESI_SIDECAR_REGION"}
# Shapes of credentials that could reach a message through an SDK or server text.
_SECRET_SHAPES = (
    re.compile(r"(Signature=)[0-9a-fA-F]+"),
    re.compile(r"(Credential=)[^,\s'\"]+"),
    re.compile(r"((?:Authorization|X-Security-Token)['\"]?\s*[:=]\s*['\"]?)[^'\"\n]+", re.I),
)
_MAX_MESSAGE = 300
# Answers that asking again will not change (SourceRefused): credentials refused, an
# action the account's policy does not allow, or one the endpoint does not offer.
_REFUSED_STATUSES = (401, 403)
_REFUSED_CODES = ("AccessDenied", "Forbidden", "InvalidAction", "InvalidAccessKey",
                  "InvalidCredential", "SignatureDoesNotMatch", "UnauthorizedOperation",
                  "NotAuthorized")


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _return_loggers(configuration: Any) -> None:
    """Undo what the SDK's Configuration does to logging, process-wide.

    It gives the ``urllib3`` logger and its own a stderr handler of its own and stops them
    propagating, so their lines bypass the daemon's format and level (and journald's
    view of them). Remove the handlers it marked and let the records propagate again.
    """
    flag = "_volcengine_sdk_handler"  # the SDK's marker attribute on handlers it adds
    for logger in getattr(configuration, "logger", {}).values():
        if not isinstance(logger, logging.Logger):
            continue
        for handler in list(logger.handlers):
            if getattr(handler, flag, False):
                logger.removeHandler(handler)
        logger.propagate = True


class VolcengineEsiSource:
    """Polls the ECS OpenAPI for this instance's ESI ``AutoReleaseAt``."""

    name = "volcengine-esi"

    def __init__(
        self,
        *,
        instance_id: Optional[str] = None,
        scheduled_instance_id: Optional[str] = None,
        region: Optional[str] = None,
        api_endpoint: Optional[str] = None,
        metadata_url: str = DEFAULT_METADATA_URL,
        naive_timezone: tzinfo = VOLCENGINE_TIMEZONE,
        connect_timeout: float = 5.0,
        read_timeout: float = 5.0,
        metadata_timeout: float = 2.0,
        metadata_attempts: int = 3,
    ) -> None:
        import urllib.request  # lazily: the settings table imports every source module
        if api_endpoint is not None and urlsplit(api_endpoint).scheme not in ("http", "https"):
            raise ValueError(f"api_endpoint must be an http:// or https:// URL: {api_endpoint!r}")
        self._instance_id = instance_id or None
        self._scheduled_instance_id = scheduled_instance_id or None
        self._region = region or None
        self._api_endpoint = api_endpoint.rstrip("/") if api_endpoint else None
        self._metadata_url = metadata_url.rstrip("/")
        self._naive_timezone = naive_timezone
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._metadata_timeout = metadata_timeout
        self._metadata_attempts = max(1, metadata_attempts)
        # The metadata service is link-local: a proxy from the environment must not see it.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._api: Any = None  # volcenginesdkecs.ECSApi, built on first use
        self._credential_provider: Any = None  # the SDK's default chain, when env is unset
        self._secrets: set[str] = set()
        self._lock = threading.Lock()

    # -- the poll --------------------------------------------------------------------

    def poll(self) -> Observation:
        """Ask once; return what the API says, or raise SourceError (one line)."""
        with self._lock:
            try:
                return self._poll()
            except SourceRefused as exc:
                raise SourceRefused(self._clean(str(exc))) from None
            except SourceError as exc:
                raise SourceError(self._clean(str(exc)), throttled=exc.throttled) from None
            except Exception as exc:
                # A bug here must not take the poller down. Say where, but never log the
                # raw exception or its traceback text: the SDK's may carry credentials.
                message = self._clean(f"unexpected {type(exc).__name__}: {exc} {where(exc)}")
                logger.warning("%s source: %s", self.name, message)
                raise SourceError(message) from None

    def _poll(self) -> Observation:
        if self._region is None:
            self._region = self._metadata("region_id")
            logger.info("region %s (from the metadata service)", self._region)
        scheduled_id = self._scheduled_instance_id
        if scheduled_id is None:
            if self._instance_id is None:
                self._instance_id = self._metadata("instance_id")
                logger.info("instance id %s (from the metadata service)", self._instance_id)
            scheduled_id = self._lookup_scheduled_id(self._instance_id)
            if scheduled_id is None:
                return Observation(expires_at_unix=None, instance_id=self._instance_id)
        value = self._auto_release_at(scheduled_id)
        if not value:
            # An ESI with no release scheduled (yet): healthy, nothing to count down to.
            return Observation(
                expires_at_unix=None,
                instance_id=self._instance_id,
                scheduled_instance_id=scheduled_id,
            )
        parsed = self._parse_release(value)
        return Observation(
            expires_at_unix=parsed.unix,
            kind=KIND_SCHEDULED_RELEASE,
            instance_id=self._instance_id,
            scheduled_instance_id=scheduled_id,
            assumed_timezone=parsed.assumed_timezone,
        )

    def _lookup_scheduled_id(self, instance_id: str) -> Optional[str]:
        """The instance's ScheduledInstanceId, cached once found; None for a plain instance.

        "Not an ESI" is not cached: a transient answer without the field must not turn
        the daemon blind for good, and the check costs the same one call per poll.
        """
        import volcenginesdkecs

        request = volcenginesdkecs.DescribeInstancesRequest(instance_ids=[instance_id])
        response = self._call("DescribeInstances", lambda api: api.describe_instances(request))
        instances = getattr(response, "instances", None) or []
        match = next((i for i in instances if getattr(i, "instance_id", None) == instance_id), None)
        if match is None:
            raise SourceError(
                f"DescribeInstances: instance {instance_id!r} not found in region "
                f"{self._region} (check the instance id and region settings)"
            )
        found = getattr(match, "scheduled_instance_id", None)
        if not found:
            logger.debug("instance %s has no ScheduledInstanceId: not an ESI", instance_id)
            return None
        scheduled_id = str(found)
        logger.info("instance %s belongs to scheduled instance %s", instance_id, scheduled_id)
        self._scheduled_instance_id = scheduled_id
        return scheduled_id

    def _auto_release_at(self, scheduled_id: str) -> Optional[str]:
        import volcenginesdkecs

        request = volcenginesdkecs.DescribeScheduledInstancesRequest(
            scheduled_instance_ids=[scheduled_id]
        )
        response = self._call(
            "DescribeScheduledInstances", lambda api: api.describe_scheduled_instances(request)
        )
        infos = getattr(response, "scheduled_instance_info", None) or []
        match = next(
            (i for i in infos if getattr(i, "scheduled_instance_id", None) == scheduled_id), None
        )
        if match is None:
            raise SourceError(
                f"DescribeScheduledInstances: scheduled instance {scheduled_id!r} not found "
                f"in region {self._region}"
            )
        value = getattr(match, "auto_release_at", None)
        if value is not None and not isinstance(value, str):
            raise SourceError(
                f"DescribeScheduledInstances: AutoReleaseAt is not a string: {value!r}"
            )
        return value.strip() if value else None

    def _parse_release(self, value: str) -> ParsedTime:
        """Our own parser first; dateutil for the long tail (``2026/12/01 08:00:00``)."""
        try:
            return parse_timestamp(value, naive_timezone=self._naive_timezone)
        except TimestampError:
            pass
        from dateutil import parser as dateutil_parser

        # Parse with two different defaults: a field the text leaves out takes the
        # default, so the results differ and we refuse to guess a date or an hour.
        results = []
        for default in (datetime(2000, 1, 1, 0, 0), datetime(2001, 2, 2, 1, 0)):
            try:
                results.append(dateutil_parser.parse(value, default=default))
            except (ValueError, OverflowError):
                break
        if len(results) != 2 or results[0] != results[1]:
            raise SourceError(
                f"DescribeScheduledInstances: AutoReleaseAt {value!r} is not a timestamp "
                "we understand"
            )
        # Back through our parser so a naive result gets the configured zone, and the
        # answer says which zone was assumed, exactly as for an RFC 3339 value.
        try:
            return parse_timestamp(results[0].isoformat(), naive_timezone=self._naive_timezone)
        except TimestampError as exc:
            message = f"DescribeScheduledInstances: AutoReleaseAt {value!r}: {exc}"
            raise SourceError(message) from None

    # -- metadata service ------------------------------------------------------------

    def _metadata(self, name: str) -> str:
        """GET ``{metadata_url}/latest/{name}``, a few tries within this poll."""
        import urllib.error
        import urllib.request  # lazily: the settings table imports every source module
        url = f"{self._metadata_url}/latest/{name}"
        problem = "no answer"
        for _ in range(self._metadata_attempts):
            try:
                with self._opener.open(url, timeout=self._metadata_timeout) as response:
                    text = response.read(4096).decode("utf-8", "replace").strip()
            except urllib.error.HTTPError as exc:
                exc.close()
                problem = f"HTTP {exc.code}"
                if 400 <= exc.code < 500:
                    break  # a definite answer; asking again will not change it
                continue
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                problem = "timed out" if isinstance(reason, TimeoutError) else str(reason)
                continue
            if _METADATA_VALUE.match(text):
                return text
            problem = f"unexpected answer {text[:40]!r}"
            break
        raise SourceError(
            f"metadata service {url}: {problem} "
            f"(set {_METADATA_SETTING.get(name, name)} to skip the lookup)"
        )

    # -- the SDK ---------------------------------------------------------------------

    def _call(self, action: str, call: Callable[[Any], Any]) -> Any:
        api = self._client()
        if self._credential_provider is not None:
            self._check_credentials()
        try:
            response = call(api)
        except Exception as exc:
            logger.debug("%s raised %s", action, type(exc).__name__)
            raise self._translate(action, exc) from None
        if response is None:
            raise SourceError(f"{action} failed: malformed response (no Result)")
        return response

    def _check_credentials(self) -> None:
        """Resolve the SDK's default chain first, to say plainly what is missing."""
        try:
            credentials = self._credential_provider.get_credentials()
        except Exception:
            raise SourceRefused(_NO_CREDENTIALS) from None
        if credentials is None or not credentials.ak or not credentials.sk:
            raise SourceRefused(_NO_CREDENTIALS)
        self._remember_secrets(credentials.ak, credentials.sk, credentials.session_token)

    def _remember_secrets(self, *values: Optional[str]) -> None:
        self._secrets.update(v for v in values if v and len(v) >= 4)

    def _client(self) -> Any:
        if self._api is not None:
            return self._api
        import volcenginesdkcore
        import volcenginesdkecs

        configuration = volcenginesdkcore.Configuration()
        _return_loggers(configuration)
        configuration.region = self._region
        configuration.connect_timeout = self._connect_timeout
        configuration.read_timeout = self._read_timeout
        # The poller owns retries and backoff; the SDK's would hide failures and stall.
        configuration.auto_retry = False
        configuration.num_max_retries = 0
        if self._api_endpoint:
            # The SDK accepts a full URL as host and then uses its scheme.
            configuration.host = self._api_endpoint
            configuration.scheme = urlsplit(self._api_endpoint).scheme

        access_key = os.environ.get(ENV_ACCESS_KEY, "").strip()
        secret_key = os.environ.get(ENV_SECRET_KEY, "").strip()
        token = os.environ.get(ENV_SESSION_TOKEN, "").strip()
        if access_key and secret_key:
            configuration.ak, configuration.sk = access_key, secret_key
            configuration.session_token = token
            self._remember_secrets(access_key, secret_key, token)
        elif access_key or secret_key:
            missing = ENV_SECRET_KEY if access_key else ENV_ACCESS_KEY
            self._remember_secrets(access_key, secret_key)
            raise SourceRefused(
                f"{missing} is not set; set both {ENV_ACCESS_KEY} and {ENV_SECRET_KEY}"
            )
        else:
            from volcenginesdkcore.auth.providers.default_provider import (
                DefaultCredentialProvider,
            )

            self._credential_provider = DefaultCredentialProvider()
            configuration.credential_provider = self._credential_provider

        client = volcenginesdkcore.ApiClient(configuration)
        if self._api_endpoint and self._bypass_proxy(self._api_endpoint):
            _connect_directly(client)
        self._api = volcenginesdkecs.ECSApi(client)
        return self._api

    @staticmethod
    def _bypass_proxy(endpoint: str) -> bool:
        """True for a loopback endpoint or one NO_PROXY names.

        The SDK reads HTTP(S)_PROXY but not NO_PROXY, so on a host with a proxy in its
        environment it would send even 127.0.0.1 through that proxy.
        """
        import urllib.request  # lazily: the settings table imports every source module
        parts = urlsplit(endpoint)
        host = parts.hostname or ""
        if _is_loopback(host):
            return True
        hostport = parts.netloc.rpartition("@")[2]
        return bool(urllib.request.proxy_bypass(hostport))

    # -- errors ----------------------------------------------------------------------

    def _translate(self, action: str, exc: Exception) -> SourceError:
        import urllib3
        from volcenginesdkcore.rest import ApiException

        where = self._api_endpoint or f"the ECS endpoint for {self._region}"
        if isinstance(exc, ApiException):
            return self._api_error(action, exc)
        if isinstance(exc, urllib3.exceptions.NewConnectionError):
            reason = str(exc).rpartition("Failed to establish a new connection: ")[2]
            return SourceError(f"{action} failed: cannot connect to {where}: {reason}")
        if isinstance(exc, urllib3.exceptions.ConnectTimeoutError):
            seconds = self._connect_timeout
            return SourceError(f"{action} failed: connect to {where} timed out ({seconds:g} s)")
        if isinstance(exc, urllib3.exceptions.ReadTimeoutError):
            return SourceError(
                f"{action} failed: timed out after {self._read_timeout:g} s waiting for {where}"
            )
        if isinstance(exc, urllib3.exceptions.ProxyError):
            return SourceError(f"{action} failed: proxy error reaching {where}: {exc}")
        if isinstance(exc, urllib3.exceptions.HTTPError):
            return SourceError(f"{action} failed: connection error with {where}: {exc}")
        if isinstance(exc, RuntimeError) and "credential" in str(exc).lower():
            return SourceRefused(_NO_CREDENTIALS)
        if isinstance(exc, (AttributeError, KeyError, TypeError, ValueError)):
            # The SDK's deserializer trips over a body that is not the JSON it expects.
            # Said as what it is, the answer's fault; the parser's own words are no help.
            return SourceError(f"{action} failed: malformed response (not the JSON the API "
                               f"answers; the SDK's parser raised {type(exc).__name__})")
        return SourceError(f"{action} failed: {type(exc).__name__}: {exc}")

    @staticmethod
    def _api_error(action: str, exc: Any) -> SourceError:
        status = exc.status
        if status == 0:  # the SDK's wrapper for TLS failures
            return SourceError(f"{action} failed: TLS error: {exc.reason}")
        code, message = _error_fields(exc.body, exc.reason)
        throttled = status == 429 or (code or "").startswith(("Throttling", "FlowLimit"))
        detail = f"{code}: {message}" if code else (message or str(exc.reason or ""))
        text = f"{action} failed: HTTP {status} {detail}"
        if not throttled and (status in _REFUSED_STATUSES
                              or (code or "").startswith(_REFUSED_CODES)):
            return SourceRefused(text)
        return SourceError(text, throttled=throttled)

    def _clean(self, text: str) -> str:
        """One line, no credentials, not too long."""
        secrets = set(self._secrets)
        for name in (ENV_ACCESS_KEY, ENV_SECRET_KEY, ENV_SESSION_TOKEN):
            value = os.environ.get(name, "").strip()
            if len(value) >= 4:
                secrets.add(value)
        for secret in sorted(secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        for shape in _SECRET_SHAPES:
            text = shape.sub(r"\1***", text)
        text = " ".join(text.split())
        return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _error_fields(body: Any, reason: Any) -> tuple[Optional[str], Optional[str]]:
    """(Code, Message) from an error answer, wherever the SDK left it.

    An HTTP error keeps the body; an error inside an HTTP 200 answer reaches us only as
    ``str(dict)`` in ``reason``.
    """
    parsed: Any = None
    if body:
        try:
            parsed = json.loads(body)
        except ValueError:
            text = str(body).strip()
            return None, (text[:120] + "...") if len(text) > 120 else text
    elif isinstance(reason, str) and reason.startswith("{"):
        try:
            parsed = {"ResponseMetadata": {"Error": ast.literal_eval(reason)}}
        except (ValueError, SyntaxError):
            parsed = None
    if not isinstance(parsed, dict):
        return None, str(reason) if reason else None
    error = (parsed.get("ResponseMetadata") or {}).get("Error") or {}
    if not isinstance(error, dict):
        return None, str(error)
    code, message = error.get("Code"), error.get("Message")
    return (str(code) if code else None), (str(message) if message else None)


def _connect_directly(client: Any) -> None:
    """Swap the SDK client's proxy connection pool for a direct one, same settings."""
    import urllib3

    rest = getattr(client, "rest_client", None)
    pool = getattr(rest, "pool_manager", None)
    if rest is None or not isinstance(pool, urllib3.ProxyManager):
        return
    settings = {k: v for k, v in pool.connection_pool_kw.items() if not k.startswith("_proxy")}
    rest.pool_manager = urllib3.PoolManager(num_pools=client.configuration.num_pools, **settings)
    logger.info("not using the proxy from the environment for the loopback/NO_PROXY endpoint")


@dataclass(frozen=True)
class VolcengineConfig:
    """What this source and the volcengine-events one take from the daemon settings."""

    instance_id: Optional[str]
    scheduled_instance_id: Optional[str]
    region: Optional[str]
    api_endpoint: Optional[str]
    metadata_url: str
    naive_timezone: Optional[tzinfo]  # --timezone; None: the API's own zone


def build_options(config: VolcengineConfig) -> dict[str, Any]:
    """The constructor's arguments, for this source and the volcengine-events one."""
    return {
        "instance_id": config.instance_id,
        "scheduled_instance_id": config.scheduled_instance_id,
        "region": config.region,
        "api_endpoint": config.api_endpoint,
        "metadata_url": config.metadata_url or DEFAULT_METADATA_URL,
        "naive_timezone": config.naive_timezone or VOLCENGINE_TIMEZONE,
    }


def build(config: VolcengineConfig) -> VolcengineEsiSource:
    return VolcengineEsiSource(**build_options(config))


def probe(config: VolcengineConfig, timeout: float) -> Optional[str]:
    """None when the ECS metadata service answers with an instance id (for ``--source
    auto``), else why not, in one line. Skipped (None) when the settings name the
    instance and region: then no metadata is needed."""
    import urllib.error
    import urllib.request  # lazily: the settings table imports every source module
    if config.instance_id and config.region:
        return None
    url = f"{(config.metadata_url or DEFAULT_METADATA_URL).rstrip('/')}/latest/instance_id"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            text = response.read(4096).decode("utf-8", "replace").strip()
    except urllib.error.HTTPError as exc:
        exc.close()
        return f"no ECS metadata service at {url} (HTTP {exc.code})"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        why = (f"no answer within {timeout:g} s" if isinstance(reason, TimeoutError)
               or "timed out" in str(reason) else "cannot connect")
        return f"no ECS metadata service at {url} ({why})"
    if not _METADATA_VALUE.match(text):
        return f"no ECS metadata service at {url} (unexpected answer {text[:40]!r})"
    return None


SPEC = SourceSpec(
    name="volcengine-esi", config=VolcengineConfig, build=build, probe=probe,
    summary="the ESI release", aliases=("volcengine", "esi"),
    traits=SourceTraits(adaptive=True, api_budget=True),
    # The volcengine-events source reads the same rows.
    options=(
        Option("instance_id", parse_text, "ECS instance id (default: ask the metadata "
               "service)", "ID"),
        Option("scheduled_instance_id", parse_text, "ESI scheduled instance id (default: look "
               "it up with DescribeInstances)", "ID"),
        Option("region", parse_text, "region, e.g. cn-beijing (default: ask the metadata "
               "service)"),
        Option("api_endpoint", parse_url, "ECS OpenAPI endpoint (default: the SDK's endpoint "
               "for the region); a URL such as http://127.0.0.1:9000 points at the emulator",
               "URL"),
        Option("metadata_url", parse_url, f"ECS metadata service (default "
               f"{DEFAULT_METADATA_URL})", "URL"),
    ),
)
