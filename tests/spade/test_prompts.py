"""SPADE role prompts, the designer-output parser and the seed environment programs.

- Every seed program passes the real sandboxed `validate_program` with its hint.
- Solvers written here read each opening observation, re-derive the answer and reach return
  1. A blank action does not, so each reward distinguishes right from wrong.
- The parser round-trips `format_designer_output`. It agrees with markdown-it-py, an
  independent CommonMark parser, on the block it picks, and never raises on random text.
- The prompt builders include or omit exactly the parts each ablation arm asks for.
"""

from __future__ import annotations

import hashlib
import math
import random
import re

import pytest
from memory_records import record_from_reward

from spade_jax.envs import PROGRAM_CONTRACT, EnvPool, SandboxConfig, validate_program
from spade_jax.rollout.agent_loop import ActionParser
from spade_jax.spade.env_stats import formula_reveal
from spade_jax.spade.prompts import (
    AGENT_SYSTEM_PROMPT,
    DESIGNER_SYSTEM_PROMPT,
    PARSE_FAILURE_CODES,
    DesignerOutput,
    ParseFailure,
    agent_first_observation,
    agent_system_prompt,
    designer_user_prompt,
    format_designer_output,
    parse_designer_output,
    reference_designer_user_prompt,
)
from spade_jax.spade.reward import designer_reward
from spade_jax.spade.seed_programs import (
    SEED_PROGRAMS,
    SeedProgram,
    load_program_pool,
)
from spade_jax.spade.skills import MAIN_SKILLS

BY_NAME = {program.name: program for program in SEED_PROGRAMS}

# --------------------------------------------------------------------------- seed programs


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig()) as p:
        yield p


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_seed_program_passes_sandboxed_validation(name, pool):
    program = BY_NAME[name]
    report = validate_program(program.source, hint=program.hint, pool=pool)
    assert report.ok, f"{name}: {report.reason}"


def test_seed_library_covers_every_main_skill():
    assert len(SEED_PROGRAMS) >= 12
    assert len(BY_NAME) == len(SEED_PROGRAMS), "seed program names must be unique"
    assert {p.skill for p in SEED_PROGRAMS} == {skill.name for skill in MAIN_SKILLS}
    for skill in MAIN_SKILLS:
        assert sum(p.skill == skill.name for p in SEED_PROGRAMS) >= 2, skill.name
    assert len({p.hint for p in SEED_PROGRAMS}) == len(SEED_PROGRAMS)
    for program in SEED_PROGRAMS:
        lines = program.source.strip().splitlines()
        assert 10 <= len(lines) <= 40, f"{program.name} has {len(lines)} lines"
        imports = set(re.findall(r"^(?:import|from) (\w+)", program.source, re.M))
        assert imports <= {"random", "re"}, f"{program.name} imports {imports}"


def _load(source: str):
    namespace: dict = {}
    exec(compile(source, "<seed program>", "exec"), namespace)  # our own trusted source
    return namespace["Environment"]()


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


# Solvers: each reads the observations and derives the answer without the program's state.
def _solve_modular_product(obs, history, memo):
    a, b, c, m = _ints(obs)
    return str((a * b + c) % m)


def _solve_arithmetic_chain(obs, history, memo):
    ops = {"add": lambda x, n: x + n, "subtract": lambda x, n: x - n}
    ops["multiply by"] = lambda x, n: x * n
    value = memo.get("value", _ints(history[0])[0])
    name, n = re.search(r"of 4: (add|subtract|multiply by) (\d+)", obs).groups()
    memo["value"] = ops[name](value, int(n))
    return str(memo["value"])


def _solve_sort_numbers(obs, history, memo):
    return ", ".join(map(str, sorted(_ints(obs.split(":", 1)[1]))))


