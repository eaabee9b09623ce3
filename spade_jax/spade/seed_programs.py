"""Seed environment programs written by the project, and loading a user's offline pool.

The seed programs have two uses:

- a short supervised warm-start, so that a tiny policy in the designer role emits programs
  that pass validation (targets built with `prompts.format_designer_output`);
- the default offline pool for the fixed-designer ablation. In the paper that pool comes
  from a strong model; `load_program_pool` reads such a pool from a directory.

Two sets, one per contract the designer can be asked to write (`seed_programs_for`):

- `SEED_PROGRAMS`: games under the "paper" contract (`spade_jax.envs.PROGRAM_CONTRACT`),
  two for each of the project's six skills, 20 to 35 lines, importing only `random` and `re`;
- `TOOL_SEED_PROGRAMS`: tool environments under the "tool" contract
  (`spade_jax.envs.contract.TOOL_CONTRACT`), one for each of three of the recipe's tool
  skills, 25 to 40 lines, importing only `random`; each has a distractor tool the task does
  not need and a check() that gives partial credit.

The programs live as `seed_programs/<name>.py.txt` next to this module (the tool ones as
`tool_<name>.py.txt`). The `.py.txt` suffix keeps them out of imports, test collection and
the ruff run, and `pyproject.toml` ships them as package data. They are kept short so a
small model can reproduce them. Each hint states a fact about the structure of the task or
a strategy. It never gives an instance's answer or a concrete value, because a hint is
fixed text while every seed draws a new instance.
"""

from __future__ import annotations

import dataclasses
import pathlib

from spade_jax.envs.contract import ALL_CONTRACTS, detect_contract

_SOURCE_DIR = pathlib.Path(__file__).with_name("seed_programs")


@dataclasses.dataclass(frozen=True)
class SeedProgram:
    """An environment program with the metadata the SPADE loop needs.

    Attributes:
      name: identifier (file stem); unique within a pool.
      skill: the skill the program exercises (a `Skill.name`, or the pool's label).
      source: the program text, following the contract `contract` names.
      hint: the hint shown to the agent in the hint arm. It is None only for pool programs
        that come without a `.hint.txt` file.
      contract: the program contract it follows (one of
        `spade_jax.envs.contract.ALL_CONTRACTS`): "paper" (`class Environment`),
        "reference" (the recipe's `*Env` games), "tool" (`class ToolEnvironment`) or
        "reference_tool_use" (the recipe's tool games); pass it to `validate_program` /
        `make_env`.
    """

    name: str
    skill: str
    source: str
    hint: str | None
    contract: str = "paper"

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("SeedProgram.name must be non-empty")
        if not self.skill.strip():
            raise ValueError(f"SeedProgram {self.name!r}: skill must be non-empty")
        if not self.source.strip():
            raise ValueError(f"SeedProgram {self.name!r}: source is empty")
        if self.hint is not None and not self.hint.strip():
            raise ValueError(f"SeedProgram {self.name!r}: hint is empty (use None for no hint)")
        if self.contract not in ALL_CONTRACTS:
            raise ValueError(
                f"SeedProgram {self.name!r}: contract must be one of {ALL_CONTRACTS}, "
                f"got {self.contract!r}"
            )


# (file stem, skill, hint). Single-turn and multi-turn programs for each of the six skills.
_SEED_TABLE: tuple[tuple[str, str, str], ...] = (
    (
        "modular_product",
        "math",
        "Reduce each number modulo the divisor before multiplying: (a*b + c) mod m equals "
        "((a mod m) * (b mod m) + c) mod m, so you only multiply numbers smaller than m.",
    ),
    (
        "arithmetic_chain",
        "math",
        "Each step applies to the value after the previous step. If you get a step wrong, "
        "the feedback tells you the true value; continue from that value.",
    ),
    (
        "sort_numbers",
        "algorithms",
        "Negative numbers come first, and a larger absolute value among negatives means "
        "a smaller number. Count the inputs: your list needs exactly as many numbers.",
    ),
    (
        "guess_number",
        "algorithms",
        "Use binary search: always guess the middle of the range that is still possible. "
        "Each 'higher' or 'lower' halves that range.",
    ),
    (
        "height_order",
        "logic",
        "Exactly one person never appears after 'than': that person is the tallest. Chain "
        "the clues from there, since each clue links two neighbours in the final order.",
    ),
    (
        "boolean_constraints",
        "logic",
        "Every constraint is an 'or' of two parts, so one true part is enough. Pick a value "
        "for the variable that appears most often, then fix the others one at a time.",
    ),
    (
        "sequence_next",
        "cognition",
        "Check three patterns: the differences grow by one each step, or each term is the "
        "previous one times a constant, or each term is the sum of the two before it.",
    ),
    (
        "hidden_rule",
        "cognition",
        "The rule is linear, rule(n) = a*n + b. Asking for 0 gives b and asking for 1 gives "
        "a + b, so two questions are enough.",
    ),
    (
        "speed_units",
        "science",
        "1 km/h is 1000 m per 3600 s, so divide km/h by 3.6 to get m/s and multiply m/s by "
        "3.6 to get km/h; one mile is 1.609344 km.",
    ),
    (
        "spring_experiment",
        "science",
        "Stiffness is force over stretch: the weight of G grams is G/1000 * 9.81 N, and "
        "the stretch is reported in centimetres, so convert it to metres before dividing.",
    ),
    (
        "stack_machine",
        "code",
        "Write the target as a product of two digits, or a product plus a digit. Push both "
        "factors and call 'mul', then push the remainder and call 'add' if you need it.",
    ),
    (
        "predict_loop",
        "code",
        "Trace the loop by hand, one line per iteration. Write down i and x after each "
        "step, and apply the 'if' only when x has gone above 50.",
    ),
)


