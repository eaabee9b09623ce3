"""The learning check's verdicts on synthetic curves: each claim passes when it holds and
fails, alone, when it does not."""

import numpy as np

from spade_jax.toy.check import (
    CheckConfig,
    agent_frontier,
    check_agent_path,
    check_designer_path,
    check_run,
    frontier_shares,
    shares_at_levels,
    thirds,
)

NAN = float("nan")


def _curves(**overrides):
    steps = np.arange(12, dtype=float)
    regen = np.where(steps % 2 == 0, 1.0, NAN)
    curves = {
        "return_no_hint_mean": (steps, np.linspace(0.2, 0.5, 12)),
        "validity_rate": (steps, 0.9 * regen),
        "regret_raw_mean": (steps, np.full(12, 0.1)),
        "regime/frontier": (steps, np.full(12, 3.0)),
        "regime/mastered": (steps, np.where(steps < 6, 0.0, 2.0)),
        "regime/intractable": (steps, np.where(steps < 6, 1.0, 0.0)),
        "learnable_share": (steps, np.where(steps < 4, 0.0, 0.5)),
        "designer/difficulty_mean": (steps, np.linspace(2.0, 4.0, 12) * regen),
        "eval/toy/pass@1": (steps, np.where(steps % 4 == 3, np.linspace(0.2, 0.6, 12), NAN)),
        "eval/toy/level_2/pass@1": (steps, np.where(steps % 4 == 3, 0.9, NAN)),
        "eval/toy/level_4/pass@1": (steps, np.where(steps % 4 == 3, 0.6, NAN)),
        "eval/toy/level_6/pass@1": (steps, np.where(steps % 4 == 3, 0.2, NAN)),
        "train/agent/logp_gap_max": (steps, np.full(12, 2e-5)),
    }
    curves.update({k: (steps, np.asarray(v, float)) for k, v in overrides.items()})
    return curves


def _failed(curves, config=CheckConfig()):
    return {f.name for f in check_run(curves, config) if not f.ok}


def test_a_run_that_learns_passes_every_claim():
    findings = check_run(_curves())
    assert all(f.ok for f in findings), [f.line() for f in findings]
    assert agent_frontier(_curves(), 0.5) == 4.0


def test_each_claim_fails_alone():
    flat = np.full(12, 0.3)
    assert _failed(_curves(return_no_hint_mean=flat)) == {"agent_return_rises"}
    assert _failed(_curves(**{"eval/toy/pass@1": np.where(np.arange(12) % 4 == 3, 0.3, NAN)})
                   ) == {"heldout_rises"}
    low = np.where(np.arange(12) % 2 == 0, 0.4, NAN)
    assert _failed(_curves(validity_rate=low)) == {"validity_floor"}
    assert _failed(_curves(regret_raw_mean=np.full(12, -0.1))) == {"regret_positive"}
    assert _failed(_curves(**{"regime/mastered": np.zeros(12)})) == {"all_regimes_seen"}
    assert _failed(_curves(learnable_share=np.where(np.arange(12) < 7, 0.0, 0.5))
                   ) == {"learnable_in_most"}
    far = np.where(np.arange(12) % 2 == 0, np.linspace(7.0, 9.0, 12), NAN)
    assert _failed(_curves(**{"designer/difficulty_mean": far})) == {"designer_follows_agent"}
    near_but_flat = np.where(np.arange(12) % 2 == 0, 3.5, NAN)
    assert _failed(_curves(**{"designer/difficulty_mean": near_but_flat})
                   ) == {"designer_level_rises"}
    one_shifted_step = np.where(np.arange(12) == 5, 12.0, 2e-5)
    assert _failed(_curves(**{"train/agent/logp_gap_max": one_shifted_step})
                   ) == {"agent_tokens_sampled"}


def test_missing_curves_fail_rather_than_pass():
    assert _failed({}) == {"agent_return_rises", "heldout_rises", "validity_floor",
                           "regret_positive", "all_regimes_seen", "learnable_in_most",
                           "designer_level_rises", "designer_follows_agent",
                           "agent_tokens_sampled"}


def test_the_agent_path_check_fails_on_a_flat_return_or_a_shifted_mask():
    good = _curves(return_no_hint_mean=np.linspace(0.2, 0.8, 12))
    assert all(f.ok for f in check_agent_path(good))
    flat = _curves(return_no_hint_mean=np.full(12, 0.5))
    assert [f.name for f in check_agent_path(flat) if not f.ok] == ["agent_return_rises"]
    shifted = _curves(return_no_hint_mean=np.linspace(0.2, 0.8, 12),
                      **{"train/agent/logp_gap_max": np.full(12, 12.0)})
    assert [f.name for f in check_agent_path(shifted) if not f.ok] == ["agent_tokens_sampled"]
    assert not all(f.ok for f in check_agent_path({}))