def _solve_guess_number(obs, history, memo):
    low, high = memo.get("range", (1, _ints(history[0])[1]))
    if "go higher" in obs:
        low = _ints(obs)[0] + 1
    elif "go lower" in obs:
        high = _ints(obs)[0] - 1
    memo["range"] = (low, high)
    return str((low + high) // 2)


def _solve_height_order(obs, history, memo):
    pairs = re.findall(r"(\w+) is taller than (\w+)", obs)
    shorter = {b for _, b in pairs}
    taller_of = dict(pairs)
    person = next(a for a, _ in pairs if a not in shorter)
    order = [person]
    while order[-1] in taller_of:
        order.append(taller_of[order[-1]])
    return ", ".join(order)


def _solve_boolean_constraints(obs, history, memo):
    body = obs.split("all hold:", 1)[1].split(". Reply", 1)[0]
    clauses = [
        [(lit.split()[-1], lit.split()[0] != "not") for lit in clause.split(" or ")]
        for clause in body.strip().split("; ")
    ]
    for bits in range(16):
        values = {v: bool(bits >> i & 1) for i, v in enumerate("ABCD")}
        if all(any(values[v] == positive for v, positive in c) for c in clauses):
            return " ".join(f"{v}={int(values[v])}" for v in "ABCD")
    raise AssertionError(f"unsatisfiable instance: {obs}")


def _solve_sequence_next(obs, history, memo):
    t = _ints(obs)
    diffs = [b - a for a, b in zip(t, t[1:], strict=False)]
    if all(b - a == 1 for a, b in zip(diffs, diffs[1:], strict=False)):
        return str(t[-1] + diffs[-1] + 1)
    if all(b * t[0] == a * t[1] for a, b in zip(t, t[1:], strict=False)):
        return str(t[-1] * t[1] // t[0])
    return str(t[-1] + t[-2])


def _solve_hidden_rule(obs, history, memo):
    if len(history) == 1:
        return "ask 0"
    if len(history) == 2:
        return "ask 1"
    b, a_plus_b = _ints(history[1])[1], _ints(history[2])[1]
    return f"answer {(a_plus_b - b) * _ints(history[0])[-1] + b}"


def _solve_speed_units(obs, history, memo):
    factors = {("km/h", "m/s"): 1 / 3.6, ("m/s", "km/h"): 3.6, ("mph", "km/h"): 1.609344}
    value, src, dst = re.search(r"at (\d+) (\S+)\. .* in (\S+)\?", obs).groups()
    return f"{int(value) * factors[(src, dst)]:.4f}"


def _solve_spring_experiment(obs, history, memo):
    if len(history) == 1:
        return "hang 1000"
    stretch_m = float(re.search(r"Stretch: ([\d.]+) cm", obs).group(1)) / 100
    return f"k {1.0 * 9.81 / stretch_m:.3f}"


def _solve_stack_machine(obs, history, memo):
    if "plan" not in memo:
        quotient, rest = divmod(_ints(obs)[-2], 9)
        memo["plan"] = ["push 9", f"push {quotient}", "mul", f"push {rest}", "add"]
    return memo["plan"].pop(0)


def _solve_predict_loop(obs, history, memo):
    code = obs.split("\n", 1)[1]
    x, n = (
        int(re.search(r"x = (\d+)", code).group(1)),
        int(re.search(r"range\((\d+)", code).group(1)),
    )
    m = int(re.search(r"x \* (\d+)", code).group(1))
    mod = int(re.search(r"x % (\d+)", code).group(1))
    for i in range(n):
        x = x * m - i
        if x > 50:
            x %= mod
    return str(x)


SOLVERS = {
    name.removeprefix("_solve_"): fn for name, fn in globals().items() if name.startswith("_solve_")
}


def _play(env, seed: int, policy) -> tuple[list[str], float]:
    """One episode in-process; returns the observations seen and the return."""
    obs, _ = env.reset(seed)
    history, memo, total = [obs], {}, 0.0
    for _ in range(64):
        obs, reward, terminated, truncated, _ = env.step(policy(obs, history, memo))
        history.append(obs)
        total += reward
        if terminated or truncated:
            return history, total
    raise AssertionError("episode did not end")


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_seed_program_rewards_a_correct_solver_and_not_a_blank_one(name):
    assert name in SOLVERS, f"write a solver for seed program {name}"
    env = _load(BY_NAME[name].source)
    transcripts = set()
    for seed in range(25):
        history, solved = _play(env, seed, SOLVERS[name])
        opening = history[0]
        assert math.isclose(solved, 1.0), f"{name} seed {seed}: solver got {solved}: {history}"
        assert _play(env, seed, lambda obs, history, memo: "")[1] < 1.0
        assert _play(env, seed, SOLVERS[name])[0] == history  # same seed, same episode
        transcripts.add(tuple(history))
        if BY_NAME[name].skill != "code":  # code prompts show code, which reads as `x = ...`
            assert not formula_reveal(opening), f"{name} opening prints a formula: {opening}"
    assert len(transcripts) >= 10, f"{name}: instances barely depend on the seed"


def test_load_program_pool(tmp_path):
    (tmp_path / "b_env.py").write_text(BY_NAME["sort_numbers"].source)
    (tmp_path / "a_env.py").write_text(BY_NAME["guess_number"].source)
    (tmp_path / "a_env.hint.txt").write_text("  Halve the range each time.\n")
    (tmp_path / "notes.txt").write_text("not a program")
    pool = load_program_pool(tmp_path, skill="math")
    assert [p.name for p in pool] == ["a_env", "b_env"]
    assert pool[0] == SeedProgram(
        "a_env", "math", BY_NAME["guess_number"].source, "Halve the range each time."
    )
    assert pool[1].hint is None and pool[1].source == BY_NAME["sort_numbers"].source

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_program_pool(tmp_path / "missing")
    with pytest.raises(NotADirectoryError):
        load_program_pool(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_program_pool(tmp_path / "empty")
    (tmp_path / "b_env.hint.txt").write_text(" \n")
    with pytest.raises(ValueError, match=r"b_env\.hint\.txt is empty"):
        load_program_pool(tmp_path)


# --------------------------------------------------------------------------- parser

TRICKY_PROGRAMS = [
    "x = 1",
    "x = 1\n",
    "\n\nx = 1\n\n\n",
    "s = '''\n```\ninside a string\n```\n'''\n",
    "s = '````'\nt = '`'\n",
    "x = 'ünïcødé ✓ 漢字'\r\nprint(x)\r\n",
    "   indented = True",
    "def f():\n    return '<hint>not the hint</hint>'\n",
]
TRICKY_HINTS = ["h", "  padded hint  ", "line one\nline two\n", "uses ``` and `code`", "Σ ≥ 0 ✓"]


@pytest.mark.parametrize("program", TRICKY_PROGRAMS)
@pytest.mark.parametrize("hint", TRICKY_HINTS)
def test_format_then_parse_round_trips(program, hint):
    parsed = parse_designer_output(format_designer_output(program, hint))
    assert isinstance(parsed, DesignerOutput)
    assert (parsed.program, parsed.hint) == (program, hint)


def test_seed_programs_round_trip_and_match_markdown_it():
    markdown_it = pytest.importorskip("markdown_it")
    md = markdown_it.MarkdownIt("commonmark")
    for program in SEED_PROGRAMS:
        text = format_designer_output(program.source, program.hint)
        parsed = parse_designer_output(text)
        assert (parsed.program, parsed.hint) == (program.source, program.hint)
        fences = [t for t in md.parse(text) if t.type == "fence" and t.info == "python"]
        assert fences[-1].content == program.source + "\n"


def _random_text(rng: random.Random, pieces: list[str], max_pieces: int) -> str:
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, max_pieces)))


