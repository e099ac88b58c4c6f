"""Each deadline's kind, served by the daemon (issue 37, item 2): ``deadline_kind`` in
``/v1/expiry`` and in each of its ``notices``, as the source's spec declares it: the
machine's for a release or reclaim, the process's for a Slurm limit or the environment's.

The real daemon on 127.0.0.1 with the static and env sources; the Slurm source's kind
through the real store with the specs' table (a Slurm cluster: test_source_slurm.py).
"""

from __future__ import annotations

import time

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.sources.registry import spec, specs
from sidecar.host.store import Store
from sidecar.models import KIND_SCHEDULED_RELEASE, Expiry, Observation

ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def test_the_specs_declare_slurm_and_env_a_process_s_and_the_clouds_a_machine_s() -> None:
    kinds = {s.name: s.deadline_kind for s in specs()}
    assert kinds["slurm"] == kinds["env"] == "process"
    assert {name for name, kind in kinds.items() if kind == "machine"} == (
        set(kinds) - {"slurm", "env"})
    assert spec("volcengine-esi").deadline_kind == "machine"


@pytest.mark.parametrize("env_first", [True, False])
def test_expiry_and_each_notice_carry_the_deadline_kind(
        monkeypatch: pytest.MonkeyPatch, env_first: bool) -> None:
    now = time.time()
    static, env = (now + 7200, now + 3600) if env_first else (now + 3600, now + 7200)
    monkeypatch.setenv(ENV, str(int(env)))
    monkeypatch.delenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", raising=False)
    with serve_daemon(sources=("static", "env"), expires_at=repr(static)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        status, body = get_json(daemon.url + "/v1/expiry")
    assert status == 200
    assert body["source"] == ("env" if env_first else "static")
    assert body["deadline_kind"] == ("process" if env_first else "machine")
    assert body["kind"] == KIND_SCHEDULED_RELEASE  # the notice's kind, unchanged
    by_source = {n["source"]: n for n in body["notices"]}
    assert by_source["static"]["deadline_kind"] == "machine"
    assert by_source["env"]["deadline_kind"] == "process"
    parsed = Expiry.from_json(body)  # what the client reads
    assert parsed.deadline_kind == body["deadline_kind"]
    assert {n["deadline_kind"] for n in parsed.notices} == {"machine", "process"}


def test_slurm_s_limit_is_a_process_s_and_a_release_a_machine_s_in_the_store() -> None:
    now = 1_800_000_000.0
    store = Store(["volcengine-esi", "slurm"], stale_after=60.0, clock=lambda: now,
                  deadline_kinds={s.name: s.deadline_kind for s in specs()})
    store.record_success("volcengine-esi", Observation(now + 3600, KIND_SCHEDULED_RELEASE))
    store.record_success("slurm", Observation(now + 600, KIND_SCHEDULED_RELEASE))
    expiry = store.expiry()
    assert (expiry.source, expiry.deadline_kind) == ("slurm", "process")
    assert [(n["source"], n["deadline_kind"]) for n in expiry.notices] == [
        ("slurm", "process"), ("volcengine-esi", "machine")]
    assert expiry.to_json()["deadline_kind"] == "process"
    store.record_success("slurm", Observation(now + 7200, KIND_SCHEDULED_RELEASE))
    assert (store.expiry().source, store.expiry().deadline_kind) == ("volcengine-esi", "machine")


def test_no_deadline_has_no_kind_and_an_older_daemon_s_answer_reads_as_none() -> None:
    store = Store(["static"], stale_after=60.0, deadline_kinds={"static": "machine"})
    assert store.expiry().deadline_kind is None
    body = store.expiry().to_json()
    del body["deadline_kind"]
    assert Expiry.from_json(body).deadline_kind is None
