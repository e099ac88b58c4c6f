"""What a source module declares about itself, in one ``SPEC``: its name and aliases, its
rows of the settings table, the typed config it is built from, and its traits.

The registry (``sidecar.host.sources.registry``) maps names to modules; ``auto``, the
settings table and the poller read the specs, so a new source is one module and one
registry line. A source module stays cheap to import (its SDK or HTTP library is
imported when the source is built or probed): the settings table reads every spec when
the command line is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Optional, TypeVar

from sidecar.host.sources.base import Source, SourceTraits
from sidecar.models import DEADLINE_MACHINE, DEADLINE_PROCESS

__all__ = ["ENV_PREFIX", "Option", "SourceSpec", "SourceTraits", "parse_boolean", "parse_text",
           "parse_url"]

ENV_PREFIX = "ESI_SIDECAR_"
C = TypeVar("C")


@dataclass(frozen=True)
class Option:
    """One row of the settings table: the flag, the ``ESI_SIDECAR_*`` variable, the parser,
    the default and the help line all come from it, so they cannot drift apart."""

    name: str  # attribute of Settings, or a key of Settings.source_options
    parse: Callable[[str], Any]
    help: str
    metavar: str = "VALUE"
    repeatable: bool = False
    env_only: bool = False  # secrets: a flag would show in `ps` and shell history
    # The heading it is listed under in --help (a source's rows: its spec's settings_group).
    group: str = ""
    # The value when neither flag nor variable is given, for an option that is not a field
    # of Settings (the fields' defaults are Settings()'s, never copied).
    default: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


@dataclass(frozen=True)
class SourceSpec(Generic[C]):
    """A source, as its module declares it. ``config`` is a frozen dataclass whose fields
    are named like the settings they take (a Settings attribute or one of ``options``);
    the registry builds it and hands it to ``build`` and ``probe``."""

    name: str
    config: type[C]
    build: Callable[[C], Source]
    summary: str = ""  # a few words for --source's help, e.g. "the ESI release"
    aliases: tuple[str, ...] = ()
    options: tuple[Option, ...] = ()
    traits: SourceTraits = field(default_factory=SourceTraits)
    # --source auto runs the source when this finds its service (None: auto leaves it out):
    # None when it answers, else why not, in one line; never raises.
    probe: Optional[Callable[[C, float], Optional[str]]] = None
    # How long before the machine goes this platform warns: the shortest notice it gives
    # (None: the time is known far ahead, as an ESI release). The protection verdict holds
    # the job's step + save + upload against it (sidecar.host.features.protection.board); --notice
    # overrides it per source.
    notice_seconds: Optional[float] = None
    # The --help heading of its options (default: "the NAME source").
    group: str = ""
    # Whose end its deadline is, served as ``deadline_kind`` (sidecar.models.Expiry):
    # "machine" (a release or reclaim) or "process" (a Slurm time limit, an environment's).
    deadline_kind: str = DEADLINE_MACHINE

    def __post_init__(self) -> None:
        if self.deadline_kind not in (DEADLINE_MACHINE, DEADLINE_PROCESS):
            raise ValueError(f"{self.name}: deadline_kind must be machine or process")

    @property
    def settings_group(self) -> str:
        return self.group or f"the {self.name} source"


# ---------------------------------------------------------------- value parsers


def parse_boolean(value: str) -> bool:
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def parse_text(value: str) -> str:
    value = value.strip()
    if not value:
        raise ValueError("is empty")
    return value


def parse_url(value: str) -> str:
    value = value.strip().rstrip("/")
    if not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    return value
