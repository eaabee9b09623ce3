"""spade_jax.toy.levels: level shares of a run's valid programs, by part of the run."""

import json

import pytest

from spade_jax.toy.levels import format_table, level_shares


def _write(run, records):
    run.mkdir()
    (run / "designs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_level_shares_by_third_count_valid_programs_that_state_a_level(tmp_path):
    run = tmp_path / "run"
    _write(run, [
        {"step": 0, "verdict": "valid", "level": 2}, {"step": 0, "verdict": "valid", "level": 2},
        {"step": 1, "verdict": "valid", "level": 3},
        {"step": 2, "verdict": "invalid/syntax_error", "level": 9},  # not valid: left out
        {"step": 3, "verdict": "valid", "level": 3}, {"step": 4, "verdict": "valid", "level": None},
        {"step": 8, "verdict": "valid", "level": 4}, {"step": 7, "verdict": "valid", "level": 3},
    ])
    # steps 0..8 in thirds: 0-2, 3-5, 6-8
    assert level_shares(run) == [{2: 2 / 3, 3: 1 / 3}, {3: 1.0}, {3: 0.5, 4: 0.5}]
    assert level_shares(run, parts=1) == [{2: 2 / 6, 3: 3 / 6, 4: 1 / 6}]
    table = format_table([run], parts=3).splitlines()
    assert table[0] == "| run | part | L2 | L3 | L4 |" and len(table) == 5
    assert table[4].endswith("| 3/3 | 0.00 | 0.50 | 0.50 |")


def test_a_run_without_designs_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="designs.jsonl"):
        level_shares(tmp_path)
    with pytest.raises(ValueError, match="parts"):
        level_shares(tmp_path, parts=0)
