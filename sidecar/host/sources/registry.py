"""Deadline sources by name: a source's module is imported only when it is chosen,
so the ``env`` and ``static`` sources work without the Volcengine SDK installed."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

from sidecar.host.sources.auto import AUTO
from sidecar.host.sources.base import Source

__all__ = ["SOURCES", "canonical_name", "create_source", "probe_source"]

# name -> "module:factory"; each factory takes the daemon Settings and returns a Source.
SOURCES: dict[str, str] = {
    "volcengine-esi": "sidecar.host.sources.volcengine:from_settings",
    "volcengine-events": "sidecar.host.sources.volcengine_events:from_settings",
    "aws": "sidecar.host.sources.aws:from_settings",
    "gcp": "sidecar.host.sources.gcp:from_settings",
    "azure": "sidecar.host.sources.azure:from_settings",
    "env": "sidecar.host.sources.env:from_settings",
    "static": "sidecar.host.sources.static:from_settings",
}
ALIASES: dict[str, str] = {"volcengine": "volcengine-esi", "esi": "volcengine-esi",
                           "ec2": "aws", "aws-spot": "aws", "gce": "gcp", "google": "gcp",
                           "az": "azure"}


def canonical_name(name: str) -> str:
    name = name.strip().lower()
    name = ALIASES.get(name, name)
    if name not in SOURCES and name != AUTO:
        choices = ", ".join([AUTO, *sorted(SOURCES)])
        raise ValueError(f"unknown source {name!r}; choose from {choices}")
    return name


def create_source(name: str, settings: Any) -> Source:
    """Import the chosen source's module and build it from the daemon settings."""
    module_name, _, attr = SOURCES[canonical_name(name)].partition(":")
    factory: Callable[[Any], Source] = getattr(importlib.import_module(module_name), attr)
    return factory(settings)


def probe_source(name: str, settings: Any, timeout: float) -> Optional[str]:
    """Ask whether the source's service answers here: None if so, else why not. Each
    source module that can be probed has ``probe(settings, timeout)``."""
    module_name = SOURCES[canonical_name(name)].partition(":")[0]
    probe: Callable[[Any, float], Optional[str]] = importlib.import_module(module_name).probe
    return probe(settings, timeout)
