"""What the fire-drill tests share: start a drill on a real daemon, wait for the job and
the verdict, and a script that starts one from inside a training loop and says when the
loop may end (a few steps after the verdict: training went on past the drill)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Optional

from daemon_harness import get_json, wait_for

__all__ = ["DrillScript", "job_heard", "start_drill", "verdict"]


def start_drill(url: str, seconds: float) -> dict[str, Any]:
    request = urllib.request.Request(url + "/v1/drill", method="POST",
                                     data=json.dumps({"in_seconds": seconds}).encode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        with exc:
            raise AssertionError(exc.read().decode()) from None


def job_heard(url: str) -> bool:
    return bool(get_json(url + "/v1/events?limit=0")[1]["jobs"])


def verdict(url: str, drill_id: str) -> Any:
    drills = get_json(url + "/v1/drill")[1]["drills"]
    return next((d for d in drills if d["id"] == drill_id and d["result"]), None)


class DrillScript:
    """Called at every step of a training loop (:meth:`at_step`): at ``start_step`` it
    waits for the daemons to hear the job and starts a drill ``lead`` seconds ahead on each
    of ``urls``; once every daemon has its verdict, the loop may end ``steps_after`` steps
    later. Asks the daemons at most every 0.2 s, so the loop keeps its pace."""

    def __init__(self, *urls: str, lead: float = 3.0, start_step: int = 3,
                 steps_after: int = 10) -> None:
        self.urls, self.lead = urls, lead
        self.start_step, self.steps_after = start_step, steps_after
        self.drills: list[dict[str, Any]] = []
        self.verdicts: list[Any] = []
        self.end_step: Optional[int] = None
        self._next_ask = 0.0

    def at_step(self, step: int) -> bool:
        """Whether the loop may end now."""
        if not self.drills and step >= self.start_step:
            for url in self.urls:
                wait_for(lambda url=url: job_heard(url), timeout=30, interval=0.05)
            self.drills = [start_drill(url, self.lead) for url in self.urls]
        elif self.drills and self.end_step is None and time.monotonic() >= self._next_ask:
            self._next_ask = time.monotonic() + 0.2
            found = [verdict(url, d["id"]) for url, d in zip(self.urls, self.drills)]
            if all(found):
                self.verdicts, self.end_step = found, step + self.steps_after
        return self.end_step is not None and step >= self.end_step

    def passed(self) -> bool:
        return bool(self.verdicts) and all(v["verdict"] == "PASS" for v in self.verdicts)
