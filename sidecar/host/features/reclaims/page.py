"""What each release cost, on the status page: a bar per release, and the time to resume."""

from __future__ import annotations

from typing import Any, Optional

from sidecar.host.page_parts import escape as _e
from sidecar.host.page_parts import human_duration
from sidecar.host.page_parts import seconds as _seconds

__all__ = ["reclaims_section"]


def reclaims_section(reclaims: Optional[dict[str, Any]]) -> str:
    """A bar per release, newest right: the GPU time it cost, its idle and redone parts."""
    costs = list(reversed((reclaims or {}).get("reclaims") or []))[-20:]
    if not costs:
        return ""
    tallest = max(1.0, *(float(c.get("lost_seconds") or 0) for c in costs))
    bars = []
    for index, cost in enumerate(costs):
        lost = float(cost.get("lost_seconds") or 0)
        x, height = 10 + index * 46, 90 * lost / tallest
        parts = [("lost", lost, "#8c959f"), ("redone", float(cost.get("redone_seconds") or 0),
                 "#cf222e"), ("idle", float(cost.get("idle_seconds") or 0), "#9a6700")]
        for name, seconds, colour in parts:
            tall = 90 * min(seconds, lost) / tallest
            width = 36 if name == "lost" else 16
            offset = 0 if name == "lost" else (2 if name == "redone" else 18)
            bars.append(f"<rect class=\"{name}\" x=\"{x + offset}\" y=\"{100 - tall:.1f}\" "
                        f"width=\"{width}\" height=\"{tall:.1f}\" fill=\"{colour}\"><title>"
                        f"step {_e(cost.get('resumed_step'))}: {human_duration(seconds)} "
                        f"{name}</title></rect>")
        bars.append(f"<text x=\"{x + 18}\" y=\"{max(10.0, 96 - height):.0f}\" font-size=\"10\" "
                    f"text-anchor=\"middle\">{_e(human_duration(lost))}</text>")
    ratio = (reclaims or {}).get("effective_ratio")
    effective = "" if ratio is None else f"; effective training time {100 * ratio:.0f} %"
    return (f"<h2>What each release cost</h2><svg id=\"reclaims\" viewBox=\"0 0 "
            f"{20 + 46 * len(costs)} 110\" role=\"img\" aria-label=\"GPU time each release "
            f"cost\">{''.join(bars)}</svg><p class=\"muted\">Grey: GPU time lost; red: of it "
            f"redone; amber: idle. {_e(reclaims and reclaims.get('count'))} release(s)"
            f"{effective}.</p>{_resume(costs)}")


def _resume(costs: list[dict[str, Any]]) -> str:
    """The newest release's time to resume on the next machine, split (issue 40)."""
    closed = [c for c in costs if c.get("resume_seconds") is not None]
    if not closed:
        return ""
    last = closed[-1]
    split = ", ".join(f"{label} {_seconds(last.get(key))}" for label, key in (
        ("waiting for a machine", "waiting_seconds"), ("restore", "restore_seconds"),
        ("start-up", "startup_seconds")))
    return (f"<p id=\"resume\">Step {_e(last.get('resumed_step'))}: training again "
            f"{_e(human_duration(float(last['resume_seconds'])))} after the release "
            f"({_e(split)}).</p>")