def test_random_round_trips_agree_with_markdown_it():
    """Random programs with backtick runs, tags and blank lines: format either refuses or
    round-trips, and the block markdown-it finds is the same one."""
    markdown_it = pytest.importorskip("markdown_it")
    md = markdown_it.MarkdownIt("commonmark")
    rng = random.Random(0)
    pieces = ["x", "=", " ", "\n", "`", "```", "````", "<hint>", "</hint>", "#", "é", "\t", "py"]
    formatted = 0
    for _ in range(500):
        program = "v" + _random_text(rng, pieces, 30)
        hint = "h" + _random_text(rng, pieces, 8)
        try:
            text = format_designer_output(program, hint)
        except ValueError:
            # A hint tag or a fence line inside the hint cannot survive the format.
            assert re.search(r"</?hint>|^[ \t]{0,3}```", hint, re.M), hint
            continue
        formatted += 1
        parsed = parse_designer_output(text)
        assert (parsed.program, parsed.hint) == (program, hint)
        if "\t" not in program:  # CommonMark expands tabs in some positions
            fences = [t for t in md.parse(text) if t.type == "fence"]
            assert fences[-1].content == program + "\n"
    assert formatted > 250


def test_parser_is_lenient_about_layout():
    untagged = parse_designer_output("```\nx = 1\n```\n<hint>after</hint>")
    assert (untagged.program, untagged.hint) == ("x = 1", "after")
    several = parse_designer_output(
        "<hint>h</hint>\n```python\ndraft = 1\n```\nbetter:\n```py\nfinal = 2\n```\n"
        "```json\n{}\n```"
    )
    assert several.program == "final = 2"
    prefer_python = parse_designer_output("<hint>h</hint>\n```python\na = 1\n```\n```\nb\n```")
    assert prefer_python.program == "a = 1"
    long_fence = parse_designer_output("<hint>h</hint>\n````python\ns = '```'\n````")
    assert long_fence.program == "s = '```'"
    thought = parse_designer_output(
        "<think>maybe <hint>x</hint></think>\n<hint>y</hint>\n```\nz\n```"
    )
    assert thought.hint == "y"
    # The chat template opened the think block: only its end is in the completion.
    injected = parse_designer_output("draft ```python\n</think>\n<hint>y</hint>\n```python\nz\n```")
    assert (injected.program, injected.hint) == ("z", "y")
    unclosed_hint = parse_designer_output("<hint>runs on\n```python\nz = 1\n```")
    assert unclosed_hint.hint == "runs on\n"
    later_hint_wins = parse_designer_output("<hint>a</hint><HINT>b</hint>\n```\nz\n```")
    assert later_hint_wins.hint == "b"
    crlf = parse_designer_output("<hint>h</hint>\r\n```python\r\nx = 1\r\n```\r\n")
    assert crlf.program == "x = 1\r"


