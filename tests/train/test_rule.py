"""The rule's table (sidecar.train.rule): its docstring is its code, docs/save-rule.md is
generated from it and each documented example gives its row, and queries never write."""

from __future__ import annotations

import ast
import copy
import inspect
import sys
import time
from pathlib import Path

from guard_support import simple_guard, static_daemon

from sidecar.train import rule
from sidecar.train.client import SidecarClient
from sidecar.train.policy import SavePolicy
from sidecar.train.rule import Why

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import save_rule_doc  # noqa: E402

NOW = 1_800_000_000.0


def test_the_docstring_table_is_the_code_in_order() -> None:
    table = [name for name, _action, _when in save_rule_doc.rows()]
    assert table == [why.name for why in Why]
    source = ast.parse(inspect.getsource(rule.decide))
    calls = sorted((node for node in ast.walk(source) if isinstance(node, ast.Call)
                    and getattr(node.func, "id", "") == "decided"), key=lambda n: n.lineno)
    returned = [node.args[1].attr for node in calls]
    assert returned == table  # one `if` per row, in the table's order
    actions = {name: action for name, action, _when in save_rule_doc.rows()}
    assert {c.args[1].attr: c.args[0].attr.lower() for c in calls} == actions


def test_each_documented_example_gives_its_row() -> None:
    for why, situation in save_rule_doc.EXAMPLES.items():
        assert rule.decide(situation).why is why, why


def test_the_doc_is_up_to_date() -> None:
    assert (ROOT / "docs" / "save-rule.md").read_text(encoding="utf-8") == \
        save_rule_doc.render(), "python tools/save_rule_doc.py"


def measured(policy: SavePolicy) -> SavePolicy:
    """Twelve steps and three saves: "auto" chooses its own margin (below the fixed 120 s)."""
    policy.load_state_dict({"steps": [19.0, 20.0, 21.0] * 4, "saves": [10.0, 11.0, 12.0]})
    return policy


def test_a_query_between_two_decisions_changes_nothing() -> None:
    policy = measured(SavePolicy(redundant_seconds="auto"))
    assert policy.margin_for(21.0, 14.4, None) < 120.0  # the case that wrote before
    before = copy.deepcopy(vars(policy))
    policy.decide(150.0, step_seconds=21.0, save_seconds=14.4, covered_seconds=None)
    policy.decide(150.0, step_seconds=21.0, save_seconds=14.4, covered_seconds=None,
                  collective=True)
    policy.evaluate(NOW, NOW + 150.0, upload_seconds=30.0)
    policy.rearm_after_seconds()
    assert vars(policy) == before


def test_the_guard_s_status_leaves_a_multi_rank_policy_unchanged() -> None:
    """status() decided per process with the "auto" margin and moved the re-arm threshold
    of a collective job from the agreed 120 s to its own (issue 37)."""
    with static_daemon(time.time() + 130.0) as daemon:
        guard = simple_guard(SidecarClient(daemon.url),
                             policy=measured(SavePolicy(redundant_seconds="auto")),
                             reducer=lambda values, ops: list(values))
        limit = time.monotonic() + 10.0
        while not guard.should_save():  # until the daemon's deadline reached the guard
            assert time.monotonic() < limit, guard.last_decision
            with guard.step():
                pass
        before = copy.deepcopy(vars(guard.policy))
        guard.status()
        assert vars(guard.policy) == before
        assert guard.last_decision is not None
        assert guard.last_decision.margin_seconds == 120.0  # agreed across ranks
