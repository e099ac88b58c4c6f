from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.host.settings import OPTIONS, ConfigError, Settings, load_settings


def test_defaults() -> None:
    settings = load_settings({}, environ={})
    assert settings == Settings()
    assert settings.listen == (("127.0.0.1", 8791),)
    assert settings.sources == ("auto",)
    assert settings.metadata_url == "http://100.96.0.96"
    assert settings.effective_stale_after == 90.0
    assert settings.naive_timezone is None  # each source's own zone (issue 13)
    assert settings.state_file is None


def test_every_option_has_a_flag_and_a_variable() -> None:
    names = {option.env for option in OPTIONS}
    for expected in ("LISTEN", "SOURCE", "INSTANCE_ID", "SCHEDULED_INSTANCE_ID", "REGION",
                     "API_ENDPOINT", "METADATA_URL", "POLL_INTERVAL", "STALE_AFTER",
                     "STATE_FILE", "LOG_LEVEL"):
        assert f"ESI_SIDECAR_{expected}" in names


def test_flag_wins_over_environment_which_wins_over_default() -> None:
    env = {"ESI_SIDECAR_POLL_INTERVAL": "10", "ESI_SIDECAR_REGION": "cn-shanghai"}
    settings = load_settings({"poll_interval": "5"}, environ=env)
    assert settings.poll_interval == 5.0
    assert settings.region == "cn-shanghai"
    assert settings.effective_stale_after == 15.0


def test_several_listen_addresses_comma_separated_or_repeated() -> None:
    env = {"ESI_SIDECAR_LISTEN": "127.0.0.1:8791, 172.17.0.1:8791", "ESI_SIDECAR_TOKEN": TOKEN}
    assert load_settings({}, environ=env).listen == (("127.0.0.1", 8791), ("172.17.0.1", 8791))
    given = {"listen": ["127.0.0.1:1", "[::1]:2"]}
    assert load_settings(given, environ={}).listen == (("127.0.0.1", 1), ("::1", 2))


TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("listen", ["0.0.0.0:8791", "[::]:8791", "127.0.0.1:1,172.17.0.1:8791",
                                    "10.0.0.5:8791", "my-host:8791"])
def test_listening_beyond_loopback_needs_a_token(listen: str) -> None:
    with pytest.raises(ConfigError, match=r"is beyond loopback.*ESI_SIDECAR_TOKEN") as caught:
        load_settings({}, environ={"ESI_SIDECAR_LISTEN": listen})
    assert "\n" not in str(caught.value)
    settings = load_settings({}, environ={"ESI_SIDECAR_LISTEN": listen, "ESI_SIDECAR_TOKEN": TOKEN})
    assert settings.token == TOKEN
    assert TOKEN not in repr(settings)  # never printed


@pytest.mark.parametrize("listen", ["127.0.0.1:8791", "127.0.0.2:1", "[::1]:2", "localhost:3"])
def test_loopback_needs_no_token(listen: str) -> None:
    assert load_settings({}, environ={"ESI_SIDECAR_LISTEN": listen}).token is None


