"""spade_jax.compare: arms from config names and --label, the thirds table against a plain
NumPy computation, NaN gaps and sparse keys, the PNG/markdown/CSV outputs, bad input."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from spade_jax import compare

RISE = "return_no_hint_mean"
SPARSE = "eval/toy/pass@1"


def write_run(root: Path, name: str | None, seed: int, series: dict[str, list[float]],
              dirname: str | None = None) -> Path:
    """A run directory: metrics.jsonl with one record per step (NaN as "NaN", as the writer
    stores it) and, unless name is None, config.json with name and seed."""
    run = root / (dirname or f"{name}_s{seed}")
    run.mkdir(parents=True)
    steps = max(len(v) for v in series.values())
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(steps):
            record: dict[str, object] = {"step": step, "wall_time": float(step)}
            for key, values in series.items():
                if step < len(values):
                    value = values[step]
                    record[key] = "NaN" if math.isnan(value) else value
            f.write(json.dumps(record) + "\n")
    if name is not None:
        (run / "config.json").write_text(json.dumps({"name": name, "seed": seed, "lr": 1e-3}))
    return run


def thirds_by_hand(values: list[float]) -> tuple[float, float]:
    """First/last-third means of the finite values, thirds by position (sizes as
    numpy.array_split: the first n % 3 parts one longer)."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    n = len(x)
    size = [n // 3 + (i < n % 3) for i in range(3)]
    return float(x[: size[0]].mean()), float(x[n - size[2]:].mean())


def mean_se_by_hand(x: list[float]) -> tuple[float, float]:
    a = np.asarray(x)
    return float(a.mean()), float(a.std(ddof=1) / np.sqrt(len(a)))


@pytest.fixture
def two_arms(tmp_path: Path) -> dict[str, dict[int, list[float]]]:
    """A rising arm ("rise": 3 seeds, 10 steps, a NaN gap in seed 1) and a flat one
    ("flat": 3 seeds, 12 steps, per-seed last-third shifts of +0.1, -0.1, 0)."""
    rng = np.random.default_rng(0)
    data: dict[str, dict[int, list[float]]] = {"rise": {}, "flat": {}}
    for seed in range(3):
        rising = (np.arange(10) * 0.1 + rng.normal(0, 0.02, 10)).tolist()
        if seed == 1:
            rising[2] = rising[7] = math.nan
        data["rise"][seed] = rising
        flat = (0.5 + rng.normal(0, 0.001, 12)).tolist()
        flat[8:] = [v + (0.1, -0.1, 0.0)[seed] for v in flat[8:]]
        data["flat"][seed] = flat
        write_run(tmp_path, "rise", seed, {RISE: rising})
        write_run(tmp_path, "flat", seed, {RISE: flat})
    return data


def test_thirds_table_matches_numpy(tmp_path, two_arms):
    arms = compare.load_arms([str(tmp_path / "rise_s*"), str(tmp_path / "flat_s*")])
    rows = {r.arm: r for r in compare.thirds_table(arms, [RISE])}
    assert list(rows) == ["rise", "flat"]
    for arm, seeds in two_arms.items():
        thirds = [thirds_by_hand(v) for v in seeds.values()]
        first = mean_se_by_hand([f for f, _ in thirds])
        last = mean_se_by_hand([la for _, la in thirds])
        diff = mean_se_by_hand([la - f for f, la in thirds])
        row = rows[arm]
        assert row.key == RISE and row.seeds == 3
        np.testing.assert_allclose([row.first_mean, row.first_se], first, rtol=1e-12)
        np.testing.assert_allclose([row.last_mean, row.last_se], last, rtol=1e-12)
        np.testing.assert_allclose([row.diff_mean, row.diff_se], diff, rtol=1e-12)
    assert rows["rise"].verdict == "rises"
    assert rows["flat"].verdict == "no clear change"
    assert abs(rows["flat"].diff_mean) < rows["flat"].diff_se


def test_a_falling_arm_and_one_seed():
    def run(values: list[float], seed: int) -> compare.RunCurves:
        steps = np.arange(len(values))
        return compare.RunCurves("r", "x", seed, {"k": (steps, np.asarray(values))})

    falling = [run([3.0, 3.1, 2.0, 2.1, 1.0, 1.2], s) for s in range(2)]
    rows = compare.thirds_table({"down": falling, "one": [run([1, 2, 3], 0)]}, ["k"])
    assert rows[0].verdict == "falls"
    assert rows[1].seeds == 1 and math.isnan(rows[1].first_se) and rows[1].diff_mean == 2.0
    assert rows[1].verdict.startswith("n/a")
    assert "2 ± n/a" in compare.markdown_table(rows)


def test_grouping_by_config_name_puts_seeds_in_one_arm(tmp_path):
    for seed in range(3):
        write_run(tmp_path, "spade_self_generation:toy", seed, {RISE: [0.1, 0.2, 0.3]},
                  dirname=f"a{seed}")
    write_run(tmp_path, "toy", 0, {RISE: [0.1, 0.2, 0.3]}, dirname="b0")
    arms = compare.load_arms([str(tmp_path / "a*"), str(tmp_path / "b0")])
    assert {arm: len(runs) for arm, runs in arms.items()} == {
        "spade_self_generation:toy": 3, "toy": 1}
    assert [r.seed for r in arms["spade_self_generation:toy"]] == [0, 1, 2]


def test_sparse_key_and_nan_gaps_draw_through_their_points(tmp_path, capsys):
    nan = math.nan
    for seed in range(2):
        # Measured every 2nd step; NaN on the others, as metrics.jsonl stores it.
        sparse = [0.1 * step + 0.01 * seed if step % 2 == 0 else nan for step in range(12)]
        write_run(tmp_path, "toy", seed, {RISE: [1.0] * 12, SPARSE: sparse})
    arms = compare.load_arms([str(tmp_path / "toy_s*")])
    steps, mean, se, count = compare.seed_band(arms["toy"], SPARSE)
    np.testing.assert_array_equal(steps, np.arange(0, 12, 2))
    assert np.isfinite(mean).all() and np.isfinite(se).all() and (count == 2).all()
    np.testing.assert_allclose(mean, 0.1 * steps + 0.005)
    row = next(r for r in compare.thirds_table(arms, [SPARSE]))
    expected = [thirds_by_hand([0.1 * s + 0.01 * seed for s in range(0, 12, 2)])
                for seed in range(2)]
    assert row.seeds == 2
    assert row.first_mean == pytest.approx(np.mean([f for f, _ in expected]))
    assert row.last_mean == pytest.approx(np.mean([la for _, la in expected]))

    out = tmp_path / "cmp"
    assert compare.main([str(tmp_path / "toy_s*"), "--keys", f"{RISE},{SPARSE}",
                         "--out", str(out)]) == 0
    assert (out / "compare.png").stat().st_size > 1000


def test_one_seed_steps_have_no_band_but_the_mean_still_draws(tmp_path):
    nan = math.nan
    write_run(tmp_path, "toy", 0, {RISE: [1.0, 2.0, 3.0, 4.0]})
    write_run(tmp_path, "toy", 1, {RISE: [3.0, nan, 5.0]})
    steps, mean, se, count = compare.seed_band(compare.load_arms([str(tmp_path / "toy_s*")])["toy"],
                                               RISE)
    np.testing.assert_array_equal(steps, [0, 1, 2, 3])
    np.testing.assert_allclose(mean, [2.0, 2.0, 4.0, 4.0])
    np.testing.assert_array_equal(count, [2, 1, 2, 1])
    assert np.isnan(se[[1, 3]]).all() and se[0] == pytest.approx(1.0)


def test_main_writes_png_markdown_csv_and_prints_the_table(tmp_path, two_arms, capsys):
    out = tmp_path / "out" / "nested"
    rc = compare.main([str(tmp_path / "rise_s*"), str(tmp_path / "flat_s*"), "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    # Only RISE of the default keys is logged: each other default key warns once.
    for key in compare.DEFAULT_KEYS[1:]:
        assert f"warning: key {key!r} is logged by no run; skipped" in captured.err
    assert (out / "compare.png").stat().st_size > 1000
    markdown = (out / "compare.md").read_text()
    assert captured.out == markdown
    assert f"| `{RISE}` | rise | 3 |" in markdown
    assert f"- `{RISE}`: rise rises; flat no clear change" in markdown
    with open(out / "compare.csv") as f:
        table = list(csv.DictReader(f))
    rows = compare.thirds_table(compare.load_arms([str(tmp_path / "rise_s*"),
                                                   str(tmp_path / "flat_s*")]), [RISE])
    assert [(t["key"], t["arm"], int(t["seeds"]), float(t["diff_mean"]), t["verdict"])
            for t in table] == [(r.key, r.arm, r.seeds, r.diff_mean, r.verdict) for r in rows]
    # An existing --out is fine.
    assert compare.main([str(tmp_path / "rise_s0"), "--keys", RISE, "--out", str(out)]) == 0


def test_a_key_missing_in_some_runs_uses_the_runs_that_have_it(tmp_path):
    write_run(tmp_path, "toy", 0, {RISE: [1.0, 2.0, 3.0], "only_here": [1.0, 1.0, 4.0]})
    write_run(tmp_path, "toy", 1, {RISE: [1.0, 2.0, 3.0]})
    write_run(tmp_path, "other", 0, {RISE: [1.0, 2.0, 3.0]})
    arms = compare.load_arms([str(tmp_path / "*")])
    assert list(arms) == ["other", "toy"]  # the glob expands sorted
    rows = compare.thirds_table(arms, ["only_here", "never"])
    assert len(rows) == 2  # "never" is logged by no run: no rows
    assert (rows[1].arm, rows[1].seeds, rows[1].diff_mean) == ("toy", 1, 3.0)
    assert rows[0].arm == "other" and rows[0].seeds == 0 and rows[0].verdict == "n/a (no data)"


def test_labels_name_arms_and_make_runs_optional(tmp_path, capsys):
    for seed in range(2):
        write_run(tmp_path, None, seed, {RISE: [0.0, 1.0, 2.0]}, dirname=f"base{seed}")
        write_run(tmp_path, "toy", seed, {RISE: [2.0, 2.0, 2.0]}, dirname=f"new{seed}")
    arms = compare.load_arms([], [f"baseline={tmp_path / 'base0'},{tmp_path / 'base1'}",
                                  f"mine={tmp_path / 'new*'}"])
    assert {arm: len(runs) for arm, runs in arms.items()} == {"baseline": 2, "mine": 2}
    out = tmp_path / "cmp"
    assert compare.main(["--label", f"baseline={tmp_path / 'base*'}", "--label",
                         f"mine={tmp_path / 'new*'}", "--keys", RISE, "--out", str(out)]) == 0
    assert "| `return_no_hint_mean` | mine | 2 |" in capsys.readouterr().out


@pytest.mark.parametrize("problem, message", [
    ("not_a_dir", "is not a directory"),
    ("no_metrics", "has no metrics.jsonl"),
    ("label_without_equals", "has no '='"),
    ("no_runs", "no runs given"),
    ("glob_matches_nothing", "matches no run directory"),
    ("no_config", "has no config.json"),
    ("no_key_logged", "none of the keys"),
])
def test_bad_input_exits_2_naming_the_problem(tmp_path, capsys, problem, message):
    good = write_run(tmp_path, "toy", 0, {RISE: [1.0, 2.0, 3.0]})
    (tmp_path / "empty").mkdir()
    write_run(tmp_path, None, 0, {RISE: [1.0]}, dirname="bare")
    argv = {
        "not_a_dir": [str(tmp_path / "missing")],
        "no_metrics": [str(tmp_path / "empty")],
        "label_without_equals": ["--label", str(good)],
        "no_runs": [],
        "glob_matches_nothing": [str(tmp_path / "nothing*")],
        "no_config": [str(tmp_path / "bare")],
        "no_key_logged": [str(good), "--keys", "nope"],
    }[problem]
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