@pytest.mark.parametrize(
    ("text", "code"),
    [
        (b"bytes", "not_text"),
        ("<think>never closes ```python\nx\n```", "unterminated_think"),
        ("no code at all <hint>h</hint>", "no_program_block"),
        ("<hint>h</hint>\n```json\n{}\n```", "no_program_block"),
        ("<hint>h</hint>\n```python\nx = 1\n", "unterminated_program_block"),
        ("<hint>h</hint>\n```python\n  \n```", "empty_program"),
        ("```python\nx = 1\n```", "no_hint"),
        ("```python\nx = '<hint>inside</hint>'\n```", "no_hint"),
        ("<hint> \n</hint>```python\nx = 1\n```", "unterminated_program_block"),
        ("<hint> \n</hint>\n```python\nx = 1\n```", "empty_hint"),
    ],
)
def test_parse_failure_codes(text, code):
    failure = parse_designer_output(text)
    assert isinstance(failure, ParseFailure) and not failure.ok
    assert failure.code == code and code in PARSE_FAILURE_CODES


def test_parser_never_raises_on_garbage():
    rng = random.Random(1234)
    pieces = [
        "```",
        "```python",
        "```py\n",
        "\n",
        "<hint>",
        "</hint>",
        "<think>",
        "</think>",
        "x = 1",
        " ",
        "`",
        "\r",
        "\x00",
        "\ud800",
        "漢字",
        "🤖",
        "\u202e",
        "<",
        ">",
    ]
    codes = set()
    for _ in range(3000):
        text = _random_text(rng, pieces, 40)
        if rng.random() < 0.2:
            text = "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 200)))
        result = parse_designer_output(text)
        if isinstance(result, DesignerOutput):
            assert result.raw == text and result.program in text and result.hint in text
            assert result.program.strip() and result.hint.strip()
            codes.add("ok")
        else:
            assert result.code in PARSE_FAILURE_CODES
            codes.add(result.code)
    assert {"ok", "no_program_block", "unterminated_program_block", "no_hint"} <= codes
    # Long adversarial lines finish quickly (no backtracking blow-up).
    parse_designer_output("```" + " " * 100_000 + "`\n" + "<hint" + " " * 100_000)


