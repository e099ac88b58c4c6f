"""Google Compute Engine: Spot / preemptible VM preemption and host maintenance, from the
GCE metadata server. Every request carries ``Metadata-Flavor: Google`` and every answer
must carry it back: anything else at the address is not GCE's metadata server.

- ``instance/preempted``: ``FALSE``; ``TRUE`` once Compute Engine preempts the VM, which
  is then stopped about 30 s later [1]. Served as a preemption notice at the first time
  this source saw ``TRUE`` + 30 s; kept, not slid, and forgotten at ``FALSE``.
- ``instance/maintenance-event``: ``NONE``; ``MIGRATE_ON_HOST_MAINTENANCE`` is a live
  migration, the VM keeps running: listed as advisory, never a deadline;
  ``TERMINATE_ON_HOST_MAINTENANCE``: the VM is stopped 60 minutes after the notice on a VM
  with GPUs, 60 s on others [2]; served at first seen + that notice. A GPU VM is known by
  its machine type (A2, A3, A4, G2, G4 have GPUs built in) or NVIDIA GPUs on this host;
  unsure means 60 s, which can only make the job save early.
- ``instance/upcoming-maintenance``: a maintenance window announced ahead, on the machine
  types that have it [3]; its start is served as scheduled maintenance. Best effort: most
  VMs lack the key and its documented format varies, so a bad answer is logged once and
  never fails the poll.
- ``instance/id`` once, for ``instance_id``.
- ``instance/attributes/cluster-name`` once: present on a GKE node, whose pods get 15 s
  from a preemption to their end, not the VM's 30 s [5]. The preemption is then served
  at first seen + 15 s, and the source's notice (``notice_seconds``, the protection
  verdict's figure) is 15 s; a 404 is a plain VM.

Long polls, not tight polling [4]. The two notice keys are watched at once, each by its
own ``?wait_for_change=true&last_etag=E&timeout_sec=N`` request on its own thread. A poll
returns as soon as either key changes, so a notice is served within milliseconds of the
server showing it, or, when nothing changed, once both long polls ran out: every N s
(20, or a quarter of the staleness bound when that is shorter), a success that keeps the
answer fresh. Then a 1 s pause (``poll_interval_seconds``): a change in it is not missed,
the next long poll answers at once because the ETag moved. Weighed and not chosen: one
recursive long poll on ``instance/`` watches both keys in one request, but wakes on any
change of the instance, carries the whole directory (ssh keys, startup scripts) each time,
and may not count as reading ``maintenance-event``, which GCE requires before it gives the
60 s warning [2]; watching ``preempted`` and reading ``maintenance-event`` between long
polls would add up to N s to a maintenance notice; alternating, up to N s to both.

urllib3 does the HTTP, with no proxy: the server is link-local. Plain reads time out
after 1 s, a long poll after N + 5 s; connecting after 0.5 s, so a host that is not on
GCE fails fast.

[1] The Compute API's ``Scheduling.skipGuestOsShutdown``: "30 seconds for Spot VMs"
    between ACPI G2 soft off and G3 mechanical off (120 s for standard VMs),
    https://cloud.google.com/compute/docs/reference/rest/v1/instances, as mirrored at
    https://pub.dev/documentation/googleapis/latest/compute_v1/Scheduling/skipGuestOsShutdown.html
[2] https://cloud.google.com/compute/docs/gpus/gpu-host-maintenance ("GPU VMs a 1-hour
    stopping notice, while normal VMs receive only a 60-second notice"),
    https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice
[3] https://cloud.google.com/compute/docs/instances/monitor-plan-host-maintenance-event
[4] https://cloud.google.com/compute/docs/metadata/querying-metadata
[5] https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms: on a preemption,
    GKE's graceful node shutdown leaves non-system Pods up to 15 s of the VM's 30 s
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional

if TYPE_CHECKING:
    import urllib3

from sidecar.host.sources.base import Observation, SourceError, where
from sidecar.host.sources.metadata_http import clip, probe_failure, request
from sidecar.host.sources.spec import Option, SourceSpec, SourceTraits, parse_url
from sidecar.models import (
    DEFAULT_GCP_METADATA_URL,
    KIND_MAINTENANCE,
    KIND_PREEMPTION,
    Notice,
    observation_from_notices,
)
from sidecar.timeparse import TimestampError, parse_timestamp

__all__ = ["SPEC", "GcpConfig", "GcpSource", "build", "long_poll_seconds_for", "probe"]

log = logging.getLogger("sidecar.host.sources.gcp")

PREFIX = "/computeMetadata/v1/"
FLAVOR = {"Metadata-Flavor": "Google"}
PREEMPTED_KEY = "instance/preempted"
MAINTENANCE_KEY = "instance/maintenance-event"
UPCOMING_KEY = "instance/upcoming-maintenance"
ID_KEY = "instance/id"
MACHINE_TYPE_KEY = "instance/machine-type"
CLUSTER_NAME_KEY = "instance/attributes/cluster-name"  # set on GKE nodes
MIGRATE = "MIGRATE_ON_HOST_MAINTENANCE"
TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"

PREEMPTION_NOTICE_SECONDS = 30.0
GKE_PREEMPTION_NOTICE_SECONDS = 15.0
TERMINATE_NOTICE_SECONDS = 60.0
GPU_TERMINATE_NOTICE_SECONDS = 3600.0
GPU_MACHINE_FAMILIES = frozenset({"a2", "a3", "a4", "a4x", "g2", "g4"})
LONG_POLL_SECONDS = 20
POLL_INTERVAL_SECONDS = 1.0
READ_MARGIN_SECONDS = 5.0  # a long poll's read timeout is its timeout_sec plus this
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass
class _Watch:
    """One key and its long poll. Changed by its request's thread, under the condition."""

    key: str
    value: Optional[str] = None
    etag: Optional[str] = None  # None: the next request reads at once, without waiting
    changed_at: float = 0.0  # wall clock when the value last changed
    pending: bool = False  # a request is in flight
    done: bool = False  # the request started last has answered
    news: bool = False  # a change (or a fresh read) the next poll has not reported yet
    error: Optional[str] = None


