"""The status page at ``/``: what the daemon knows, at a glance, for a person.

Server-rendered HTML: the countdown, the sources and their health, the deadline's history,
the job's saves and their durability on a timeline against the release, the current
decision and the uploads. Everything is readable without JavaScript (reload to update);
with it, a few lines inline tick the countdown every second on the daemon's clock (the
offset between the daemon's ``server_time_unix`` and the browser's clock is measured at
each refresh, so a wrong browser clock changes nothing) and fetch the page again every 5 s.
No build step, no CDN, nothing loaded from elsewhere (the host may have no internet): the
Content-Security-Policy allows only the page's own inline script and style, by hash.
Read-only: it links to the JSON endpoints and changes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import time
from collections.abc import Sequence
from typing import Any, Optional

from sidecar.host.features.registry import FEATURES
from sidecar.host.page_parts import ago as _ago
from sidecar.host.page_parts import escape as _e
from sidecar.host.page_parts import event_time as _at
from sidecar.host.page_parts import human_duration
from sidecar.host.page_parts import seconds as _seconds
from sidecar.host.page_parts import when as _when
from sidecar.host.store import DeadlineMove

__all__ = ["CONTENT_SECURITY_POLICY", "render_page"]

REFRESH_SECONDS = 5

_STYLE = """
body{font:15px/1.45 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1b1f24}
main{max-width:60rem;margin:0 auto;padding:.8rem 1rem;overflow-wrap:anywhere}
h1{font-size:1.1rem;margin:.2rem 0}h2{font-size:1rem;margin:1.2rem 0 .3rem}
.light{display:inline-block;padding:.1rem .6rem;border-radius:1rem;color:#fff;font-weight:600}
.ok{background:#1f883d}.starting{background:#9a6700}.degraded{background:#cf222e}
.countdown{font:700 2.4rem/1.1 ui-monospace,monospace;margin:.4rem 0}
.near{color:#cf222e}.muted{color:#57606a}.warn{color:#9a6700}.bad{color:#cf222e}
table{border-collapse:collapse;width:100%;font-size:.9rem;background:#fff}
th,td{text-align:left;padding:.25rem .5rem;border-bottom:1px solid #d0d7de;vertical-align:top}
th{background:#eaeef2}code{font:.85rem ui-monospace,monospace}
svg{width:100%;height:auto;background:#fff;border:1px solid #d0d7de}
.box{background:#fff;border:1px solid #d0d7de;padding:.5rem .8rem}
footer{margin:1.5rem 0;font-size:.85rem}
""".strip()

# The countdown on the daemon's clock, and the refresh; nothing else.
_SCRIPT = """
(function(){
var offset=0;
function read(){var c=document.getElementById('countdown');if(!c)return null;
offset=parseFloat(c.dataset.serverNow)-Date.now()/1000;return c;}
function human(s){s=Math.max(0,Math.floor(s));var h=Math.floor(s/3600),m=Math.floor(s%3600/60),
x=s%60;return (h?h+' h ':'')+((h||m)?(h&&m<10?'0':'')+m+' min ':'')+(x<10&&(h||m)?'0':'')+x+' s';}
function tick(){var c=document.getElementById('countdown');if(!c||!c.dataset.expires)return;
var left=parseFloat(c.dataset.expires)-(Date.now()/1000+offset);
c.textContent=left>0?human(left):'now (passed '+human(-left)+' ago)';
c.className='countdown'+(left<900?' near':'');c.dataset.ticked=1+(+c.dataset.ticked||0);}
function refresh(){fetch('/?fragment=1',{cache:'no-store'}).then(function(r){
if(!r.ok)throw new Error(r.status);return r.text();}).then(function(t){
document.getElementById('page').innerHTML=t;read();tick();
document.getElementById('offline').hidden=true;}).catch(function(){
document.getElementById('offline').hidden=false;});}
read();tick();setInterval(tick,1000);setInterval(refresh,REFRESH_MS);
})();
""".strip().replace("REFRESH_MS", str(REFRESH_SECONDS * 1000))


def _digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_digest(_SCRIPT)}; style-src {_digest(_STYLE)}; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def render_page(
    *,
    expiry: dict[str, Any],
    health: dict[str, Any],
    moves: Sequence[DeadlineMove],
    now: Optional[float] = None,
    fragment: bool = False,
    host: Optional[str] = None,
    **bodies: Optional[dict[str, Any]],
) -> str:
    """The page (or only its ``<main>`` content, ``fragment``) for these bodies: the
    ``/v1/expiry`` and ``/healthz`` answers, and each feature's body by its name (``events``,
    ``uploads``, ...: ``features.Part.page``; a feature left out is shown as off)."""
    now = time.time() if now is None else now
    events, uploads = bodies.get("events"), bodies.get("uploads")
    sections = [
        (10, _header(health, host or socket.gethostname())),
        (20, _countdown(expiry, now)),
        (30, _decision(expiry, events, now)),
        (50, _timeline(expiry, moves, events, uploads, now)),
        (60, _sources(health, now)),
        (70, _moves(moves, now)),
    ]
    sections += [(feature.page.order, feature.page.render(bodies.get(feature.name), now))
                 for feature in FEATURES if feature.page is not None]
    body = "".join(text for _order, text in sorted(sections, key=lambda s: s[0]))
    if fragment:
        return body
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
        f"<title>esi-sidecar: {_e(_headline(expiry, now))}</title>"
        f"<noscript><meta http-equiv=\"refresh\" content=\"{REFRESH_SECONDS * 2}\"></noscript>"
        f"<style>{_STYLE}</style></head><body><main>"
        "<p id=\"offline\" class=\"bad\" hidden>The daemon does not answer: the figures "
        "below are the last it gave.</p>"
        f"<div id=\"page\">{body}</div>"
        "<footer class=\"muted\">Read-only. The same facts as JSON: "
        "<a href=\"/v1/expiry\">/v1/expiry</a>, <a href=\"/healthz\">/healthz</a>, "
        "<a href=\"/v1/events\">/v1/events</a>, <a href=\"/v1/uploads\">/v1/uploads</a>, "
        "<a href=\"/v1/protection\">/v1/protection</a>, "
        "<a href=\"/metrics\">/metrics</a>; the API: <a href=\"/docs\">/docs</a>. In a "
        "terminal: <code>esi-sidecar status --watch</code>.</footer>"
        f"</main><script>{_SCRIPT}</script></body></html>\n"
    )


def _headline(expiry: dict[str, Any], now: float) -> str:
    when = expiry.get("expires_at_unix")
    if when is None:
        return "no release known"
    left = when - now
    return f"release in {human_duration(left)}" if left > 0 else "release time passed"


def _header(health: dict[str, Any], host: str) -> str:
    status = str(health.get("status") or "starting")
    css = status if status in ("ok", "starting", "degraded") else "degraded"
    reason = health.get("reason")
    why = f"<p id=\"reason\" class=\"{'warn' if css == 'starting' else 'bad'}\">{_e(reason)}</p>" \
        if reason else ""
    return (f"<h1>esi-sidecar on {_e(host)} <span id=\"health\" class=\"light {css}\">"
            f"{_e(status)}</span></h1>{why}")


def _countdown(expiry: dict[str, Any], now: float) -> str:
    when = expiry.get("expires_at_unix")
    server_now = expiry.get("server_time_unix") or now
    if when is None:
        return (f"<div id=\"countdown\" class=\"countdown\" data-server-now=\"{server_now}\">"
                "no release known</div><p class=\"muted\">No source knows a deadline for "
                "this machine (not an ESI instance, no notice, or no answer yet).</p>")
    left = when - now
    text = human_duration(left) if left > 0 else f"now (passed {human_duration(-left)} ago)"
    near = " near" if left < 900 else ""
    stale = expiry.get("stale")
    error = expiry.get("error")
    notes = [f"{_e(expiry.get('kind') or 'deadline')} from <b>{_e(expiry.get('source'))}</b> "
             f"at {_when(when)}"]
    if expiry.get("assumed_timezone"):
        notes.append(f"<span class=\"warn\">read in {_e(expiry['assumed_timezone'])} (the "
                     "time had no offset)</span>")
    if stale:
        notes.append(f"<span id=\"stale\" class=\"warn\">stale: {_e(error or 'no fresh poll')}"
                     "</span>")
    elif error:
        notes.append(f"<span class=\"warn\">{_e(error)}</span>")
    return (f"<div>Release in</div><div id=\"countdown\" class=\"countdown{near}\" "
            f"data-expires=\"{when}\" data-server-now=\"{server_now}\">{_e(text)}</div>"
            f"<p>{' · '.join(notes)}</p>")


def _decision(expiry: dict[str, Any], events: Optional[dict[str, Any]], now: float) -> str:
    summary = (events or {}).get("summary") or {}
    if not summary.get("job"):
        return ("<h2>The job</h2><p class=\"muted\" id=\"job\">No training job has reported "
                "to this daemon yet (the guard sends its events here).</p>")
    when = expiry.get("expires_at_unix")
    remaining = None if when is None else when - now
    budget = summary.get("budget_seconds")
    state = summary.get("state") or "training"
    if remaining is not None and budget is not None:
        verdict = ("inside the budget: the next decision saves" if remaining <= budget
                   else f"{human_duration(remaining - budget)} of slack before the save")
        rule = (f"remaining <b>{human_duration(remaining)}</b> vs budget "
                f"<b>{human_duration(budget)}</b> (step "
                f"{_e(_seconds(summary.get('step_seconds')))} + save "
                f"{_e(_seconds(summary.get('save_seconds')))} + margin"
                f"{' + upload' if expiry.get('upload_seconds') else ''}): {verdict}")
    else:
        rule = "no decision reported yet" if budget is None else "no release known"
    last = summary.get("last_save_step")
    saved = ("no checkpoint yet" if last is None else
             f"last checkpoint step {_e(last)} ({_e(summary.get('last_save'))}, "
             f"{_ago(now, summary.get('last_save_at_unix'))}, took "
             f"{_e(_seconds(summary.get('last_save_seconds')))})")
    durable = summary.get("last_durable_step")
    durable_text = ("none durable yet" if durable is None else
                    f"step {_e(durable)} durable {_ago(now, summary.get('last_durable_at_unix'))}")
    return (f"<h2>The job</h2><div class=\"box\" id=\"job\"><b>{_e(summary.get('job'))}</b> "
            f"is <b>{_e(state)}</b> (last heard {_ago(now, summary.get('last_event_at_unix'))})"
            f"<br>{rule}<br>{saved}; {durable_text}</div>")


def _timeline(expiry: dict[str, Any], moves: Sequence[DeadlineMove],
              events: Optional[dict[str, Any]], uploads: Optional[dict[str, Any]],
              now: float) -> str:
    """Saves, durability and deadline moves on one axis, up to the release."""
    release = expiry.get("expires_at_unix")
    saves = [e for e in (events or {}).get("events", ()) if e.get("kind") == "save-finished"]
    durable = [e for e in (events or {}).get("events", ()) if e.get("kind") == "durable"]
    moved = [m for m in moves if m.before_unix is not None]
    times = [now] + [_at(e) for e in saves + durable] + [m.at_unix for m in moved]
    start = min([*times, now - 1800])
    end = max(now + 60, release if release is not None and release < now + 86400 * 7 else now)
    end += (end - start) * 0.04
    width, left, right = 960.0, 10.0, 950.0

    def x(unix: float) -> float:
        return left + (right - left) * (unix - start) / (end - start)

    marks = [f"<line x1=\"{left}\" y1=\"60\" x2=\"{right}\" y2=\"60\" stroke=\"#8c959f\"/>",
             f"<line x1=\"{x(now):.1f}\" y1=\"20\" x2=\"{x(now):.1f}\" y2=\"90\" "
             "stroke=\"#0969da\" stroke-dasharray=\"3 3\"><title>now</title></line>",
             f"<text x=\"{x(now):.1f}\" y=\"14\" font-size=\"12\" text-anchor=\"middle\" "
             "fill=\"#0969da\">now</text>"]
    if release is not None and release <= end:
        marks += [f"<line x1=\"{x(release):.1f}\" y1=\"20\" x2=\"{x(release):.1f}\" y2=\"100\" "
                  f"stroke=\"#cf222e\" stroke-width=\"3\"><title>release {_when(release)}"
                  "</title></line>",
                  f"<text x=\"{x(release):.1f}\" y=\"114\" font-size=\"12\" "
                  "text-anchor=\"middle\" fill=\"#cf222e\">release</text>"]
    for event in saves:
        at = _at(event)
        kind = event.get("save") or "routine"
        colour = {"final": "#1b1f24", "top-up": "#8250df"}.get(kind, "#57606a")
        marks.append(f"<rect class=\"save\" x=\"{x(at) - 4:.1f}\" y=\"48\" width=\"8\" "
                     f"height=\"24\" fill=\"{colour}\"><title>{_e(kind)} save, step "
                     f"{_e(event.get('step'))}, {_seconds(event.get('seconds'))}, "
                     f"{_when(at)}</title></rect>")
    for event in durable:
        at = _at(event)
        marks.append(f"<circle class=\"durable\" cx=\"{x(at):.1f}\" cy=\"36\" r=\"5\" "
                     f"fill=\"#1f883d\"><title>step {_e(event.get('step'))} durable "
                     f"{_when(at)}</title></circle>")
    for move in moved:
        marks.append(f"<path class=\"move\" d=\"M{x(move.at_unix):.1f} 76 l6 8 l-6 8 l-6 -8 z\" "
                     f"fill=\"#9a6700\"><title>{_e(move.source)}: deadline moved from "
                     f"{_when(move.before_unix)} to {_when(move.after_unix)}</title></path>")
    legend = ("<p class=\"muted\">Squares: saves (black final, purple top-up, grey "
              "routine). Green dots: durable. Diamonds: the deadline moved. "
              f"From {_when(start)} to {_when(end)}.</p>")
    return (f"<h2>Timeline</h2><svg id=\"timeline\" viewBox=\"0 0 {width:.0f} 120\" "
            f"role=\"img\" aria-label=\"saves and the release\">{''.join(marks)}</svg>{legend}")


def _sources(health: dict[str, Any], now: float) -> str:
    rows = []
    for name, info in (health.get("sources") or {}).items():
        error = info.get("error")
        age = info.get("last_success_age_seconds")
        state = ("restored" if info.get("restored") else
                 "error" if error else "ok" if age is not None else "waiting")
        css = {"ok": "", "error": "bad", "restored": "warn", "waiting": "muted"}[state]
        last = "never" if age is None else f"{human_duration(age)} ago"
        rows.append(f"<tr class=\"source\" data-state=\"{state}\"><td>{_e(name)}</td>"
                    f"<td class=\"{css}\">{state}</td><td>{last}</td><td>{_e(error)}</td></tr>")
    for name, why in (health.get("skipped") or {}).items():
        rows.append(f"<tr class=\"source muted\" data-state=\"absent\"><td>{_e(name)}</td>"
                    f"<td>not here</td><td>—</td><td>{_e(why)}</td></tr>")
    return ("<h2>Sources</h2><table id=\"sources\"><tr><th>source</th><th>state</th>"
            "<th>last good answer</th><th>error</th></tr>" + "".join(rows) + "</table>")


def _moves(moves: Sequence[DeadlineMove], now: float) -> str:
    if not moves:
        return ""
    rows = []
    for move in reversed(moves[-20:]):
        if move.before_unix is None:
            change = f"learned: {_when(move.after_unix)}"
        elif move.after_unix is None:
            change = f"gone (was {_when(move.before_unix)})"
        else:
            delta = move.after_unix - move.before_unix
            way = "later" if delta > 0 else "earlier"
            change = (f"{_when(move.before_unix)} → {_when(move.after_unix)} "
                      f"({human_duration(abs(delta))} {way})")
        rows.append(f"<tr><td>{_ago(now, move.at_unix)}</td><td>{_e(move.source)}</td>"
                    f"<td>{change}</td></tr>")
    return ("<h2>Deadline history</h2><table id=\"moves\"><tr><th>when</th><th>source</th>"
            "<th>deadline</th></tr>" + "".join(rows) + "</table>")