def test_format_rejects_what_cannot_round_trip():
    for program, hint, message in [
        ("", "h", "program"),
        ("x", "  ", "hint"),
        ("x", "a </hint> b", "tags"),
        ("x = '</think>'", "h", "cannot be written"),
    ]:
        with pytest.raises(ValueError, match=message):
            format_designer_output(program, hint)


# --------------------------------------------------------------------------- prompts


def test_designer_system_prompt_embeds_contract_and_a_parseable_format_example():
    assert PROGRAM_CONTRACT in DESIGNER_SYSTEM_PROMPT
    example = parse_designer_output(DESIGNER_SYSTEM_PROMPT.split("Output format:", 1)[1])
    assert isinstance(example, DesignerOutput) and "class Environment" in example.program
    for phrase in ("frontier", "partial", "formula", "hint"):
        assert phrase in DESIGNER_SYSTEM_PROMPT


def test_agent_prompt_matches_the_action_parser():
    assert "<think>" in AGENT_SYSTEM_PROMPT and "<answer>" not in AGENT_SYSTEM_PROMPT
    assert ActionParser()("<think>plan</think>\n42") == ("42", True)
    tagged = agent_system_prompt("answer")
    assert "<answer>...</answer>" in tagged
    assert ActionParser(answer_tag="answer")("so <answer>42</answer>") == ("42", True)
    with pytest.raises(ValueError, match="answer_tag"):
        agent_system_prompt("not a tag>")


def _record(regime_returns, env_id, program):
    hint_returns, no_hint_returns = regime_returns
    reward = designer_reward(hint_returns, no_hint_returns)
    return record_from_reward(env_id, program, f"hint of {env_id}", "math", 0, reward)


def test_designer_user_prompt_parts():
    docs = ["alpha " * 50, "beta document"]
    frontier = _record(([1.0] * 4, [0.0] * 4), "f", "FRONTIER_PROGRAM = 1")
    mastered = _record(([1.0] * 4, [1.0] * 4), "m", "MASTERED_PROGRAM = 1")
    broken = {
        "program": "BROKEN_PROGRAM = 1",
        "hint": "hb",
        "regime": "intractable",
        "win_rate": 0.0,
        "regret": -0.1,
    }
    assert frontier.regime == "frontier" and mastered.regime == "mastered"

    full = designer_user_prompt(
        "science", docs, [frontier.to_json(), mastered, broken], max_doc_chars=40
    )
    description = next(s.description for s in MAIN_SKILLS if s.name == "science")
    assert "'science'" in full and description in full
    assert "[Document 1]\n" + ("alpha " * 50)[:40] + "\n[... truncated]" in full
    assert "alpha " * 8 not in full and "beta document" in full
    order = [full.index(s) for s in ("FRONTIER_PROGRAM", "MASTERED_PROGRAM", "BROKEN_PROGRAM")]
    assert order == sorted(order)
    assert "<hint>hint of f</hint>" in full and "regret +1.00" in full and "regret -0.10" in full
    assert "too easy" in full and "too hard" in full

    no_corpus = designer_user_prompt("science", [], [broken], max_doc_chars=40)
    assert "Document" not in no_corpus and "BROKEN_PROGRAM" in no_corpus
    no_memory = designer_user_prompt("science", docs, [], max_doc_chars=40)
    assert "[Document 2]" in no_memory and "<hint>" not in no_memory.split("Reply with")[0]
    for regime_word in ("Frontier environments", "Mastered", "Intractable"):
        assert regime_word not in no_memory
    bare = designer_user_prompt("logic", [], [], max_doc_chars=1)
    assert "Document" not in bare and "Frontier" not in bare and "'logic'" in bare


def test_designer_user_prompt_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown skill 'poetry'"):
        designer_user_prompt("poetry", [], [], max_doc_chars=10)
    with pytest.raises(ValueError, match="max_doc_chars"):
        designer_user_prompt("math", [], [], max_doc_chars=0)
    with pytest.raises(ValueError, match="lacks regret"):
        designer_user_prompt(
            "math",
            [],
            [{"program": "x", "hint": "h", "regime": "frontier", "win_rate": 0.5}],
            max_doc_chars=10,
        )
    with pytest.raises(ValueError, match="regime 'easy'"):
        designer_user_prompt(
            "math",
            [],
            [{"program": "x", "hint": "h", "regime": "easy", "win_rate": 0.5, "regret": 0}],
            max_doc_chars=10,
        )
    with pytest.raises(TypeError, match="document 1"):
        designer_user_prompt("math", [3], [], max_doc_chars=10)


