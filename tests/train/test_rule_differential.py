"""The rule table (``sidecar.train.rule``) against the old decision path, side by side.

tests/train/legacy_policy.py is a frozen copy of ``SavePolicy.decide`` as it was before
issue 37, with the guard's routine overlay. Both are driven through the same training
loop over the hypothesis grid of tests/train/test_properties_policy.py, widened to every
option value ("auto" margins, the four late-save modes), the three deadline kinds, a
SIGTERM from some step on, the collective margin and routine saves falling due; on every
decision they must agree on the action, the flags and the text, and their state after.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from legacy_policy import SavePolicy as LegacyPolicy
from legacy_policy import with_routine
from test_properties_policy import MAX_ITERATIONS, NOW, Scenario, scenarios

from sidecar.train.policy import SavePolicy

EXAMPLES = 400
COMPARED = {"decisions": 0, "examples": 0}


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Scenario, dict[str, Any]]:
    scenario = draw(scenarios())
    options = dict(scenario.options)
    options["redundant_seconds"] = draw(st.sampled_from(
        [options["redundant_seconds"], "auto"]))
    options["try_late_saves"] = draw(st.sampled_from([True, False, "expected", "auto"]))
    extra = {
        "options": options,
        "machine": draw(st.sampled_from([None, True, False])),
        "collective": draw(st.booleans()),
        "sigterm_from": draw(st.none() | st.integers(0, 60)),
        "overdue": draw(st.lists(st.none() | st.floats(-100.0, 100.0), min_size=1,
                                 max_size=6)),
    }
    return scenario, extra


def _decide(policy: Any, remaining: float, upload: Optional[float], now: float,
            world: dict[str, Any], index: int, *, new: bool) -> Any:
    sigterm = world["sigterm_from"] is not None and index >= world["sigterm_from"]
    overdue = world["overdue"][index % len(world["overdue"])]
    inputs: dict[str, Any] = {
        "step_seconds": policy.step_estimate(), "save_seconds": policy.save_estimate(),
        "covered_seconds": policy.covered_seconds(now), "upload_seconds": upload,
        "typical_step_seconds": policy.typical_step_estimate(),
        "machine_deadline": world["machine"],
        # The guard's vote after a SIGTERM: "topped up" on every rank.
        "steps_after_final": -1.0 if sigterm else None,
    }
    if new:
        return policy.decide(remaining, **inputs, collective=world["collective"],
                             sigterm=sigterm, routine_overdue_seconds=overdue)
    margin = policy.margin_for(None, 0.0, None) if world["collective"] else None
    return with_routine(policy.decide(remaining, **inputs, margin_seconds=margin), overdue)


FIELDS = ("save_now", "stop", "remaining_seconds", "budget_seconds", "step_seconds",
          "save_seconds", "reason", "upload_seconds", "top_up", "too_late", "best_effort",
          "rearmed", "routine", "fallback")


def _view(decision: Any) -> tuple[object, ...]:
    return tuple(getattr(decision, name) for name in FIELDS)


def _state(policy: Any, now: float) -> tuple[object, ...]:
    return (policy.step_estimate(), policy.save_estimate(), policy.covered_seconds(now),
            policy.steps_after_final(), policy.at_risk_seconds())


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(worlds())
def test_the_table_decides_as_the_old_path_on_every_example(
        drawn: tuple[Scenario, dict[str, Any]]) -> None:
    scenario, world = drawn
    old, new = LegacyPolicy(**world["options"]), SavePolicy(**world["options"])
    upload = scenario.upload_seconds
    now, deadline = NOW, NOW + scenario.remaining_at_start
    saves = 0
    for index in range(MAX_ITERATIONS):
        for policy in (old, new):
            policy.record_step(scenario.first_step * scenario.step_factors[
                index % len(scenario.step_factors)])
        now += scenario.first_step
        if index in (20, 60):  # a renewal, then a notice that brings it earlier
            deadline += 900.0 if index == 20 else -800.0
        remaining = deadline + scenario.wobbles[index % len(scenario.wobbles)] - now
        was = _decide(old, remaining, upload, now, world, index, new=False)
        got = _decide(new, remaining, upload, now, world, index, new=True)
        COMPARED["decisions"] += 1
        assert (got.save_now, got.stop) == (was.save_now, was.stop), (index, was, got)
        assert _view(got) == _view(was), (index, was, got)  # every flag, figure, the text
        if got.rearmed:
            old.forget_cover()
            new.forget_cover()
        if got.save_now:
            seconds = (world["options"]["save_seconds"] or 10.0) * scenario.save_factors[
                saves % len(scenario.save_factors)]
            saves += 1
            for policy, asked in ((old, was), (new, got)):
                extra = {} if policy is old else {"margin_seconds": got.margin_seconds}
                policy.record_save(seconds, started_unix=now, deadline_unix=now + remaining,
                                   budget_seconds=asked.budget_seconds,
                                   fallback=asked.fallback, **extra)
            now += seconds
        assert _state(new, now) == _state(old, now), index
        if (got.stop and scenario.obey_stop) or now > deadline + 600.0:
            break
    COMPARED["examples"] += 1


@pytest.fixture(scope="module", autouse=True)
def _say_how_many() -> Any:
    yield
    print(f"\nrule vs legacy: {COMPARED['decisions']} decisions over "
          f"{COMPARED['examples']} examples, all alike")
