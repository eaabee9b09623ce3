"""The rule registries (``rl/registry.py``): their error paths, the docs' "add a rule"
worked example registering and running, and every built-in part registered and
documented in docs/update_rules.md."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from spade_jax import rl
from spade_jax.rl.registry import Registry


def test_registry_errors_are_clear():
    registry: Registry = Registry("policy_losses")

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        scale: float = 1.0

    registry.register("mine", config=Cfg)(lambda *a: None)
    with pytest.raises(ValueError, match="'mine' is already registered"):
        registry.register("mine", config=Cfg)(lambda *a: None)
    with pytest.raises(KeyError, match=r"unknown policy_losses rule 'nope'; known: \['mine'\]"):
        registry.get("nope")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['scal'\]"):
        registry.get("mine").make_config(scal=2.0)
    with pytest.raises(ValueError, match="clip_eps must be in"):
        rl.policy_losses.get("grpo").make_config(clip_eps=1.5)
    with pytest.raises(ModuleNotFoundError, match="rule module 'no_such_rules'"):
        rl.load_rule_modules(["no_such_rules"])


def test_worked_example_in_docs_registers_and_runs(tmp_path, monkeypatch):
    """The docs' "add a rule" example, copied verbatim into a module, matches NumPy."""
    doc = (Path(__file__).parents[2] / "docs" / "update_rules.md").read_text()
    code = re.search(r"```python\n(# examples/rules/pairwise\.py.*?)```", doc, re.S).group(1)
    assert len(code.splitlines()) < 60
    assert code == (Path(__file__).parents[2] / "examples" / "rules" / "pairwise.py").read_text()
    (tmp_path / "my_rules").mkdir()
    (tmp_path / "my_rules" / "__init__.py").write_text("")
    (tmp_path / "my_rules" / "pairwise.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(rl.advantage_estimators._rules)  # another test may have loaded the example
    rl.advantage_estimators._rules.pop("pairwise", None)
    rl.load_rule_modules(["my_rules.pairwise"])
    try:
        rule = rl.advantage_estimators.get("pairwise")
        rewards = np.array([0.0, 1.0, 1.0, 0.5, 0.2, 0.2, 0.9, 0.1], np.float32)
        advantages, metrics = rule.fn(rewards, 4, rule.make_config(scale=2.0))
        expected = [2.0 * np.mean([np.sign(g[i] - g[j]) for j in range(4) if j != i])
                    for g in rewards.reshape(2, 4) for i in range(4)]
        np.testing.assert_allclose(np.asarray(advantages), expected, rtol=1e-6)
        assert float(metrics["tie_frac"]) == pytest.approx(4 / 24)
    finally:
        rl.advantage_estimators._rules.clear()
        rl.advantage_estimators._rules.update(saved)
        sys.modules.pop("my_rules.pairwise", None)
        sys.modules.pop("my_rules", None)


def test_every_built_in_part_is_registered_and_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "update_rules.md").read_text()
    for name, reg in (("group_filters", rl.group_filters),
                      ("advantage_estimators", rl.advantage_estimators),
                      ("step_credits", rl.step_credits),
                      ("token_weightings", rl.token_weightings),
                      ("importance_corrections", rl.importance_corrections),
                      ("policy_losses", rl.policy_losses)):
        for rule in reg.names():
            assert f"`{rule}`" in doc, f"{name} rule {rule!r} is not in docs/update_rules.md"
    assert not hasattr(rl, "step_advantage_estimators")
    with pytest.raises(ImportError):
        from spade_jax.rl.update_rule import UpdateRuleConfig  # noqa: F401
