"""Designer reward rules, one small file each; importing this package registers them all.

Everything here is computed in the trainer process from agent returns only; no program
code runs here. Returns are episode scores in [-1, 1] (the recipe's contract scores a loss
as 0 or -1 and a win as 1; the paper-text contract keeps returns in [0, 1]).

A designer sample is scored on its regeneration window: `hint_returns` are the hint plays
of the regeneration step, `no_hint_returns_by_step[j]` the no-hint plays of the window's
step j (offset 0 = the regeneration step itself; any step may be empty; an empty mean is 0).

    base.py                shared input checks, the rule protocol, `Regime`,
                           `env_reward_scale`, and the registry glue
                           (`register_designer_reward`, `make_designer_reward`,
                           `DESIGNER_REWARDS`)
    blend.py               `blend` (recipe default): floored matched-timing regret + plateau
    solve_rate.py          `solve_rate`: the plateau alone
    regret_rule.py         `regret`: floored regret against the flattened window
    micro_lp.py            `micro_lp`: fitted improvement over the window
    learning_potential.py  `learning_potential`: |window mean - slow EMA| per skill
    hint_regret.py         paper text: `designer_reward` and the `hint_regret` rule
    ema.py                 paper text: `ema_learning_potential`

Regret and the window's win rate are not defined here but in
:mod:`spade_jax.spade.regret`, which the loop's own measurements use too.

A designer sample's advantage is `(total - mean total of its skill) * scale`, no std, with
`scale = env_reward_scale(...)`; totals < 0 are dropped: the loop's designer groups under
the designer's update rule (`train.designer`, default `dr_grpo`; `spade/loop.py`,
`docs/update_rules.md`), not a function here.

Every rule has the same shape (`DesignerRewardRule`): `score(hint_returns,
no_hint_returns_by_step, *, skill)` returns an object with `.total` and `as_metrics()`.
A rule changes the reward only; the loop derives regret, win rate and regimes for memory
and metrics itself from the window's returns, never from the rule's object. The rules are
registered in the `designer_rewards` category of :mod:`spade_jax.rl.registry`; a new rule
is one new file here (imported below), or a module in the experiment's `rule_modules`.
"""

from spade_jax.spade.rewards import (  # noqa: F401  (import registers the rules)
    blend,
    ema,
    hint_regret,
    learning_potential,
    micro_lp,
    regret_rule,
    solve_rate,
)