def _designer_path_curves(frontier=(1, 2, 3, 5, 6, 6, 7, 7, 8, 7, 8, 8), levels=None,
                          **overrides):
    # toy:check's shape: 8 games scored every round, more and more of them at the agent's
    # frontier (levels 2-4: in the frontier regime, the hint helps), the rest split between
    # mastered (level 1) and intractable (level 7) games; ``levels`` overrides the levels
    steps = np.arange(12, dtype=float)
    frontier = np.asarray(frontier, float)
    mastered, intractable = np.floor((8 - frontier) / 2), np.ceil((8 - frontier) / 2)
    levels = levels or {1: mastered, 3: frontier, 7: intractable}
    curves = {
        "validity_rate": (steps, np.full(12, 0.9)),
        "regret_raw_mean": (steps, np.full(12, 0.3)),
        "regime/frontier": (steps, frontier),
        "regime/mastered": (steps, mastered),
        "regime/intractable": (steps, intractable),
        # a level no game states in a round is not logged in it
        **{f"designer/level/{n}": (steps[np.asarray(c) > 0], np.asarray(c)[np.asarray(c) > 0])
           for n, c in levels.items()},
        "designer/difficulty_mean": (steps, np.linspace(5.0, 2.5, 12)),
        "train/designer/logp_gap_max": (steps, np.full(12, 2e-6)),
        # NaN (not logged) where a round's programs were too few or alike to correlate
        "designer/reward_attribution": (steps, np.where(steps % 5 == 4, np.nan, 1.0)),
    }
    curves.update({k: (steps, np.asarray(v, float)) for k, v in overrides.items()})
    return curves


def _designer_path_failed(curves):
    return {f.name for f in check_designer_path(curves) if not f.ok}


def test_the_designer_path_check_fails_each_claim_alone():
    findings = check_designer_path(_designer_path_curves())
    assert all(f.ok for f in findings), [f.line() for f in findings]
    moved = next(f for f in findings if f.name == "designer_moves_to_frontier")
    assert moved.value == np.mean([7, 8, 8, 8]) / 8  # the last third's frontier share
    assert "first regeneration 0.12" in moved.bar and "frontier regime 0.12 -> 0.97" in moved.bar
    expected = np.asarray([1, 2, 3, 5, 6, 6, 7, 7, 8, 7, 8, 8]) / 8
    assert np.allclose(frontier_shares(_designer_path_curves()), expected)
    assert np.allclose(shares_at_levels(_designer_path_curves(), (2, 3, 4)), expected)
    # the games read "frontier" by their (swapped) returns but sit at level 5: the level,
    # read from the programs, is what the claim measures
    at_five = _designer_path_curves(levels={5: np.full(12, 8.0)})
    assert _designer_path_failed(at_five) == {"designer_moves_to_frontier"}
    assert _designer_path_failed(_designer_path_curves(validity_rate=np.full(12, 0.45))
                                 ) == {"validity_floor"}
    assert _designer_path_failed(_designer_path_curves(regret_raw_mean=np.full(12, -0.1))
                                 ) == {"regret_positive"}
    # no direction (rewards on the wrong programs), away (sign flipped), or already there
    # from the start (the warm start put the games at the frontier: nothing moved them)
    for frontier in ([2] * 12, [2, 1, 1, 0, 1, 0, 0, 1, 0, 0, 1, 0], [5] + [6] * 11):
        assert _designer_path_failed(_designer_path_curves(frontier)
                                     ) == {"designer_moves_to_frontier"}
    assert _designer_path_failed(_designer_path_curves(**{
        "train/designer/logp_gap_max": np.where(np.arange(12) == 3, 12.0, 2e-6)})
    ) == {"designer_tokens_sampled"}
    # one round's rewards on the wrong programs (the others' attribution is exact)
    assert _designer_path_failed(_designer_path_curves(**{
        "designer/reward_attribution": np.where(np.arange(12) == 7, 0.3, 1.0)})
    ) == {"designer_rewards_reach_their_programs"}
    assert _designer_path_failed({}) == {"validity_floor", "regret_positive",
                                         "designer_moves_to_frontier",
                                         "designer_rewards_reach_their_programs",
                                         "designer_tokens_sampled"}


def test_thirds_match_numpy():
    values = np.arange(10.0)
    first, last = thirds(values)
    assert first == np.mean(values[:4]) and last == np.mean(values[7:])
    assert np.isnan(thirds(np.arange(2.0))[0])


def test_the_report_leads_with_the_claims_curves_and_verdicts(tmp_path):
    from etils import epath

    from spade_jax.metrics import MetricsWriter
    from spade_jax.spade.report import write_report
    from spade_jax.toy.check import report_lead

    curves = _curves(validity_rate=np.where(np.arange(12) % 2 == 0, 0.4, NAN))
    with MetricsWriter(tmp_path) as writer:
        for step in range(12):
            writer.write(step, {k: float(v[step]) for k, (_, v) in curves.items()})
    lead = report_lead(curves, epath.Path(tmp_path) / "plots")
    text = write_report(tmp_path, lead=lead).read_text()
    assert (tmp_path / "plots" / "toy_claims.png").stat().st_size > 0
    assert text.index("## The toy world's claims") < text.index("## Evidence metrics")
    assert "| `validity_floor` | **fail** | 0.400 |" in text
    assert "| `agent_return_rises` | pass |" in text
