"""Write deploy/esi-sidecar.env.example (or the settings table of docs/deploy.md) from
``sidecar.host.settings.OPTIONS``, the one table of daemon settings, so the two cannot drift.

    python deploy/make_env_example.py > deploy/esi-sidecar.env.example
    python deploy/make_env_example.py --markdown      # the table in docs/deploy.md

tests/e2e/test_deploy.py fails when the committed example differs from this output.
"""

from __future__ import annotations

import sys
import textwrap

from sidecar.host.settings import OPTIONS, Option

# A value worth showing for the settings whose metavar says little; the rest show it.
EXAMPLES = {
    "listen": "127.0.0.1:8791,172.17.0.1:8791",
    "source": "volcengine-esi",
    "instance_id": "i-ybxxxxxxxxxxxxxxxxxx",
    "scheduled_instance_id": "esi-xxxxxxxxxxxxxxxx",
    "region": "cn-beijing",
    "api_endpoint": "http://127.0.0.1:9000",
    "metadata_url": "http://100.96.0.96",
    "poll_interval": "30",
    "stale_after": "90",
    "state_file": "/var/lib/esi-sidecar/state.json",
    "log_level": "INFO",
    "expires_at": "2030-01-01T00:00:00Z",
    "timezone": "Asia/Shanghai",
    "upload_from": "/mnt/ckpt/run-42",
    "upload_to": "s3://my-bucket/run-42/node-0",
    "upload_endpoint": "https://tos-s3-cn-beijing.volces.com",
    "upload_region": "cn-beijing",
    "upload_access_key": "AKLT...",
    "upload_secret_key": "...",
    "upload_concurrency": "8",
    "upload_part_size": "64MiB",
    "upload_keep_local": "2",
    "upload_near_release": "600",
    "upload_scan_interval": "5",
    "upload_max_bandwidth": "200MiB",
    "upload_addressing_style": "auto",
}

HEADER = """\
# /etc/esi-sidecar/esi-sidecar.env - settings of `esi-sidecar serve` under systemd
# (EnvironmentFile= in esi-sidecar.service). It holds credentials: keep it mode 0600,
# owned by root (systemd reads it before it drops privileges).
#
# Format: NAME=VALUE, one per line, no `export`; quote a value with spaces in "...".
# An unset or empty variable means the default. A flag given to `esi-sidecar serve`
# wins over its variable. After a change: systemctl restart esi-sidecar
#
# Generated from sidecar.host.settings.OPTIONS by deploy/make_env_example.py: do not edit.

# --- credentials: the Volcengine SDK's chain. Leave all three unset to use the
# instance's role. Never logged, served or written to the state file.
#VOLCENGINE_ACCESS_KEY=AKLT...
#VOLCENGINE_SECRET_KEY=...
#VOLCENGINE_SESSION_TOKEN=
"""


def _help(option: Option) -> str:
    return option.help.replace("%%", "%")  # argparse's escape


def env_example() -> str:
    parts = [HEADER]
    for option in OPTIONS:
        name = "(no flag)" if option.env_only else option.flag
        lines = textwrap.wrap(f"{name}: {_help(option)}", width=86, break_on_hyphens=False)
        parts.append("\n" + "".join(f"# {line}\n" for line in lines))
        parts.append(f"#{option.env}={EXAMPLES.get(option.name, option.metavar)}\n")
    return "".join(parts)


def markdown_table() -> str:
    rows = ["| variable | flag | meaning |", "|---|---|---|"]
    for option in OPTIONS:
        meaning = _help(option).replace("|", "\\|")
        flag = "(environment only)" if option.env_only else f"`{option.flag}`"
        rows.append(f"| `{option.env}` | {flag} | {meaning} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    sys.stdout.write(markdown_table() if "--markdown" in argv else env_example())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