def test_designer_user_prompts_are_pinned_byte_for_byte():
    """Both contracts' designer requests (documents cut, every example key spelling, each
    regime, empty sections) hash to the texts they had before their shared helpers were
    factored out; a change to a prompt's wording must update these on purpose."""
    docs = ["alpha " * 50, "beta document"]
    examples = [
        {"program": "A = 1\n", "hint": "ha", "regime": "frontier", "win_rate": 0.25,
         "regret": 0.5},
        {"program_source": "B = 2 ```", "hint": "hb", "regime": "mastered",
         "win_rate_no_hint": 1.0, "regret": -0.125},
        {"source": "C = 3" * 30, "hint": "hc", "regime": "intractable", "win_rate": 0.0,
         "regret": 0.0},
    ]
    texts = [
        designer_user_prompt("science", docs, examples, max_doc_chars=40, max_program_chars=50),
        designer_user_prompt("logic", [], [], max_doc_chars=1),
        reference_designer_user_prompt("science", docs, examples[:2], examples[2:],
                                       max_doc_chars=40, max_program_chars=50),
        reference_designer_user_prompt("logic", [], max_doc_chars=1),
    ]
    assert [hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts] == [
        "ff4353524b86cd37", "22d1c9abf50065b0", "aeb22b9cf4815f7a", "ce4e6377abcab48e"]
    assert texts[2].count("[Document ") == 2 and "C = 3" not in texts[2]  # avoid: one line
    assert "- too hard (agent win rate 0.00): a game without a class" in texts[2]


def test_documents_are_cut_to_words_then_characters():
    """The recipe cuts a document to its first 6000 words: ``max_doc_words`` keeps the
    text up to the end of the n-th word (line breaks kept), before the character cut."""
    doc = "one two\nthree  four five\tsix"
    for prompt in (designer_user_prompt, reference_designer_user_prompt):
        kwargs = {"max_doc_chars": 1000}
        args = ("math", [doc], []) if prompt is designer_user_prompt else ("math", [doc])
        cut = prompt(*args, max_doc_words=4, **kwargs)
        assert "[Document 1]\none two\nthree  four\n[... truncated]" in cut
        assert "five" not in cut
        assert prompt(*args, max_doc_words=6, **kwargs) == prompt(*args, **kwargs)
        assert "[Document 1]\none\n[... truncated]" in prompt(*args, max_doc_words=1, **kwargs)
        both = prompt(*args, max_doc_words=5, max_doc_chars=5)  # characters cut after words
        assert "[Document 1]\none t\n[... truncated]" in both
        with pytest.raises(ValueError, match="max_doc_words must be >= 0"):
            prompt(*args, max_doc_words=-1, **kwargs)


def test_reference_designer_user_prompt_rejects_bad_input():
    with pytest.raises(ValueError, match="max_program_chars must be >= 1"):
        reference_designer_user_prompt("math", [], max_doc_chars=5, max_program_chars=0)
    with pytest.raises(ValueError, match="example 0 lacks regret"):
        reference_designer_user_prompt("math", [], [{"program": "x", "win_rate": 0.5}],
                                       max_doc_chars=5)
    with pytest.raises(TypeError, match="example 0 must be a mapping, got int"):
        reference_designer_user_prompt("math", [], [], [3], max_doc_chars=5)
    with pytest.raises(TypeError, match="memory example 0 must be a mapping, got str"):
        designer_user_prompt("math", [], ["x"], max_doc_chars=5)


def test_hint_reaches_the_agent_only_in_the_hint_arm():
    assert agent_first_observation("Guess a number.", None) == "Guess a number."
    shown = agent_first_observation("Guess a number.", " Use binary search. ")
    assert shown == "Guess a number.\n\nHINT: Use binary search."
    with pytest.raises(ValueError, match="non-empty hint"):
        agent_first_observation("Guess a number.", "  ")
