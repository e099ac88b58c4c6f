"""``esi-sidecar demo``: the whole story on an emulated ESI release, in about a minute.

1. The Volcengine emulator starts with a release ``--lead`` seconds ahead.
2. The real daemon (``esi-sidecar serve``, a subprocess) polls it through the real SDK and
   uploads every complete checkpoint from the machine's local disk to a folder standing
   for a network volume, capped at ``--upload-bandwidth``.
3. A real training process (:mod:`sidecar.tools.demo.trainer`) trains with a
   CheckpointGuard. Its final save comes early enough for the upload too (the daemon
   measured the upload of the routine checkpoint made at the start), and it waits.
4. At the release the machine is reclaimed: the trainer gets SIGKILL and the local disk
   is wiped.
5. On the "next machine" ``esi-sidecar restore`` brings the newest durable checkpoint
   back from the volume, and the trainer resumes from it and finishes. The summary says
   when the final checkpoint became durable and counts the steps lost.

Time constants are scaled down so the story fits in a minute (the save rule's defaults
are 60 s save and 120 s margin; here 3 s and 5 s, with 0.5 s steps).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

from sidecar.checkpoint.folders import latest_valid
from sidecar.timeparse import parse_timestamp

__all__ = ["add_demo_command", "run_demo", "wipe_local_disk"]

LOCAL_DISK = "local-disk"  # the machine's NVMe: gone at the release
NETWORK_VOLUME = "network-volume"  # stands for vePFS / NAS: outlives the machine
ACCESS_KEY = "AKLTDEMO0000000000000"
SECRET_KEY = "demo-secret-key"


@dataclass
class Run:
    """What one trainer process reported."""

    process: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    last_step: Optional[int] = None
    first_step: Optional[int] = None
    resumed_from: Optional[int] = None
    backend: str = "?"
    loss: Optional[float] = None
    saves: list[dict[str, Any]] = field(default_factory=list)
    stopped_at: Optional[int] = None
    done: bool = False

    def drain(self) -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return seen
            seen.append(event)
            kind = event["event"]
            if kind == "start":
                self.first_step = event["first_step"]
                self.resumed_from = event["resumed_from"]
                self.backend = event["backend"]
            elif kind == "step":
                self.last_step, self.loss = event["step"], event["loss"]
            elif kind == "save":
                self.saves.append(event)
            elif kind == "stop":
                self.stopped_at = event["step"]
            elif kind == "done":
                self.done = True


def wipe_local_disk(local: Path) -> None:
    """The disk goes at once, as a reclaimed machine's does: renamed away, then deleted. A
    folder deleted file by file would show the daemon's uploader, rescanning it, a checkpoint
    whose manifest lists a file already gone (issue 39: "guard.json ... is missing")."""
    gone = local.with_name(f".{local.name}-gone")
    os.rename(local, gone)
    shutil.rmtree(gone)


def _read_events(stream: IO[str], events: queue.Queue[dict[str, Any]]) -> None:
    for line in stream:
        try:
            events.put(json.loads(line))
        except ValueError:
            continue


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> Optional[dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except (OSError, ValueError):
        return None


class Screen:
    """One live progress line on a terminal; a line every few seconds otherwise."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.live = stream.isatty()
        self._last_plain = 0.0
        self._width = 0

    def status(self, text: str) -> None:
        if self.live:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
            self.stream.flush()
        elif time.monotonic() - self._last_plain >= 5:
            self._last_plain = time.monotonic()
            self.stream.write(text + "\n")
            self.stream.flush()

    def say(self, text: str) -> None:
        if self.live and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()


def _start_trainer(args: argparse.Namespace, url: str, total_steps: int, index: int,
                   wait_after_stop: bool) -> Run:
    command = [
        sys.executable, "-m", "sidecar.tools.demo.trainer",
        "--root", str(args.workdir / LOCAL_DISK),
        "--total-steps", str(total_steps), "--step-seconds", str(args.step_seconds),
        "--save-seconds", str(args.save_seconds),
        "--redundant-seconds", str(args.redundant_seconds),
        "--ballast-mb", str(args.checkpoint_mb),
    ]
    if wait_after_stop:
        command.append("--wait-after-stop")
    log = open(args.workdir / f"trainer-{index}.log", "w")  # noqa: SIM115 - closed by the process end
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "ESI_SIDECAR_URL": url, "PYTHONUNBUFFERED": "1"},
    )
    run = Run(process)
    assert process.stdout is not None
    threading.Thread(target=_read_events, args=(process.stdout, run.events), daemon=True).start()
    return run