@pytest.mark.parametrize(("token", "why"), [
    ("short", "16 to 4096 characters, this one 5"),
    ("0123456789abcdef 0123", "printable ASCII without spaces"),
    ("0123456789abcdef\u00e9", "printable ASCII without spaces"),
])
def test_a_bad_token_is_refused_without_showing_it(token: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as caught:
        load_settings({}, environ={"ESI_SIDECAR_TOKEN": token})
    assert token not in str(caught.value) and "(hidden)" in str(caught.value)


def test_the_token_file_must_be_private_and_hold_a_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o640)
    with pytest.raises(ConfigError, match=r"readable or writable by others \(mode 0640\)"):
        load_settings({"token_file": str(path)}, environ={})
    path.chmod(0o600)
    assert load_settings({"token_file": str(path)}, environ={}).token == TOKEN
    path.write_text("")
    with pytest.raises(ConfigError, match=r"--token-file.*this one 0"):
        load_settings({"token_file": str(path)}, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({"token_file": str(tmp_path / "missing")}, environ={})
    with pytest.raises(ConfigError, match="not both"):
        load_settings({"token_file": str(path)}, environ={"ESI_SIDECAR_TOKEN": TOKEN})


def test_sources_canonical_and_deduplicated() -> None:
    env = {"ESI_SIDECAR_SOURCE": "volcengine,env,volcengine-esi"}
    assert load_settings({}, environ=env).sources == ("volcengine-esi", "env")


def test_empty_variable_means_unset() -> None:
    assert load_settings({}, environ={"ESI_SIDECAR_REGION": ""}).region is None


def test_state_file_defaults_to_systemd_state_directory() -> None:
    settings = load_settings({}, environ={"STATE_DIRECTORY": "/var/lib/esi-sidecar"})
    assert settings.state_file == Path("/var/lib/esi-sidecar/state.json")


def test_time_zone_names_and_offsets() -> None:
    assert str(load_settings({"timezone": "Asia/Shanghai"}, environ={}).naive_timezone) == (
        "Asia/Shanghai"
    )
    offset = load_settings({"timezone": "+08:00"}, environ={}).naive_timezone
    assert offset.utcoffset(None).total_seconds() == 8 * 3600  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("given", "environ", "fragment"),
    [
        ({"poll_interval": "soon"}, {}, "--poll-interval value 'soon'"),
        ({"poll_interval": "-1"}, {}, "--poll-interval"),
        ({}, {"ESI_SIDECAR_POLL_INTERVAL": "0"}, "ESI_SIDECAR_POLL_INTERVAL value '0'"),
        ({"listen": ["localhost"]}, {}, "--listen value 'localhost'"),
        ({"listen": ["127.0.0.1:99999"]}, {}, "port out of range"),
        ({"source": ["oracle-cloud"]}, {}, "unknown source 'oracle-cloud'"),
        ({"api_endpoint": "127.0.0.1:9000"}, {}, "http://"),
        ({"log_level": "loud"}, {}, "--log-level"),
        ({"timezone": "Mars/Olympus"}, {}, "--timezone"),
        ({"source": ["static"], "expires_at": "soon"}, {}, "--expires-at value 'soon'"),
        ({"source": ["static"]}, {}, "--expires-at"),
        ({"poll_interval": "60", "stale_after": "10"}, {}, "--stale-after"),
        ({"poll_interval": "60", "stale_after": "65"}, {}, "at least 1.2 x"),
        ({"listen": ["127.0.0.1:abc"]}, {}, "the port must be a number"),
    ],
)
def test_bad_values_stop_with_one_line_naming_the_setting(
    given: dict, environ: dict, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(given, environ=environ)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_serve_with_a_bad_value_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "serve", "--poll-interval", "never"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--poll-interval value 'never'" in result.stderr


@pytest.mark.parametrize(
    ("given", "environ", "fragment"),
    [
        # ~20 API calls a second: stopped, naming the option, the value and the bound.
        ({"poll_interval": "0.001"}, {}, "invalid --poll-interval value '0.001'"),
        ({"poll_interval": "0.001"}, {}, "must be at least 5 s"),
        ({"poll_interval": "4.9", "source": ["volcengine-esi"]}, {}, "at least 5 s"),
        ({"source": ["volcengine-events"]}, {"ESI_SIDECAR_POLL_INTERVAL": "1"},
         "invalid ESI_SIDECAR_POLL_INTERVAL value '1'"),
        # A named (non-loopback) endpoint is still the cloud's.
        ({"poll_interval": "1", "api_endpoint": "https://open.volcengineapi.com"}, {},
         "at least 5 s"),
        # Sources that call no API are bounded only against busy-looping.
        ({"poll_interval": "0.01", "source": ["env"]}, {}, "at least 0.1 s"),
        ({"poll_interval": "0.05", "api_endpoint": "http://127.0.0.1:9000"}, {}, "at least 0.1 s"),
    ],
)
def test_poll_interval_has_a_lower_bound(given: dict, environ: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(given, environ=environ)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "given",
    [
        {"poll_interval": "5"},  # the bound itself, against the cloud API
        {"poll_interval": "0.2", "api_endpoint": "http://127.0.0.1:9000"},  # the emulator
        {"poll_interval": "0.2", "api_endpoint": "http://[::1]:9000", "source": ["volcengine-esi"]},
        {"poll_interval": "0.2", "source": ["env"]},
        {"poll_interval": "0.1", "source": ["aws", "gcp", "azure", "static"],
         "expires_at": "2030-01-01T00:00:00Z"},
    ],
)
def test_poll_interval_bound_allows_the_emulator_and_local_sources(given: dict) -> None:
    assert load_settings(given, environ={}).poll_interval == float(given["poll_interval"])


def test_the_metadata_sources_keep_their_own_cadence_under_the_bound() -> None:
    # aws every 2 s, azure every 1 s, gcp between long polls: below the API bound, and
    # their own, whatever --poll-interval says (the poller uses poll_interval_seconds).
    from sidecar.host.sources.registry import create_source

    settings = load_settings({"source": ["aws", "gcp", "azure"], "poll_interval": "30"},
                             environ={})
    cadence = {name: create_source(name, settings).poll_interval_seconds  # type: ignore[attr-defined]
               for name in settings.sources}
    assert cadence == {"aws": 2.0, "gcp": 1.0, "azure": 1.0}


def test_a_static_deadline_without_an_offset_needs_a_time_zone() -> None:
    # The operator's own input: refused at start-up rather than guessed, unless
    # --timezone says which zone it is in.
    given = {"source": ["static"], "expires_at": "2030-01-01 08:00"}
    with pytest.raises(ConfigError) as info:
        load_settings(given, environ={})
    assert "--expires-at" in str(info.value) and "--timezone" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_settings({}, environ={"ESI_SIDECAR_SOURCE": "static",
                                   "ESI_SIDECAR_EXPIRES_AT": "2030-01-01 08:00"})
    assert "ESI_SIDECAR_EXPIRES_AT" in str(info.value)
    settings = load_settings({**given, "timezone": "Asia/Shanghai"}, environ={})
    from sidecar.host.sources.registry import create_source

    observation = create_source("static", settings).poll()
    assert observation.expires_at_unix == 1893456000.0
    assert observation.assumed_timezone == "Asia/Shanghai"


def test_serve_help_lists_the_settings_by_topic() -> None:
    """``serve --help`` was 173 lines with no headings (issue 39, item 10): every row of the
    table has a group, a source's rows its spec's, and --help lists each under its heading
    with a short usage line."""
    import argparse

    from sidecar.cli import build_parser
    from sidecar.host.sources import registry

    assert all(option.group for option in OPTIONS)
    for spec in registry.specs():
        for option in spec.options:
            (row,) = [row for row in OPTIONS if row.name == option.name]
            assert row.group == spec.settings_group
    parser = build_parser()
    serve = next(action for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)).choices["serve"]
    headings = {group.title: [action.dest for action in group._group_actions]
                for group in serve._action_groups}
    upload = "checkpoint upload (docs/upload.md; s3:// needs the [upload] extra)"
    assert "upload_to" in headings[upload]
    assert "listen" in headings["listening and access"]
    assert "aws_imds_url" in headings["the aws source"]
    assert "poll_interval" in headings["polling"]
    assert headings["options"] == ["help"]  # nothing left ungrouped
    shown = serve.format_help()
    assert shown.splitlines()[0] == "usage: esi-sidecar serve [-h] [--SETTING VALUE ...]"


@pytest.mark.parametrize("given", ["2020-01-01T00:00:00Z", "now"])
def test_a_static_deadline_already_past_stops_start_up_naming_the_setting(given: str) -> None:
    """Issue 39: ``serve --source static --expires-at <past>`` only warned, then served a
    release that had come."""
    import time

    raw = str(int(time.time()) - 1) if given == "now" else given
    with pytest.raises(ConfigError) as info:
        load_settings({"source": ["static"], "expires_at": raw}, {})
    assert str(info.value).startswith(f"invalid --expires-at value {raw!r}: it passed ")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="ESI_SIDECAR_EXPIRES_AT"):
        load_settings({}, {"ESI_SIDECAR_SOURCE": "static", "ESI_SIDECAR_EXPIRES_AT": raw})
    future = load_settings({"source": ["static"], "expires_at": str(int(time.time()) + 60)}, {})
    assert future.expires_at is not None
