"""The verl drop-in: verl's signature and rule, the daemon first, env second, never stalls.

The function on its own, in this process; against the real verl releases (signature,
call sites, install() in both import orders, the V1 loop) see
tests/integrations/test_integration_verl_wheels.py.
"""

from __future__ import annotations

import inspect
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import serve_daemon, wait_for
from drill_support import DrillScript

from sidecar.integrations import verl as esi_verl
from sidecar.integrations.verl import configure, should_save_ckpt_esi
from sidecar.train.deadline import DeadlineTracker

MLP = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
SAGEMAKER = "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


@pytest.fixture(autouse=True)
def _fresh_module_state() -> Iterator[None]:
    yield
    esi_verl.uninstall()
    with esi_verl._cache_lock:
        esi_verl._cache = None


def test_signature_matches_verl() -> None:
    # verl/utils/checkpoint/checkpoint_manager.py:
    # def should_save_ckpt_esi(max_steps_duration: float, save_ckpt_duration: float = 60,
    #                          redundant_time: float = 0) -> bool
    signature = inspect.signature(should_save_ckpt_esi)
    assert [(p.name, p.default, p.kind) for p in signature.parameters.values()] == [
        ("max_steps_duration", inspect.Parameter.empty, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("save_ckpt_duration", 60, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("redundant_time", 0, inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ]
    assert signature.return_annotation in (bool, "bool")


def test_daemon_deadline_comes_first() -> None:
    now = time.time()
    environ = {MLP: str(int(now + 10**6))}  # the environment says: far away
    with serve_daemon(sources=("static",), expires_at=str(int(now + 100))) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        configure(daemon.url, environ=environ)
        # As ray_trainer calls it: remaining ~100 s.
        assert should_save_ckpt_esi(max_steps_duration=10, redundant_time=40) is True  # 110
        assert should_save_ckpt_esi(max_steps_duration=10, redundant_time=0) is False  # 70
        assert should_save_ckpt_esi(10, 20, 0) is False
        assert should_save_ckpt_esi(50, 60, 0) is True
        # verl answers False until it has measured a step.
        assert should_save_ckpt_esi(max_steps_duration=0, redundant_time=10**6) is False


def test_daemon_without_deadline_falls_back_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MLP, raising=False)
    monkeypatch.delenv(SAGEMAKER, raising=False)
    with serve_daemon(sources=("env",)) as daemon:  # the daemon itself knows no deadline
        wait_for(lambda: daemon.store.health().ok)
        configure(daemon.url, environ={MLP: str(int(time.time() + 50))})
        assert should_save_ckpt_esi(10, 60, 0) is True
        assert should_save_ckpt_esi(10, 20, 0) is False
        configure(daemon.url, environ={})
        assert should_save_ckpt_esi(10, 60, 10**6) is False  # no deadline anywhere


@pytest.mark.parametrize(
    ("variable", "scale"), [(MLP, 1), (SAGEMAKER, 1), (MLP, 1000), (SAGEMAKER, 1000)]
)
def test_env_fallback_seconds_and_milliseconds(variable: str, scale: int) -> None:
    value = str(int((time.time() + 50) * scale))
    configure(closed_port_url(), environ={variable: value})
    assert should_save_ckpt_esi(10, 60, 0) is True  # 50 <= 70
    assert should_save_ckpt_esi(10, 20, 0) is False  # 50 > 30


def test_env_read_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Like verl, the variables are read at each call (os.environ by default)."""
    monkeypatch.delenv(SAGEMAKER, raising=False)
    monkeypatch.delenv(MLP, raising=False)
    configure(closed_port_url())
    assert should_save_ckpt_esi(10, 60, 0) is False
    monkeypatch.setenv(MLP, str(int(time.time() + 30)))
    assert should_save_ckpt_esi(10, 60, 0) is True


def test_no_deadline_and_past_deadline_are_false() -> None:
    configure(closed_port_url(), environ={})
    assert should_save_ckpt_esi(10**6, 10**6, 10**6) is False
    configure(closed_port_url(), environ={MLP: str(int(time.time() - 10))})
    assert should_save_ckpt_esi(10**6, 10**6, 10**6) is False


def test_bad_input_never_raises() -> None:
    configure(closed_port_url(), environ={MLP: "not a time"})
    assert should_save_ckpt_esi(10, 60, 0) is False
    configure(closed_port_url(), environ={MLP: str(int(time.time() + 30))})
    assert should_save_ckpt_esi(None, 60, 0) is False  # type: ignore[arg-type]
    assert should_save_ckpt_esi(float("nan"), 60, 0) is False


def test_daemon_down_keeps_its_last_deadline() -> None:
    now = time.time()
    with serve_daemon(sources=("static",), expires_at=str(int(now + 100))) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        ticks = [0.0]
        configure(daemon.url, environ={}, refresh_seconds=1.0, monotonic=lambda: ticks[0])
        assert should_save_ckpt_esi(50, 60, 0) is True
    ticks[0] = 10.0  # refresh due; the daemon is gone now
    assert should_save_ckpt_esi(50, 60, 0) is True
    assert esi_verl._current_cache().reachable is False


def test_stale_answer_without_deadline_keeps_the_last_known_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The daemon restarts without a state file while its source fails: it serves
    # expires_at null, stale true. The deadline it gave before still holds.
    now = time.time()
    ticks = [0.0]
    with serve_daemon(sources=("static",), expires_at=str(int(now + 100))) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        port = int(daemon.url.rsplit(":", 1)[1])
        configure(daemon.url, environ={}, monotonic=lambda: ticks[0])
        assert should_save_ckpt_esi(50, 60, 0) is True
    monkeypatch.setenv(MLP, "garbage")  # read by the restarted daemon's env source
    with serve_daemon(sources=("env",), listen=(("127.0.0.1", port),)) as restarted:
        wait_for(lambda: restarted.store.expiry().error)
        ticks[0] = 10.0  # refresh due
        assert should_save_ckpt_esi(50, 60, 0) is True
        tracker = esi_verl._current_cache()
        assert tracker.reachable is True
        assert tracker.deadline() == (pytest.approx(int(now + 100)), "daemon")


def test_a_failing_node_keeps_its_last_deadline() -> None:
    # The single controller asks every node's daemon; the node released first stops
    # answering: its deadline still counts.
    now = time.time()
    ticks = [0.0]
    with serve_daemon(sources=("static",), expires_at=str(int(now + 10**5))) as far:
        with serve_daemon(sources=("static",), expires_at=str(int(now + 100))) as near:
            wait_for(lambda: far.store.health().ok and near.store.health().ok)
            configure([far.url, near.url], environ={}, monotonic=lambda: ticks[0])
            assert should_save_ckpt_esi(50, 60, 0) is True
        ticks[0] = 10.0  # refresh due; the near node's daemon is gone
        assert should_save_ckpt_esi(50, 60, 0) is True
        tracker = esi_verl._current_cache()
        assert tracker.reachable is False
        assert tracker.last_error == f"{near.url}: connection refused"


def test_shares_the_guards_deadline_tracker_and_validator() -> None:
    configure(closed_port_url(), environ={})
    assert isinstance(esi_verl._current_cache(), DeadlineTracker)
    with pytest.raises(ValueError, match="retry_seconds"):
        configure(closed_port_url(), retry_seconds=float("inf"))
    with pytest.raises(ValueError, match="refresh_seconds"):
        configure(closed_port_url(), refresh_seconds=-1)


def test_dead_or_hung_daemon_does_not_stall() -> None:
    # Refused: answers at once.
    configure(closed_port_url(), environ={})
    started = time.monotonic()
    assert should_save_ckpt_esi(10, 60, 0) is False
    assert time.monotonic() - started < 1.0

    # Hung: accepts the connection (kernel backlog) and never answers.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        ticks = [0.0]
        configure(url, environ={MLP: str(int(time.time() + 30))}, monotonic=lambda: ticks[0])

        accepted = []

        def connections_so_far() -> int:
            while True:
                try:
                    connection, _ = listener.accept()
                except BlockingIOError:
                    return len(accepted)
                connection.close()
                accepted.append(connection)

        started = time.monotonic()
        assert should_save_ckpt_esi(10, 60, 0) is True  # env fallback after the timeout
        first = time.monotonic() - started
        assert connections_so_far() == 1
        # Within the retry interval (5 s): no new request, however many calls. Counted,
        # not timed: a loaded machine makes timings flaky, never this count.
        for _ in range(200):
            assert should_save_ckpt_esi(10, 60, 0) is True
        assert connections_so_far() == 1
        ticks[0] = 5.0  # the retry is due: one new attempt
        assert should_save_ckpt_esi(10, 60, 0) is True
        assert connections_so_far() == 2
    assert first < 1.0  # the 0.2 s timeout; a generous bound, not a timing test


def test_cached_between_refreshes() -> None:
    """Per-step calls cost one request per refresh interval, not one per call."""
    now = time.time()
    with serve_daemon(sources=("static",), expires_at=str(int(now + 100))) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        ticks = [0.0]
        configure(daemon.url, environ={}, monotonic=lambda: ticks[0])
        cache = esi_verl._current_cache()
        requests = []
        original = cache.client.expiry

        def counting_expiry():  # type: ignore[no-untyped-def]
            requests.append(1)
            return original()

        cache.client.expiry = counting_expiry  # type: ignore[method-assign]
        for _ in range(100):
            should_save_ckpt_esi(10, 60, 0)
        assert len(requests) == 1
        ticks[0] = 1.5
        should_save_ckpt_esi(10, 60, 0)
        assert len(requests) == 2


# ---------------------------------------------------------------------------- install()
# install()/uninstall() against the real verl releases:
# tests/integrations/test_integration_verl_wheels.py


def test_install_is_importable_by_dotted_path() -> None:
    """Ray's worker_process_setup_hook takes "module.function" and imports it."""
    import importlib

    module_name, _, function = "sidecar.integrations.verl.install".rpartition(".")
    assert getattr(importlib.import_module(module_name), function) is esi_verl.install


def test_a_fire_drill_makes_verl_save_once_through_its_own_save_and_train_on(
        tmp_path: Path) -> None:
    """verl's loop as ray_trainer runs it (the drop-in after every step, then its own
    ``_save_checkpoint`` on True): one save for the drill, PASS on the daemon, training
    goes on to the end."""
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        configure(daemon.url, refresh_seconds=0.05, environ={})
        script = DrillScript(daemon.url, lead=4.0)
        saves: list[int] = []
        max_steps_duration = 0.0
        for step in range(1, 2000):
            started = time.monotonic()
            time.sleep(0.05)  # the step itself
            max_steps_duration = max(max_steps_duration, time.monotonic() - started)
            if should_save_ckpt_esi(max_steps_duration=max_steps_duration,
                                    save_ckpt_duration=0.5, redundant_time=1.0):
                folder = tmp_path / f"global_step_{step}"  # verl's _save_checkpoint
                folder.mkdir()
                (folder / "model.pt").write_bytes(b"weights")
                saves.append(step)
            if script.at_step(step):
                break
    assert script.passed(), script.verdicts
    figures = script.verdicts[0]["figures"]
    assert len(saves) == 1 and step == script.end_step > saves[0]
    assert figures["outcome"] == "durable" and 0 < figures["lead_seconds"] < 4.0
    assert figures["budget_seconds"] > 1.5  # verl's rule: step + save + redundant