def _progress(run: Run, total_steps: int, remaining: Optional[float]) -> str:
    parts = []
    if remaining is not None:
        parts.append(f"release in {max(0.0, remaining):5.1f}s")
    step = "-" if run.last_step is None else str(run.last_step + 1)
    parts.append(f"step {step}/{total_steps}")
    if run.loss is not None:
        parts.append(f"loss {run.loss:.4f}")
    if run.saves:
        parts.append(f"checkpoint: step {run.saves[-1]['step'] + 1}")
    elif run.resumed_from is not None:
        parts.append(f"resumed from step {run.resumed_from + 1}")
    else:
        parts.append("checkpoint: none")
    if any(save.get("kind") == "final" for save in run.saves):
        parts.append("saved; waiting for the release")
    return " | ".join(parts)


def run_demo(args: argparse.Namespace) -> int:
    from sidecar.tools.emulator import Emulator

    workdir: Path = args.workdir
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    local, volume = workdir / LOCAL_DISK, workdir / NETWORK_VOLUME
    local.mkdir()
    volume.mkdir()
    screen = Screen(sys.stdout)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    total_steps = int((args.lead + args.tail) / args.step_seconds)

    emulator = Emulator(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="cn-beijing",
                        instance_id="i-demo0001", scheduled_instance_id="esi-demo0001")
    release_text = emulator.set_release_in(args.lead)
    release = parse_timestamp(release_text).unix
    emulator.start()
    daemon_log = open(workdir / "daemon.log", "w")  # noqa: SIM115 - closed in finally

    def start_daemon(state: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--source", "volcengine-esi",
             "--api-endpoint", emulator.url, "--metadata-url", emulator.url,
             "--listen", f"127.0.0.1:{port}", "--poll-interval", str(args.poll_interval),
             "--state-file", str(workdir / state),
             "--upload-from", str(local), "--upload-to", volume.resolve().as_uri(),
             "--upload-max-bandwidth", args.upload_bandwidth, "--upload-scan-interval", "0.5"],
            stdout=daemon_log, stderr=subprocess.STDOUT,
            env={**os.environ, "VOLCENGINE_ACCESS_KEY": ACCESS_KEY,
                 "VOLCENGINE_SECRET_KEY": SECRET_KEY, "VOLCENGINE_ECS_METADATA_DISABLED": "true"},
        )

    daemon = start_daemon("daemon-state.json")
    runs: list[Run] = []
    try:
        screen.say(f"1. Emulated ESI instance i-demo0001: release at {release_text} "
                   f"(in {args.lead:g} s)")
        deadline = time.monotonic() + 30
        while _get(url + "/healthz") is None:  # 503 and refused connections alike
            if daemon.poll() is not None or time.monotonic() > deadline:
                screen.say("the daemon did not become healthy; its log:\n"
                           + (workdir / "daemon.log").read_text()[-2000:])
                return 1
            time.sleep(0.1)
        expiry = _get(url + "/v1/expiry") or {}
        screen.say(f"2. Daemon on {url} sees it: {expiry.get('remaining_seconds', 0):.0f} s "
                   f"left (source {expiry.get('source')}); it uploads checkpoints from "
                   f"{LOCAL_DISK}/ to {NETWORK_VOLUME}/ at {args.upload_bandwidth}/s")
        screen.say(f"   watch it live: open {url}/ in a browser (the countdown, the saves, "
                   "the uploads)")

        first = _start_trainer(args, url, total_steps, 1, wait_after_stop=True)
        runs.append(first)
        screen.say(f"3. Training {total_steps} steps of {args.step_seconds:g} s "
                   f"(more than fit before the release), {args.checkpoint_mb} MiB checkpoints")
        final: Optional[dict[str, Any]] = None
        top_up: Optional[dict[str, Any]] = None
        durable_at: Optional[float] = None
        while time.time() < release:
            for event in first.drain():
                if event["event"] == "start":
                    screen.say(f"   trainer started ({event['backend']})")
                elif event["event"] == "save" and event["kind"] == "routine":
                    screen.say(f"   routine checkpoint at step {event['step'] + 1}: uploading "
                               "it teaches the daemon the upload rate")
                elif event["event"] == "save" and event["kind"] == "final":
                    final = event
                    upload = event.get("upload_seconds")
                    budget = "" if upload is None else f", its upload planned at {upload:.1f} s"
                    screen.say(f"   final checkpoint at step {event['step'] + 1}, "
                               f"{event['remaining']:.1f} s before the release{budget}; "
                               "the trainer waits for the release")
                elif event["event"] == "save" and event["kind"] == "top-up":
                    top_up = event
                    screen.say(f"   top-up checkpoint at step {event['step'] + 1}, "
                               f"{event['remaining']:.1f} s before the release: the margin "
                               "left after the final one held a step and another save")
            if final is not None and durable_at is None:
                uploads = _get(url + "/v1/uploads?limit=0") or {}
                if (uploads.get("last_durable_step") or -1) >= final["step"]:
                    durable_at = float(uploads.get("last_durable_at_unix") or time.time())
                    screen.say(f"   durable on the network volume {release - durable_at:.1f} s "
                               "before the release")
            if first.process.poll() is not None and first.stopped_at is None:
                screen.say(f"the trainer exited early; see {workdir / 'trainer-1.log'}")
                return 1
            screen.status(_progress(first, total_steps, release - time.time()))
            time.sleep(0.1)
        killed_at = time.time()
        if first.process.poll() is None:
            first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        first.drain()
        wipe_local_disk(local)  # the machine's local disk goes with it
        screen.say(f"4. RELEASED: the machine is reclaimed (trainer killed with SIGKILL "
                   f"at step {(first.last_step or 0) + 1}); its local disk is gone")

        daemon.send_signal(signal.SIGTERM)  # the machine's daemon goes with it
        daemon.wait(10)
        emulator.set_release_in(3600)  # the next instance: released in an hour
        local.mkdir()  # the next machine's empty local disk, and its daemon
        daemon = start_daemon("daemon-state-2.json")
        deadline = time.monotonic() + 30
        while ((_get(url + "/v1/expiry") or {}).get("remaining_seconds") or 0) < 600:
            if time.monotonic() > deadline:
                screen.say("the daemon did not see the new instance's release time")
                return 1
            time.sleep(0.1)
        screen.say(f"5. Next machine: its daemon brings the newest durable checkpoint from "
                   f"{NETWORK_VOLUME}/ while the job is still starting ({args.image_pull:g} s "
                   "standing for the image pull)")
        pull_started = time.monotonic()
        waiting = None
        while time.monotonic() < pull_started + args.image_pull:
            if waiting is None:
                waiting = latest_valid(local, clean=False)
                if waiting is not None:
                    screen.say(f"   checkpoint of step {waiting.step + 1} waiting on the local "
                               f"disk {time.monotonic() - pull_started:.1f} s into the pull")
            screen.status("   job starting (image pull) ...")
            time.sleep(0.1)
        restored = subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "restore", "--from",
             volume.resolve().as_uri(), "--to", str(local), "--released-at",
             release_text, "--url", url],
            capture_output=True, text=True, timeout=120,
        )
        back = latest_valid(local) if restored.returncode == 0 else None
        if back is not None:
            how = "found it in place" if "already" in restored.stdout else "brought it"
            screen.say(f"   the job's esi-sidecar restore {how}: step {back.step + 1}")
        else:
            screen.say("5. Next machine: nothing to restore ("
                       + restored.stderr.strip() + "); starting from scratch")
        second = _start_trainer(args, url, total_steps, 2, wait_after_stop=False)
        runs.append(second)
        while second.process.poll() is None or not second.events.empty():
            for event in second.drain():
                if event["event"] == "start":
                    resumed = event["resumed_from"]
                    screen.say("   trainer resumed from "
                               + ("nothing (!)" if resumed is None else f"step {resumed + 1}"))
            screen.status(_progress(second, total_steps, None))
            time.sleep(0.1)
        second.drain()
        if second.process.returncode != 0 or not second.done:
            screen.say(f"the resumed trainer failed; see {workdir / 'trainer-2.log'}")
            return 1

        completed = first.last_step
        resumed_from = second.resumed_from
        lost = (completed - resumed_from if completed is not None and resumed_from is not None
                else (completed + 1 if completed is not None else None))
        screen.say("")
        screen.say("Summary")
        screen.say(f"  steps done            {total_steps} (trained in two runs: "
                   f"1-{(completed or 0) + 1} and {(second.first_step or 0) + 1}-{total_steps})")
        saves: tuple[tuple[str, Optional[dict[str, Any]]], ...] = (
            ("final save ", final), ("top-up save", top_up))
        for label, saved in saves:
            if saved is not None:
                screen.say(f"  {label}           step {saved['step'] + 1}, "
                           f"{release - saved['time']:.1f} s before the reclaim")
            elif label == "final save ":
                screen.say("  final save            none before the reclaim")
        if durable_at is not None:
            screen.say(f"  durable               {release - durable_at:.1f} s before the reclaim, "
                       f"on {NETWORK_VOLUME}/")
        else:
            screen.say("  durable               NOT before the reclaim")
        screen.say(f"  reclaim               SIGKILL at {killed_at - release:+.1f} s, "
                   "local disk wiped")
        screen.say("  restored from         "
                   + (f"{NETWORK_VOLUME}/ (step {resumed_from + 1})"
                      if resumed_from is not None else "nothing"))
        screen.say(f"  steps lost            {lost} steps lost")
        screen.say(f"  time to resume        {_time_to_resume(url)}")
        screen.say(f"  logs                  {workdir}/daemon.log, trainer-1.log, trainer-2.log")
        return 0 if lost == 0 else 1
    finally:
        for run in runs:
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        daemon_log.close()
        emulator.stop()


