"""Deadline sources by name: each module's ``SPEC`` says the rest (aliases, settings rows,
traits, how ``auto`` probes it). A source module imports its SDK or HTTP library only
when the source is built or probed, so the ``env`` and ``static`` sources work without
the Volcengine SDK installed and ``esi-sidecar --help`` loads neither."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Iterable
from typing import Any, Optional

from sidecar.host.sources.auto import AUTO
from sidecar.host.sources.base import Source, SourceTraits
from sidecar.host.sources.spec import SourceSpec

__all__ = ["SOURCES", "auto_candidates", "canonical_name", "create_source", "probe_source",
           "source_config", "spec", "specs", "traits_of"]

# name -> the module whose SPEC declares it. A new source: its module and one line here.
SOURCES: dict[str, str] = {
    "volcengine-esi": "sidecar.host.sources.volcengine",
    "volcengine-events": "sidecar.host.sources.volcengine_events",
    "volcengine-spot": "sidecar.host.sources.volcengine_spot",
    "aws": "sidecar.host.sources.aws",
    "aws-capacity-block": "sidecar.host.sources.aws_capacity_block",
    "gcp": "sidecar.host.sources.gcp",
    "azure": "sidecar.host.sources.azure",
    "slurm": "sidecar.host.sources.slurm",
    "env": "sidecar.host.sources.env",
    "static": "sidecar.host.sources.static",
}


@functools.cache
def spec(name: str) -> SourceSpec[Any]:
    """The spec of the source ``name`` (canonical), from its module."""
    declared: SourceSpec[Any] = importlib.import_module(SOURCES[name]).SPEC
    if declared.name != name:
        raise RuntimeError(f"{SOURCES[name]}.SPEC is named {declared.name!r}, not {name!r}")
    return declared


def specs() -> list[SourceSpec[Any]]:
    """Every source's spec, in the registry's order."""
    return [spec(name) for name in SOURCES]


def auto_candidates() -> tuple[str, ...]:
    """The sources ``--source auto`` probes (in parallel; each asks its own service)."""
    return tuple(s.name for s in specs() if s.probe is not None)


def canonical_name(name: str) -> str:
    name = name.strip().lower()
    aliases = {alias: s.name for s in specs() for alias in s.aliases}
    name = aliases.get(name, name)
    if name not in SOURCES and name != AUTO:
        choices = ", ".join([AUTO, *sorted(SOURCES)])
        raise ValueError(f"unknown source {name!r}; choose from {choices}")
    return name


def source_config(chosen: SourceSpec[Any], settings: object) -> Any:
    """The source's typed config from the daemon settings: each field from the Settings
    attribute of its name, else from ``settings.source_options`` (the options of sources
    that Settings does not name), else the option's default."""
    defaults = {option.name: option.default for option in chosen.options}
    extra = getattr(settings, "source_options", None) or {}
    values: dict[str, Any] = {}
    for config_field in dataclasses.fields(chosen.config):
        name = config_field.name
        if hasattr(settings, name):
            values[name] = getattr(settings, name)
        elif name in extra:
            values[name] = extra[name]
        elif name in defaults:
            values[name] = defaults[name]
    return chosen.config(**values)


def create_source(name: str, settings: object) -> Source:
    """Import the chosen source's module and build it from the daemon settings."""
    chosen = spec(canonical_name(name))
    return chosen.build(source_config(chosen, settings))


def probe_source(name: str, settings: object, timeout: float) -> Optional[str]:
    """Ask whether the source's service answers here: None if so, else why not."""
    chosen = spec(canonical_name(name))
    if chosen.probe is None:
        raise ValueError(f"the {chosen.name} source has no probe")
    return chosen.probe(source_config(chosen, settings), timeout)


def traits_of(names: Iterable[str]) -> dict[str, SourceTraits]:
    """name -> traits, for the poller (``auto``'s wrappers carry their source's name)."""
    return {name: spec(canonical_name(name)).traits for name in names}
