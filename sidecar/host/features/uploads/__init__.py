"""The uploads' HTTP side: ``GET /v1/uploads``, their metrics, their page section, their
line in ``/healthz`` and the durability estimate in ``/v1/expiry`` (docs/upload.md).

It reads the uploader's tracker through ``features.UploadsView`` and imports nothing of
the upload package (``sidecar.host.upload``): a daemon without --upload-to never loads it.
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.host.features import Feature, Needs, PageSection, Part, UploadsView
from sidecar.host.features.uploads.api import add_upload_routes
from sidecar.host.features.uploads.page import uploads_section
from sidecar.models import Expiry

__all__ = ["FEATURE"]


def with_durability(uploads: UploadsView, expiry: Expiry, _now: float) -> Expiry:
    """``/v1/expiry`` with the uploader's estimate of the next upload."""
    upload_seconds, status, measured = uploads.durability()
    return replace(expiry, upload_seconds=upload_seconds, upload_status=status,
                   upload_measured=measured)


def build(needs: Needs) -> Part:
    tracker = needs.uploads
    routes = lambda app: add_upload_routes(app, tracker, needs.clock)  # noqa: E731
    if tracker is None:  # /v1/uploads says so
        return Part(routes=routes)
    # /healthz shows the uploads, never judged: the daemon's job (the deadline) works while
    # storage is down, and a 503 would make systemd or Kubernetes restart a daemon whose
    # restart fixes nothing.
    return Part(owner=tracker, routes=routes, metrics=tracker, health=tracker.summary,
                page=lambda now, _expiry: tracker.body(now, 10),
                expiry=lambda expiry, now: with_durability(tracker, expiry, now))


FEATURE = Feature("uploads", build, PageSection(90, uploads_section))