# (file stem, skill, hint) of the "tool" seeds: one for each of three of the recipe's tool
# skills (`spade_jax.spade.skills.TOOL_SKILLS`, names exactly as written there).
_TOOL_SEED_TABLE: tuple[tuple[str, str, str], ...] = (
    (
        "tool_order_status",
        "Data Retrieval",
        "Orders are filed by id, not by customer name: look the customer's order id up "
        "first, read that order's status, and name the status in your final reply.",
    ),
    (
        "tool_stock_levels",
        "State Modification",
        "The tools only change stock by an amount, so read each requested item's current "
        "level and adjust it by the difference; leave every other item untouched.",
    ),
    (
        "tool_room_booking",
        "Multi-Step Workflows",
        "Bookings take a room's id, not its name: find the id, book it once for the "
        "requested hour, then give the booking code exactly as the booking returned it.",
    ),
)


def _load_seed_programs(
    table: tuple[tuple[str, str, str], ...], contract: str = "paper"
) -> tuple[SeedProgram, ...]:
    programs = []
    for name, skill, hint in table:
        path = _SOURCE_DIR / f"{name}.py.txt"
        if not path.is_file():
            raise FileNotFoundError(f"seed program {name!r} is missing its source {path}")
        programs.append(
            SeedProgram(name, skill, path.read_text(encoding="utf-8"), hint, contract)
        )
    return tuple(programs)


SEED_PROGRAMS: tuple[SeedProgram, ...] = _load_seed_programs(_SEED_TABLE)
TOOL_SEED_PROGRAMS: tuple[SeedProgram, ...] = _load_seed_programs(_TOOL_SEED_TABLE, "tool")

# The seed programs of each contract the SPADE loop's designer writes
# (`spade_jax.envs.contract.LOOP_CONTRACTS` minus "reference", which has none).
_SEEDS_BY_CONTRACT: dict[str, tuple[SeedProgram, ...]] = {
    "paper": SEED_PROGRAMS,
    "tool": TOOL_SEED_PROGRAMS,
}


def seed_programs_for(contract: str) -> tuple[SeedProgram, ...]:
    """The seed programs written for `contract`: "paper" -> `SEED_PROGRAMS`, "tool" ->
    `TOOL_SEED_PROGRAMS`. ValueError naming the contract and the choices otherwise."""
    try:
        return _SEEDS_BY_CONTRACT[contract]
    except (KeyError, TypeError):
        raise ValueError(
            f"no seed programs for contract {contract!r}; expected one of "
            f"{sorted(_SEEDS_BY_CONTRACT)}"
        ) from None


def load_program_pool(
    directory: str | pathlib.Path, *, skill: str = "any"
) -> tuple[SeedProgram, ...]:
    """Reads an offline program pool from `directory`, sorted by file name.

    Two layouts:
    - the recipe's: `directory/games/game_*.py`, games in the reference contract, no hints
      (when that folder holds such files, nothing else is read);
    - this project's: every `*.py` file in `directory`, a file `NAME.hint.txt` next to
      `NAME.py` giving its hint (None without one); each program's contract is detected
      from its source ("paper" if it defines a top-level `class Environment`).

    Every program gets the label `skill`. This serves the fixed-designer ablation, where
    the pool comes from a strong model. Raises FileNotFoundError or NotADirectoryError for
    a bad path. Raises ValueError for a directory with no programs, and for an empty or
    non-UTF-8 program or hint file. The error names the file.
    """
    from etils import epath  # the pool may be local or remote (gs://...)

    root = epath.Path(directory)
    if not root.exists():
        raise FileNotFoundError(f"program pool directory {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"program pool path {root} is not a directory")
    games = sorted(p for p in (root / "games").glob("game_*.py") if p.is_file())
    if games:
        return tuple(
            SeedProgram(path.stem, skill, _read_text(path, "program"), None, "reference")
            for path in games
        )
    sources = sorted(p for p in root.glob("*.py") if p.is_file())
    if not sources:
        raise ValueError(
            f"program pool directory {root} holds no *.py programs (nor games/game_*.py)"
        )
    pool = []
    for path in sources:
        source = _read_text(path, "program")
        hint_path = path.with_name(f"{path.stem}.hint.txt")
        hint = _read_text(hint_path, "hint").strip() if hint_path.is_file() else None
        pool.append(SeedProgram(path.stem, skill, source, hint, detect_contract(source)))
    return tuple(pool)


def _read_text(path: pathlib.Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} file {path} is not valid UTF-8: {err}") from err
    if not text.strip():
        raise ValueError(f"{what} file {path} is empty")
    return text