def _time_to_resume(url: str) -> str:
    """The next machine's daemon's account: training again N s after the release."""
    deadline = time.monotonic() + 10  # the account closes at the first step's event
    while time.monotonic() < deadline:
        accounts = (_get(url + "/v1/reclaims") or {}).get("reclaims") or []
        closed = [a for a in accounts if a.get("resume_seconds") is not None]
        if closed:
            last = closed[0]
            return (f"training again {last['resume_seconds']:.1f} s after the release "
                    f"(waiting for a machine {last['waiting_seconds']:.1f} s, restore "
                    f"{last['restore_seconds']:.1f} s, start-up {last['startup_seconds']:.1f} s)")
        time.sleep(0.1)
    return "not known (no account closed by the next machine's daemon)"


def _seconds(minimum: float) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}: {text!r}")
        return value

    return parse


def add_demo_command(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="the whole story on an emulated ESI release (about a minute)",
        description=(__doc__ or "").split("\n\n")[0] + " A real daemon, a real trainer, an "
        "emulated cloud; at the release the trainer is killed with SIGKILL and resumed.",
    )
    demo.add_argument("--lead", type=_seconds(20), default=60.0, metavar="SECONDS",
                      help="seconds from start to the release (default 60)")
    demo.add_argument("--image-pull", type=_seconds(0), default=3.0, metavar="SECONDS",
                      help="the next machine's job starts this long after its daemon, standing "
                      "for the image pull (default 3)")
    demo.add_argument("--tail", type=_seconds(1), default=15.0, metavar="SECONDS",
                      help="training left for the next machine after the release (default 15)")
    demo.add_argument("--step-seconds", type=_seconds(0.05), default=0.5,
                      help="length of one training step (default 0.5)")
    demo.add_argument("--save-seconds", type=_seconds(0), default=3.0,
                      help="save time the policy assumes before it measured one (default 3)")
    demo.add_argument("--redundant-seconds", type=_seconds(0), default=5.0,
                      help="safety margin (default 5; 120 in production)")
    demo.add_argument("--poll-interval", type=_seconds(0.2), default=2.0,
                      help="daemon poll interval (default 2; 30 in production)")
    demo.add_argument("--upload-bandwidth", default="2MiB", metavar="RATE",
                      help="the uploader's cap, so the upload visibly takes time (default 2MiB)")
    demo.add_argument("--checkpoint-mb", type=int, default=6, metavar="MIB",
                      help="size of each checkpoint, standing in for weights (default 6)")
    demo.add_argument("--workdir", type=Path, default=Path("demo-run"),
                      help="where checkpoints and logs go; emptied first (default ./demo-run)")
    demo.set_defaults(func=run_demo)
