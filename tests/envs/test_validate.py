"""validate_program: the valid corpus passes; each kind of broken program fails with its
reason code; the CLI prints the same report as JSON."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from spade_jax.envs import (
    REASON_CODES,
    EnvPool,
    SandboxConfig,
    validate_program,
)

VALID_DIR = pathlib.Path(__file__).parent / "fixtures" / "valid"
VALID = sorted(VALID_DIR.glob("*.py"))


def _env(reset_body: str, step_body: str, top: str = "import random") -> str:
    return f"""{top}
class Environment:
    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.t = 0
        {reset_body}
    def step(self, action):
        self.t += 1
        {step_body}
"""


BROKEN = {
    "nondeterministic_reset": _env(
        "return str(random.random()), {}", "return 'x', 0.0, self.t >= 3, False, {}"
    ),
    "no_termination": _env("return 'go', {}", "return 'again', 0.0, False, False, {}"),
    "return_out_of_range": _env("return 'go', {}", "return 'x', 0.6, self.t >= 2, False, {}"),
    "program_error": _env(
        "return 'go', {}", "return str(int(action) * 2), 0.0, self.t >= 3, False, {}"
    ),
    "bad_type": _env("return 'go', {}", "return 'x', '1.0', True, False, {}"),
    "load_failed": "raise ValueError('boom')\n" + _env("return 'go', {}", "return 1"),
    "missing_contract": "class Environment:\n    def reset(self, seed=None):\n        return 'x', {}\n",
    "forbidden_import": "import os\n" + _env("return 'go', {}", "return 1"),
    "syntax_error": "class Environment(:\n",
    "timeout": _env("return 'go', {}", "while action == '' or True:\n            pass"),
}  # fmt: skip


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=1.0, load_deadline_s=2.0)) as p:
        yield p


@pytest.mark.parametrize("path", VALID, ids=[p.stem for p in VALID])
def test_valid_corpus_passes(path, pool):
    report = validate_program(path.read_text(), hint="Think about it.", pool=pool)
    assert report.ok, report.reason
    assert report.code == "ok" and report.transcript_hash
    assert "adversarial_actions" in report.checks_passed


def test_multi_turn_partial_rewards_sum_to_one(pool):
    """The lock pays 1/3 per digit; solving it by search sums exactly to 1 (checked here,
    in the trainer, from the per-step rewards)."""
    handle = pool.open((VALID_DIR / "multi_turn_lock.py").read_text())
    handle.reset(seed=11)
    rewards = []
    for digit in range(10):
        result = handle.step(str(digit) * 3)
        rewards.append(result.reward)
        if result.terminated:
            break
    assert result.terminated and result.ok
    assert sum(1 for r in rewards if r > 0) >= 1 and sum(rewards) == pytest.approx(1.0)
    assert handle.episode_return == pytest.approx(1.0)
    handle.close()


@pytest.mark.parametrize("code", sorted(BROKEN))
def test_broken_programs_get_their_reason_code(code, pool):
    report = validate_program(BROKEN[code], pool=pool)
    assert not report.ok
    assert report.code == code, report.reason
    assert report.code in REASON_CODES


def test_hint_must_be_non_empty(pool):
    source = (VALID_DIR / "single_turn_arithmetic.py").read_text()
    assert validate_program(source, hint="   ", pool=pool).code == "bad_hint"
    assert validate_program(source, hint="", pool=pool).code == "bad_hint"
    assert validate_program(source, hint=None, pool=pool).ok


def test_reports_carry_a_stable_reason_code(pool):
    reports = [validate_program(BROKEN[c], pool=pool) for c in ("bad_type", "syntax_error")]
    reports.append(validate_program((VALID_DIR / "multi_turn_lock.py").read_text(), pool=pool))
    assert [r.code for r in reports] == ["bad_type", "syntax_error", "ok"]
    assert all(r.code in REASON_CODES for r in reports)


def test_non_string_source_is_a_type_error():
    with pytest.raises(TypeError, match="must be str"):
        validate_program(b"class Environment: pass")


@pytest.mark.slow
def test_check_cli_prints_json_report(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(BROKEN["return_out_of_range"])
    good = VALID_DIR / "multi_turn_grid.py"
    for path, ok in ((good, True), (bad, False)):
        proc = subprocess.run(
            [sys.executable, "-m", "spade_jax.envs.check", str(path), "--hint", "go left"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        report = json.loads(proc.stdout)
        assert report["ok"] is ok and proc.returncode == (0 if ok else 1), proc.stderr
        assert report["code"] == ("ok" if ok else "return_out_of_range")
        assert "seccomp" in report["isolation"]
    proc = subprocess.run(
        [sys.executable, "-m", "spade_jax.envs.check", str(tmp_path / "missing.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "cannot read" in proc.stderr
