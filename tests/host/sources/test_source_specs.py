"""Each source declares itself in its module's SPEC (sidecar.host.sources.spec): the
registry, auto, the settings table and the poller read the specs, so a new source is one
module and one registry line (issue 21, item 5)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sidecar.host.settings import OPTIONS, Settings
from sidecar.host.sources import registry
from sidecar.host.sources.auto import AUTO

REPO = Path(__file__).resolve().parents[3]


def test_every_registry_entry_declares_a_consistent_spec() -> None:
    rows = {option.name for option in OPTIONS}
    aliases: list[str] = []
    for name in registry.SOURCES:
        spec = registry.spec(name)
        assert spec.name == name
        aliases.extend(spec.aliases)
        for option in spec.options:
            assert option.name in rows, f"{name}: {option.name} is not in the settings table"
        own = {option.name for option in spec.options}
        for config_field in dataclasses.fields(spec.config):
            # A config field is a setting: a Settings attribute or one of the spec's rows.
            assert config_field.name in own or hasattr(Settings(), config_field.name), (
                f"{name}: config field {config_field.name} is no setting")
        assert dataclasses.is_dataclass(spec.config)
        assert spec.config.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert registry.canonical_name(name) == name
    assert len(aliases) == len(set(aliases)) and not set(aliases) & set(registry.SOURCES)
    assert AUTO not in registry.SOURCES
    assert len(rows) == len(OPTIONS)  # no row twice


def test_the_specs_say_what_the_name_sets_said() -> None:
    traits = registry.traits_of(registry.SOURCES)
    assert {n for n, t in traits.items() if t.adaptive} == {"volcengine-esi",
                                                            "aws-capacity-block", "slurm"}
    assert {n for n, t in traits.items() if t.api_budget} == {"volcengine-esi",
                                                              "volcengine-events",
                                                              "aws-capacity-block"}
    assert {n: t.poll_interval_seconds for n, t in traits.items() if t.poll_interval_seconds} \
        == {"aws": 2.0, "gcp": 1.0, "azure": 1.0, "volcengine-spot": 1.8,
                                                          "slurm": 60.0}
    assert registry.auto_candidates() == ("volcengine-esi", "volcengine-events",
                                          "volcengine-spot", "aws", "aws-capacity-block", "gcp",
                                          "azure", "slurm")


def _run(code: str, *, path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(path)])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_help_loads_no_sdk_nor_http_library(tmp_path: Path) -> None:
    # The settings table reads every spec, so a source module imports its SDK (and
    # urllib3) only when the source is built or probed.
    out = _run("""
        import contextlib, io, sys
        from sidecar import cli
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            cli.main(["serve", "--help"])
        heavy = ("urllib3", "volcenginesdkcore", "volcenginesdkecs", "boto3", "fastapi")
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
    """, path=tmp_path)
    assert out.strip() == "[]"


# A source the next issue may add: the Volcengine spot notice from the instance metadata
# (`{metadata-url}/latest/spot_instance_termination_time`), with one option of its own.
NEW_SOURCE = '''
"""A spot instance's termination time, from the ECS metadata service (a test's source)."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.spec import Option, SourceSpec, SourceTraits, parse_url
from sidecar.models import KIND_PREEMPTION
from sidecar.timeparse import parse_timestamp

PATH = "/latest/spot_instance_termination_time"


@dataclass(frozen=True)
class SpotConfig:
    metadata_url: str
    spot_metadata_url: Optional[str]


class SpotSource:
    name = "volcengine-spot"

    def __init__(self, url: str) -> None:
        self._url = url

    def poll(self) -> Observation:
        try:
            with urllib.request.urlopen(self._url, timeout=2) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return Observation(expires_at_unix=None)
            raise SourceError(f"HTTP {exc.code}") from None
        return Observation(expires_at_unix=parse_timestamp(text).unix, kind=KIND_PREEMPTION)


def _url(config: SpotConfig) -> str:
    return (config.spot_metadata_url or config.metadata_url) + PATH


def build(config: SpotConfig) -> SpotSource:
    return SpotSource(_url(config))


def probe(config: SpotConfig, timeout: float) -> Optional[str]:
    return None


SPEC = SourceSpec(
    name="volcengine-spot", config=SpotConfig, build=build, probe=probe,
    summary="the spot notice", aliases=("spot",),
    traits=SourceTraits(poll_interval_seconds=2.0),
    options=(Option("spot_metadata_url", parse_url, "metadata service for the spot notice "
                    "(default: --metadata-url)", "URL"),),
)
'''


@pytest.fixture
def spot_metadata() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"2030-01-01T00:00:00Z"
            code = 200 if self.path == "/latest/spot_instance_termination_time" else 404
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_new_source_is_one_module_and_one_registry_line(
    tmp_path: Path, spot_metadata: str,
) -> None:
    (tmp_path / "spot_source.py").write_text(NEW_SOURCE)
    out = _run(f"""
        import argparse, json
        from sidecar.host.sources import registry
        registry.SOURCES.pop("volcengine-spot")  # the real one: this test's takes its name
        registry.SOURCES["volcengine-spot"] = "spot_source"  # the one registry line

        from sidecar.host import settings as table
        from sidecar.host.daemon import build_sources
        from sidecar.host.sources.auto import ProbedSource

        parser = argparse.ArgumentParser()
        table.add_arguments(parser)
        helped = " ".join(parser.format_help().split())
        given = table.load_settings(
            {{"source": ["spot,auto"]}},
            environ={{"ESI_SIDECAR_SPOT_METADATA_URL": "{spot_metadata}",
                      "ESI_SIDECAR_METADATA_URL": "http://127.0.0.1:1"}})
        named = registry.create_source("spot", given)
        wrapped = build_sources(table.load_settings({{}}, environ={{
            "ESI_SIDECAR_SPOT_METADATA_URL": "{spot_metadata}"}}))
        print(json.dumps({{
            "flag": "--spot-metadata-url" in helped,
            "variable": "ESI_SIDECAR_SPOT_METADATA_URL" in helped,
            "listed": "volcengine-spot (the spot notice)" in helped,
            "rows": [o.name for o in table.OPTIONS],
            "sources": list(given.sources),
            "option": given.source_options,
            "deadline": named.poll().expires_at_unix,
            "auto": [s.name for s in wrapped if isinstance(s, ProbedSource)],
            "probed": [s.poll().expires_at_unix for s in wrapped if s.name == "volcengine-spot"],
            "traits": registry.traits_of(["spot"])["spot"].poll_interval_seconds,
        }}))
    """, path=tmp_path)
    seen = json.loads(out)
    assert seen["flag"] and seen["variable"] and seen["listed"]
    rows = seen["rows"]  # after the other sources' rows, before the upload's
    assert rows.index("spot_metadata_url") == rows.index("slurm_node") + 1
    assert seen["sources"] == ["volcengine-spot", "auto"]
    assert seen["option"] == {"spot_metadata_url": spot_metadata}
    assert seen["deadline"] == 1893456000.0
    assert "volcengine-spot" in seen["auto"] and seen["probed"] == [1893456000.0]
    assert seen["traits"] == 2.0
