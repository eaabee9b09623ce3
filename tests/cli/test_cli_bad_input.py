"""Command lines given bad input answer with one clear error line and exit status, never a
traceback: envs.check, train (workdir a file / under a file / read-only, also --dry_run),
convert (config.json not UTF-8 / not a JSON object), evaluate and filter (non-UTF-8 file,
named with its line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _cli(module: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", module, *args], capture_output=True,
                          text=True, env=ENV, timeout=300)


def _clean_error(result: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr[-2000:])


@pytest.mark.parametrize("flag", [["--deadline", "-1"], ["--deadline", "0"],
                                  ["--max-turns", "0"]])
def test_envs_check_rejects_bad_numbers(tmp_path, flag):
    program = tmp_path / "p.py"
    program.write_text("class Environment:\n    pass\n")
    _clean_error(_cli("spade_jax.envs.check", str(program), *flag), 2, flag[0].lstrip("-"))


@pytest.mark.slow  # JAX subprocesses (~13 s loaded)
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "run"])
def test_train_workdir_that_is_a_file(tmp_path, dry_run):
    afile = tmp_path / "run.txt"
    afile.write_text("not a directory")
    extra = ["--dry_run"] if dry_run else []
    _clean_error(_cli("spade_jax.train", f"--workdir={afile}", *extra), 2, str(afile),
                 "is a file")
    _clean_error(_cli("spade_jax.train", f"--workdir={afile}/sub/run", *extra), 2,
                 "lies under", str(afile))


@pytest.mark.slow  # JAX subprocess (~14 s loaded)
def test_train_workdir_read_only(tmp_path):
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("needs bubblewrap to make a read-only mount (root ignores mode bits)")
    locked = tmp_path / "locked"
    locked.mkdir()
    prefix = (bwrap, "--bind", "/", "/", "--ro-bind", str(locked), str(locked),
              "--dev", "/dev", "--proc", "/proc", "--")
    for extra in (["--dry_run"], []):
        result = _cli("spade_jax.train", f"--workdir={locked}/run", *extra, prefix=prefix)
        _clean_error(result, 2, "cannot write", str(locked))


@pytest.mark.slow  # JAX subprocess (~6 s loaded)
@pytest.mark.parametrize("content,needle", [
    (b'\xff\xfe{"architectures": 1}', "not UTF-8"),
    (b"[1, 2, 3]", "must hold a JSON object"),
    (b"{not json", "not valid JSON"),
])
def test_convert_bad_config_json(tmp_path, content, needle):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_bytes(content)
    result = _cli("spade_jax.convert", f"--hf_dir={hf_dir}", f"--out_dir={tmp_path / 'out'}")
    _clean_error(result, 1, needle, "config.json")


def _non_utf8(path, first: dict) -> None:
    path.write_bytes(json.dumps(first).encode() + b"\n" + b'{"problem": "caf\xe9"}\n')


@pytest.mark.slow
def test_evaluate_non_utf8_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    _non_utf8(bad, {"problem": "x", "answer": "1"})
    script = tmp_path / "policy.json"
    script.write_text(json.dumps({"rules": []}))
    result = _cli("spade_jax.evaluate", f"--policy=scripted:{script}", f"--suite=math:{bad}",
                  f"--out={tmp_path / 'out'}")
    _clean_error(result, 2, f"{bad}:2: not UTF-8")


@pytest.mark.slow
def test_filter_non_utf8_file_names_file_and_line(tmp_path):
    bad = tmp_path / "tasks.jsonl"
    _non_utf8(bad, {"hint": "h", "prompt": "p", "answer": "1", "checker": "exact"})
    script = tmp_path / "policy.json"
    script.write_text(json.dumps({"rules": []}))
    result = _cli("spade_jax.filter", f"--tasks={bad}", f"--out={tmp_path / 'out'}",
                  f"--policy=scripted:{script}")
    _clean_error(result, 2, f"{bad}:2: not UTF-8")
