"""The features of the daemon, in the order they are built: a feature may read the ones
before it (``Needs.owner``). Their routes, metrics and page bodies come in this order too.
Adding a feature: its package under ``features/``, and one line here."""

from __future__ import annotations

from sidecar.host.features import (
    Feature,
    Needs,
    Part,
    drills,
    events,
    protection,
    reclaims,
    uploads,
)

__all__ = ["FEATURES", "build_features"]

FEATURES: tuple[Feature, ...] = (
    uploads.FEATURE,
    events.FEATURE,
    drills.FEATURE,  # reads the events (the guards' drill reports)
    protection.FEATURE,  # reads the events and the uploads
    reclaims.FEATURE,  # reads the events
)


def build_features(needs: Needs, features: tuple[Feature, ...] = FEATURES) -> dict[str, Part]:
    """Each feature built, by name; one that is off in this daemon is left out."""
    for feature in features:
        part = feature.build(needs)
        if part is not None:
            needs.built[feature.name] = part
    return dict(needs.built)
