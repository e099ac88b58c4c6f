"""Container health check: exit 0 when the daemon's /healthz answers 200, else 1.

The image's HEALTHCHECK runs it (python:3.11-slim has no curl). It asks the first
address of ESI_SIDECAR_LISTEN, so a changed listen address or port needs no new image;
a wildcard address (0.0.0.0, ::) is asked on loopback. Standard library only.
"""

from __future__ import annotations

import os
import sys
import urllib.request

DEFAULT_LISTEN = "127.0.0.1:8791"


def healthz_url(listen: str) -> str:
    first = listen.split(",")[0].strip() or DEFAULT_LISTEN
    host, _, port = first.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def main() -> int:
    url = healthz_url(os.environ.get("ESI_SIDECAR_LISTEN") or DEFAULT_LISTEN)
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except Exception as exc:  # 503 (starting, degraded) and refused connections alike
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
