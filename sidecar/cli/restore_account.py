"""The account a restore closes: print what the previous machine's release cost, and post
it to the daemon(s) of this one (``POST /v1/reclaims``, docs/protection.md).

The checkpoint restored matters more than its account: a daemon that is not running or
refuses the post costs one line on stderr, never the restore's exit status.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from sidecar.checkpoint.manifest import MANIFEST_NAME
from sidecar.timeparse import TimestampError, format_rfc3339, parse_timestamp
from sidecar.train.daemon_request import daemon_request
from sidecar.train.reclaim_cost import lost_seconds, state_of_manifest

__all__ = ["close_release_account"]


def close_release_account(folder: Path, released_at: str, urls: Sequence[str],
                          timeout: float, restore_seconds: Optional[float] = None) -> None:
    """Print the release's cost from the checkpoint in ``folder``, then post it to each of
    ``urls`` (each says in one line whether it recorded it). ``restore_seconds``: how long
    the restore just done took; with it the daemon also closes the time to resume at the
    job's first step (issue 40, item 3; a checkpoint the daemon's follower brought counts
    its copy instead)."""
    finished = time.time()
    try:
        released = parse_timestamp(released_at).when.timestamp()
        state, step = state_of_manifest(json.loads((folder / MANIFEST_NAME).read_text()))
    except (OSError, ValueError, TimestampError) as exc:
        print(f"esi-sidecar restore: cannot account for the release: {exc}", file=sys.stderr)
        return
    lost = lost_seconds(released, state)
    of_step = "of a checkpoint that names no step" if step is None else f"of step {step}"
    print(f"the release cost {lost:.1f} s of GPU time: from the state {of_step} "
          f"({format_rfc3339(state)}) to the release ({format_rfc3339(released)})",
          flush=True)
    account: dict[str, object] = {"released_unix": released, "state_unix": state,
                                  "resumed_step": step, "checkpoint": folder.name}
    if restore_seconds is not None:
        account["restore_started_unix"] = finished - max(0.0, restore_seconds)
        account["restore_finished_unix"] = finished
    for url in urls:
        _post(url, account, timeout)


def _post(url: str, account: dict[str, object], timeout: float) -> None:
    status, body = daemon_request(url, "POST", account, timeout=timeout, path="/v1/reclaims")
    if status is None:
        print(f"esi-sidecar restore: {url}: no daemon to record the account on ({body}); "
              "the checkpoint is restored", file=sys.stderr)
    elif status in (200, 201):
        recorded: Optional[object] = body.get("recorded") if isinstance(body, dict) else None
        print(f"the account is recorded on {url}" if recorded else
              f"{url} had this release accounted already: not counted again")
    else:
        error = body.get("error") if isinstance(body, dict) else None
        print(f"esi-sidecar restore: {url} refused the account (HTTP {status}): "
              f"{error or body}"[:300], file=sys.stderr)