class GcpSource:
    name = "gcp"
    #: The pause between two long polls (the poller honours it over --poll-interval).
    poll_interval_seconds = POLL_INTERVAL_SECONDS

    def __init__(
        self,
        url: str = DEFAULT_GCP_METADATA_URL,
        *,
        long_poll_seconds: int = LONG_POLL_SECONDS,
        read_margin_seconds: float = READ_MARGIN_SECONDS,
        connect_timeout: float = 0.5,
        read_timeout: float = 1.0,
        preemption_notice_seconds: float = PREEMPTION_NOTICE_SECONDS,
        terminate_notice_seconds: Optional[float] = None,
        gpu_vm: Optional[bool] = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import urllib3  # lazily: the settings table imports every source module
        if isinstance(long_poll_seconds, bool) or not isinstance(long_poll_seconds, int) or (
            long_poll_seconds < 1
        ):
            raise ValueError(f"long_poll_seconds must be an integer >= 1, "
                             f"got {long_poll_seconds!r}")
        self._url = url.rstrip("/")
        self._long_poll_seconds = long_poll_seconds
        self._plain_timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self._long_timeout = urllib3.Timeout(
            connect=connect_timeout, read=long_poll_seconds + read_margin_seconds)
        # Two long polls and a plain read can be in flight at once.
        self._http = urllib3.PoolManager(retries=False, maxsize=4)
        self._preemption_notice = preemption_notice_seconds
        self._terminate_notice = terminate_notice_seconds
        self._gpu_vm = gpu_vm
        self._clock = clock
        self._changed = threading.Condition()
        self._preempted = _Watch(PREEMPTED_KEY)
        self._maintenance = _Watch(MAINTENANCE_KEY)
        self._instance_id: Optional[str] = None
        self._machine_type: Optional[str] = None
        self.gke: Optional[bool] = None  # a GKE node (cluster-name set); None: not asked yet
        self._preemption_at: Optional[float] = None  # the deadline, once seen
        self._terminate_at: Optional[float] = None
        self._event_seen = "NONE"
        self._upcoming_problem: Optional[str] = None

    # ------------------------------------------------------------------ poll

    def poll(self) -> Observation:
        self._identify()
        self._watch()
        notices = [notice for notice in (self._preemption(), self._maintenance_notice())
                   if notice is not None]
        notices.extend(self._upcoming())
        return observation_from_notices(notices, instance_id=self._instance_id)

    def _preemption(self) -> Optional[Notice]:
        value, seen_at = self._current(self._preempted)
        if value == "FALSE":
            self._preemption_at = None
            return None
        if value != "TRUE":
            self._refuse(self._preempted, f"expected TRUE or FALSE, got {clip(value)!r}")
        if self._preemption_at is None:
            self._preemption_at = seen_at + self.notice_seconds
        return Notice(KIND_PREEMPTION, self._preemption_at, detail="preempted")

    @property
    def notice_seconds(self) -> float:
        """From a preemption to the end: 15 s for a GKE node's pods (unless this source
        was told a notice of its own), the VM's 30 s otherwise."""
        if self.gke and self._preemption_notice == PREEMPTION_NOTICE_SECONDS:
            return GKE_PREEMPTION_NOTICE_SECONDS
        return self._preemption_notice

    def _maintenance_notice(self) -> Optional[Notice]:
        event, seen_at = self._current(self._maintenance)
        if event not in ("NONE", MIGRATE, TERMINATE):
            self._refuse(self._maintenance, f"unknown event {clip(event)!r}")
        if event == MIGRATE and self._event_seen != MIGRATE:
            log.warning("GCE host maintenance: this VM will be live-migrated (%s); it keeps "
                        "running, no deadline", MIGRATE)
        self._event_seen = event
        if event != TERMINATE:
            self._terminate_at = None
            return Notice(KIND_MAINTENANCE, None, advisory=True,
                          detail="live migration") if event == MIGRATE else None
        if self._terminate_at is None:
            self._terminate_at = seen_at + self._terminate_notice_seconds()
        return Notice(KIND_MAINTENANCE, self._terminate_at, detail=TERMINATE)

    def _terminate_notice_seconds(self) -> float:
        if self._terminate_notice is not None:
            return self._terminate_notice
        gpu = self._gpu_vm
        if gpu is None:
            gpu = _gpu_machine_type(self._machine_type) or _nvidia_gpus_here()
        return GPU_TERMINATE_NOTICE_SECONDS if gpu else TERMINATE_NOTICE_SECONDS

    def _current(self, watch: _Watch) -> tuple[str, float]:
        with self._changed:
            return watch.value or "", watch.changed_at

    def _refuse(self, watch: _Watch, problem: str) -> NoReturn:
        with self._changed:
            watch.etag = None  # read it again at once next time: a glitch heals quickly
        raise SourceError(f"GCE metadata {watch.key}: {problem}")

    def _identify(self) -> None:
        """``instance/id`` once, and the machine type when it decides the maintenance
        notice. Best effort: when the server does not answer, the watches say so."""
        try:
            if self._instance_id is None:
                self._instance_id = self._read(ID_KEY) or None
            if self._machine_type is None and self._terminate_notice is None and (
                self._gpu_vm is None
            ):
                self._machine_type = self._read(MACHINE_TYPE_KEY)
            if self.gke is None:
                status = self._request(CLUSTER_NAME_KEY, {}, self._plain_timeout).status
                if status in (200, 404):
                    self.gke = status == 200
                    if self.gke:
                        log.info("a GKE node (instance/attributes/cluster-name is set): "
                                 "its pods get %.0f s from a preemption", self.notice_seconds)
        except SourceError:
            pass

    # ------------------------------------------------------------------ long polls

    def _watch(self) -> None:
        """Block until a watched key changed, or both long polls ran out, or one failed."""
        watches = (self._preempted, self._maintenance)
        limit = float(self._long_timeout.read_timeout or 0) + 1.0  # past the requests' own
        with self._changed:
            for watch in watches:
                if not watch.pending:
                    self._start(watch)
            end = time.monotonic() + limit
            while not _settled(watches):
                left = end - time.monotonic()
                if left <= 0:
                    raise SourceError(f"GCE metadata at {self._url}: no answer within "
                                      f"{limit:g} s")
                self._changed.wait(left)
            errors = [watch.error for watch in watches if watch.error]
            for watch in watches:
                watch.error, watch.news = None, False
        if errors:
            raise SourceError(errors[0])

    def _start(self, watch: _Watch) -> None:
        watch.pending, watch.done = True, False
        threading.Thread(target=self._run, args=(watch, watch.etag), daemon=True,
                         name=f"gcp-watch-{watch.key.rsplit('/', 1)[-1]}").start()

    def _run(self, watch: _Watch, etag: Optional[str]) -> None:
        value: Optional[str] = None
        new_etag: Optional[str] = None
        error: Optional[str] = None
        try:
            value, new_etag = self._fetch(watch.key, etag)
        except SourceError as exc:
            error = str(exc)
        except Exception as exc:  # a bug must not leave the watch pending for good
            error = f"internal error watching {watch.key}: {type(exc).__name__} {where(exc)}"
        with self._changed:
            watch.pending, watch.done = False, True
            if error is not None or value is None:
                watch.error, watch.etag = error, None
            else:
                if value != watch.value:
                    watch.changed_at = self._clock()
                watch.news = watch.news or etag is None or value != watch.value
                watch.value, watch.etag = value, new_etag
            self._changed.notify_all()

    def _fetch(self, key: str, etag: Optional[str]) -> tuple[str, str]:
        """The value at ``key`` and its ETag: at once without ``etag``, else when the
        value no longer has that ETag or the long poll ran out."""
        if etag is None:
            response = self._request(key, {}, self._plain_timeout)
        else:
            fields = {"wait_for_change": "true", "last_etag": etag,
                      "timeout_sec": str(self._long_poll_seconds)}
            response = self._request(key, fields, self._long_timeout)
        if response.status != 200:
            raise SourceError(f"GCE metadata {key}: HTTP {response.status} from {self._url}")
        tag = response.headers.get("ETag")
        if not tag:
            raise SourceError(f"GCE metadata {key}: the answer has no ETag header")
        return _text(response), tag

    # ------------------------------------------------------------------ plain reads

    def _read(self, key: str) -> str:
        response = self._request(key, {}, self._plain_timeout)
        if response.status != 200:
            raise SourceError(f"GCE metadata {key}: HTTP {response.status} from {self._url}")
        return _text(response)

    def _upcoming(self) -> list[Notice]:
        """The announced maintenance window, if any; problems are logged, not raised."""
        try:
            response = self._request(UPCOMING_KEY, {"alt": "json"}, self._plain_timeout)
            if response.status not in (200, 404):
                raise SourceError(f"GCE metadata {UPCOMING_KEY}: HTTP {response.status}")
            start = _window_start(_text(response)) if response.status == 200 else None
        except SourceError as exc:
            if str(exc) != self._upcoming_problem:
                log.warning("ignoring the announced maintenance window: %s", exc)
            self._upcoming_problem = str(exc)
            return []
        self._upcoming_problem = None
        if start is None:
            return []
        return [Notice(KIND_MAINTENANCE, start, detail="maintenance window")]

    def _request(self, key: str, fields: dict[str, str], timeout: urllib3.Timeout) -> Any:
        place = f"GCE metadata {key} at {self._url}"
        response = request(self._http, "GET", self._url + PREFIX + key, fields=fields,
                           headers=FLAVOR, place=place, cloud="GCP", timeout=timeout)
        flavor = response.headers.get("Metadata-Flavor")
        if response.status == 200 and flavor != "Google":  # a proxy's or a portal's page
            shown = "no Metadata-Flavor header" if flavor is None else (
                f"Metadata-Flavor: {clip(flavor, 40)}")
            raise SourceError(f"{place}: the answer has {shown}, not Metadata-Flavor: "
                              "Google: not GCE's metadata server")
        return response


def _settled(watches: tuple[_Watch, ...]) -> bool:
    """A poll can answer: a request failed, or every value is known and one changed, or
    every long poll answered (nothing changed: a fresh confirmation)."""
    if any(watch.error for watch in watches):
        return True
    if any(watch.value is None for watch in watches):
        return False
    return any(watch.news for watch in watches) or all(watch.done for watch in watches)


def _window_start(body: str) -> Optional[float]:
    """The start of the window ``upcoming-maintenance`` announces, or None. Both spellings
    seen in GCE's documentation are read (``window_start_time``, ``windowStartTime``)."""
    if body in ("", "NONE", "{}", "{ }"):
        return None
    try:
        window = json.loads(body)
    except ValueError:
        raise SourceError(f"GCE metadata {UPCOMING_KEY}: not JSON: {clip(body)}") from None
    if isinstance(window, dict) and len(window) == 1:
        inner = next(iter(window.values()))
        window = inner if isinstance(inner, dict) else window  # {"Upcoming maintenance": {}}
    if not isinstance(window, dict):
        raise SourceError(f"GCE metadata {UPCOMING_KEY}: not an object: {clip(body)}")
    status = str(window.get("maintenance_status", window.get("maintenanceStatus", "")))
    if not window or "error" in window or status.upper().startswith("COMPLETE"):
        return None  # nothing announced ("no notifications have been received yet")
    start = window.get("window_start_time", window.get("windowStartTime"))
    try:
        # GCE writes RFC 3339 in UTC: a time without an offset is UTC.
        text = start if isinstance(start, str) else ""
        return parse_timestamp(text, naive_timezone=timezone.utc).unix
    except TimestampError as exc:
        raise SourceError(f"GCE metadata {UPCOMING_KEY}: window start: {exc}") from None


def _gpu_machine_type(machine_type: Optional[str]) -> bool:
    """``projects/N/machineTypes/a3-highgpu-8g``: the accelerator-optimized families."""
    name = (machine_type or "").rsplit("/", 1)[-1]
    return name.split("-", 1)[0].lower() in GPU_MACHINE_FAMILIES


def _nvidia_gpus_here() -> bool:
    """N1 VMs get GPUs attached: the NVIDIA driver lists them (the job needs it anyway)."""
    try:
        return any(_NVIDIA_GPUS.iterdir())
    except OSError:
        return False


def _text(response: Any) -> str:
    return str(response.data.decode("utf-8", "replace").strip())



def long_poll_seconds_for(stale_after_seconds: float) -> int:
    """The long poll's timeout_sec: 20 s, or a quarter of the staleness bound when that is
    shorter, so that a long poll running out still confirms the answer in time."""
    return max(1, min(LONG_POLL_SECONDS, int(stale_after_seconds / 4)))


@dataclass(frozen=True)
class GcpConfig:
    gcp_metadata_url: str
    effective_stale_after: float  # the long polls fit in it


def probe(config: GcpConfig, timeout: float) -> Optional[str]:
    """None when a GCE metadata server answers at the configured address (for
    ``--source auto``): any answer with ``Metadata-Flavor: Google``; else why not."""
    import urllib3  # lazily: the settings table imports every source module
    url = config.gcp_metadata_url.rstrip("/")
    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(total=timeout))
    try:
        response = http.request("GET", url + PREFIX + ID_KEY, headers=FLAVOR, redirect=False)
    except urllib3.exceptions.HTTPError as exc:
        return f"no GCE metadata server at {url} ({probe_failure(exc, timeout)})"
    finally:
        http.clear()
    if response.headers.get("Metadata-Flavor") == "Google":
        return None
    return (f"no GCE metadata server at {url} (HTTP {response.status} without "
            "Metadata-Flavor: Google)")


def build(config: GcpConfig) -> GcpSource:
    return GcpSource(config.gcp_metadata_url,
                     long_poll_seconds=long_poll_seconds_for(config.effective_stale_after))


SPEC = SourceSpec(
    name="gcp", config=GcpConfig, build=build, probe=probe,
    summary="preemption, host maintenance", aliases=("gce", "google"),
    notice_seconds=PREEMPTION_NOTICE_SECONDS,  # 30 s; a GKE node's source says 15 s
    traits=SourceTraits(poll_interval_seconds=POLL_INTERVAL_SECONDS),
    options=(
        Option("gcp_metadata_url", parse_url, f"GCE metadata server for the gcp source "
               f"(default {DEFAULT_GCP_METADATA_URL})", "URL"),
    ),
)
