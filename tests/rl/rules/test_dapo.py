"""DAPO (``rl/rules/dapo.py``) against NumPy re-derivations: the dynamic-sampling group
filter (next to the identity ``keep_all``) and the token-mean loss. Refilling the dropped
groups is ``apply_rule``'s: tests/rl/test_update_rule.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from rule_references import grouped_rewards, np_clipped_loss, random_batch, run_loss

from spade_jax import rl


def test_dynamic_sampling_keeps_groups_with_differing_rewards():
    rewards_gn = grouped_rewards(2)
    rewards_gn[3] = [1.0, 1.0, 1.0, 1.0]
    rule = rl.group_filters.get("dapo_dynamic_sampling")
    keep, metrics = rule.fn(jnp.asarray(rewards_gn), rule.make_config())
    expected = [len(set(group.tolist())) > 1 for group in rewards_gn]
    assert np.asarray(keep).tolist() == expected
    assert float(metrics["kept_group_frac"]) == pytest.approx(np.mean(expected))
    keep_all = rl.group_filters.get("keep_all")
    assert np.asarray(keep_all.fn(jnp.asarray(rewards_gn), keep_all.make_config())[0]).all()


@pytest.mark.parametrize("seed", [2, 3])
def test_dapo_loss_matches_numpy(seed):
    batch = random_batch(seed)
    loss, _ = run_loss("dapo", batch)
    expected, _ = np_clipped_loss(batch, 0.2, 0.28, 0.0, "token_mean")
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)
