"""Hint-regret filter for synthetic RL tasks (`python -m spade_jax.filter`).

    from spade_jax.hint_filter import FilterConfig, load_filter_tasks, run_filter, write_outputs
    tasks = load_filter_tasks("tasks.jsonl")
    stats = run_filter(policy, tasks, "out/", FilterConfig(samples_hint=16))
    write_outputs(tasks, stats, "out/", config)

Modules: `tasks` (JSONL format), `runner` (two arms per task, regret via
`spade_jax.spade.designer_reward`, streaming + resume), `summary` (split files, PNG).
"""

from spade_jax.hint_filter.runner import FilterConfig, run_filter, select_tasks, task_statistics
from spade_jax.hint_filter.summary import REGIMES, write_outputs
from spade_jax.hint_filter.tasks import FilterTask, load_filter_tasks

__all__ = ["REGIMES", "FilterConfig", "FilterTask", "load_filter_tasks", "run_filter",
           "select_tasks", "task_statistics", "write_outputs"]
