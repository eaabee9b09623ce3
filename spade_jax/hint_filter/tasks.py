"""Synthetic tasks for the hint-regret filter, from JSONL; bad lines name line and field.

One JSON object per line, either an answer task or an environment-program task:

    {"id": "t1", "prompt": "What is 17 * 23?", "hint": "17 * 23 = 17 * 20 + 17 * 3",
     "answer": "391", "checker": "math"}
    {"id": "e1", "program": "class Environment: ...", "hint": "try the left door first",
     "prompt": "optional text put before the first observation", "seed": 0, "max_turns": 8}

- `checker`: a name registered in `spade_jax.evaluation.CHECKERS` (math, multiple_choice,
  exact); required with `answer`.
- `program`: an environment program in the sandbox contract (`spade_jax.envs`); it is run
  in the sandbox, reset with `seed` (default 0); the episode return is the task's return.
- any other fields are kept and written back with the task.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from spade_jax.evaluation.checkers import CHECKERS
from spade_jax.evaluation.data import DataError, check_unique_ids, field, read_jsonl, record_id


@dataclasses.dataclass(frozen=True)
class FilterTask:
    id: str
    line: int
    hint: str
    prompt: str = ""
    answer: str | None = None
    checker: str | None = None
    program: str | None = None
    seed: int = 0
    max_turns: int | None = None
    record: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def is_program(self) -> bool:
        return self.program is not None


def load_filter_tasks(path: str | Path) -> list[FilterTask]:
    """Parses and checks every line before any sampling starts."""
    tasks = []
    for where, record in read_jsonl(path):
        hint = field(record, "hint", str, where)
        if "program" in record:
            if "answer" in record:
                raise where.error("give either 'answer' (with 'checker') or 'program', not both")
            program = field(record, "program", str, where)
            prompt = field(record, "prompt", str, where, required=False, default="")
            seed = field(record, "seed", int, where, required=False, default=0)
            if seed < 0:
                raise where.error(f"field 'seed' must be >= 0, got {seed}")
            max_turns = field(record, "max_turns", int, where, required=False)
            if max_turns is not None and max_turns < 1:
                raise where.error(f"field 'max_turns' must be >= 1, got {max_turns}")
            tasks.append(FilterTask(record_id(record, where), where.line, hint, prompt,
                                    program=program, seed=seed, max_turns=max_turns,
                                    record=record))
            continue
        prompt = field(record, "prompt", str, where)
        if "answer" not in record:
            raise where.error("missing field 'answer' (or give an environment 'program')")
        answer = field(record, "answer", (str, int, float), where)
        checker = field(record, "checker", str, where)
        if checker not in CHECKERS:
            raise where.error(f"field 'checker': unknown checker {checker!r}; "
                              f"known: {sorted(CHECKERS)}")
        tasks.append(FilterTask(record_id(record, where), where.line, hint, prompt,
                                answer=str(answer), checker=checker, record=record))
    if not tasks:
        raise DataError(f"{path}: no tasks")
    check_unique_ids(tasks, path)
    return tasks
