"""gs:// run directories, for real, against a local GCS emulator the tests start themselves
(tests/support/gcs_emulator.py: fake-gcs-server on 127.0.0.1, no credentials).

0. The pieces, fast: load_hf / load_tokenizer from the bucket equal the local reads,
   metrics.jsonl continues across writers, report.md and plots land in the bucket.
1. The kill -9 resume of tests/support/resume_driver.py (the real GRPO step, asynchronous Orbax
   saves every step) with its run directory in the bucket equals a local run that was never
   interrupted, bit for bit: per-step losses, final TrainState, the last checkpoint.
2. The main command, ``python -m spade_jax.train --experiment=tiny --workdir=gs://...``
   (shortened with --set), writes every file of the run into the bucket and nothing into a
   local ``gs:`` directory, is SIGKILLed once its first checkpoint is complete in the
   bucket, resumes from the bucket, and the exported policy (gs:// -> gs://) loads through
   ``load_hf`` from the bucket with the checkpoint's parameters bit for bit (``--step=best``:
   the step stored with the run's held-out score).
"""

from __future__ import annotations

import csv
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from etils import epath
from gcs_emulator import GcsEmulator
from test_train_resume_kill import (
    _assert_bitwise_equal,
    _checkpoint_leaves,
    _env,
    _finish,
    _load,
    _losses,
    _start,
)

REPO = Path(__file__).resolve().parents[1]


def _upload(local: Path, remote: epath.Path) -> None:
    for path in local.rglob("*"):
        if path.is_file():
            (remote / path.relative_to(local).as_posix()).write_bytes(path.read_bytes())


@pytest.mark.slow
def test_model_tokenizer_metrics_and_report_through_a_bucket(tmp_path, gcs):
    """The pieces one by one: load_hf and load_tokenizer read from gs:// what they read
    locally; metrics.jsonl continues across writers (an object store cannot append);
    report.md and its plots land in the bucket."""
    import tiny_hf
    from flax import nnx

    from spade_jax.metrics import MetricsWriter, read_metrics
    from spade_jax.models import load_hf
    from spade_jax.spade.report import write_report
    from spade_jax.tokenizers import load_tokenizer, train_sentencepiece

    gcs.create_bucket("pieces")
    bucket = epath.Path("gs://pieces")
    tiny_hf.make_hf_model("moe", tmp_path / "hf")
    _upload(tmp_path / "hf", bucket / "hf")
    local, _ = load_hf(tmp_path / "hf")
    remote, _ = load_hf("gs://pieces/hf")
    want = dict(nnx.to_flat_state(nnx.state(local, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(remote, nnx.Param)))
    assert want.keys() == got.keys()
    for path in want:
        assert np.array_equal(np.asarray(want[path].get_value()),
                              np.asarray(got[path].get_value())), path

    tokenizer = train_sentencepiece(["one two three user assistant\n" * 4], tmp_path / "tok" / "spm",
                                    vocab_size=300)
    _upload(tmp_path / "tok", bucket / "tok")
    text = "<|im_start|>user\none two<|im_end|>"
    for path in ("gs://pieces/tok", "gs://pieces/tok/spm.model"):
        assert load_tokenizer(path).encode(text) == tokenizer.encode(text)
    with pytest.raises(FileNotFoundError, match="gs://pieces/nope"):
        load_tokenizer("gs://pieces/nope")

    run = "gs://pieces/run"
    with MetricsWriter(run) as writer:
        writer.write(0, {"loss": 1.0, "eval/x": float("nan")})
        writer.write(1, {"loss": 0.5})
    with MetricsWriter(run) as writer:  # a resumed run: appends, re-logs step 1
        writer.write(1, {"loss": 0.25})
        writer.write(2, {"loss": 0.125})
    steps, values = read_metrics(run)["loss"]
    assert steps.tolist() == [0, 1, 2] and values.tolist() == [1.0, 0.25, 0.125]
    names = gcs.objects("pieces", "run/")
    assert any(n.startswith("run/tensorboard/events.out.tfevents") for n in names)
    report = write_report(run)
    assert str(report) == "gs://pieces/run/report.md"
    assert "## Curves" in report.read_text()
    assert {"run/plots/misc.png", "run/plots/eval.png"} <= set(gcs.objects("pieces", "run/plots/"))

    from spade_jax.spade.seed_programs import load_program_pool

    (tmp_path / "pool" / "games").mkdir(parents=True)
    (tmp_path / "pool" / "a.py").write_text("class Environment:\n    pass\n")
    (tmp_path / "pool" / "a.hint.txt").write_text("try harder\n")
    (tmp_path / "games_pool" / "games").mkdir(parents=True)
    (tmp_path / "games_pool" / "games" / "game_1.py").write_text("def reset():\n    pass\n")
    for name in ("pool", "games_pool"):
        _upload(tmp_path / name, bucket / name)
        assert load_program_pool(f"gs://pieces/{name}") == load_program_pool(tmp_path / name)
    assert [(p.name, p.hint) for p in load_program_pool("gs://pieces/pool")] == [
        ("a", "try harder")]
    assert [p.name for p in load_program_pool("gs://pieces/games_pool")] == ["game_1"]
    _no_local_gs_dir(REPO, Path.cwd(), tmp_path)


def test_evaluate_and_steer_outputs_land_in_a_bucket(tmp_path, gcs, monkeypatch):
    """--out=gs://... for the evaluate and steer commands: their files land in the bucket,
    equal to a local --out, and nothing is written to a local ``gs:`` directory (the hint
    filter's: tests/hint_filter/test_filter.py)."""
    from spade_jax.evaluate import main as evaluate_main
    from spade_jax.steering.compare import CONDITIONS, ConditionResult, table_rows, write_table

    gcs.create_bucket("outs")
    monkeypatch.chdir(tmp_path)  # a wrong local write would land here, as ./gs:/...
    problems = tmp_path / "aime.jsonl"
    problems.write_text(json.dumps({"id": "p1", "problem": "ONE", "answer": "12"}) + "\n")
    script = tmp_path / "policy.json"
    script.write_text(json.dumps({"rules": [{"match": "ONE", "outputs": ["\\boxed{12}"]}]}))
    for out in (tmp_path / "eval", "gs://outs/eval"):
        assert evaluate_main([f"--policy=scripted:{script}", f"--suite=math:{problems}",
                              "--samples=2", f"--out={out}"]) == 0
    for name in ("results.md", "samples.jsonl"):
        assert (epath.Path("gs://outs/eval") / name).read_text() == (
            tmp_path / "eval" / name).read_text(), name
    remote_rows = list(csv.DictReader(io.StringIO(
        epath.Path("gs://outs/eval/results.csv").read_text())))
    local_rows = list(csv.DictReader((tmp_path / "eval" / "results.csv").open()))
    for row in remote_rows + local_rows:
        row.pop("seconds")  # wall time, the one column that differs between runs
    assert remote_rows == local_rows and remote_rows[0]["pass@1"] == "1.0"
    assert (epath.Path("gs://outs/eval") / "results.png").read_bytes()[:4] == b"\x89PNG"

    rows = table_rows([ConditionResult(c, tokens, 0.5, 0.1, 8)
                       for c, tokens in zip(CONDITIONS, (100.0, 80.0, 99.0, 90.0), strict=True)])
    write_table(rows, "gs://outs/steer", "title")
    write_table(rows, tmp_path / "steer", "title")
    assert epath.Path("gs://outs/steer/results.csv").read_text() == (
        tmp_path / "steer" / "results.csv").read_text()
    assert set(gcs.objects("outs", "steer/")) == {
        "steer/results.md", "steer/results.csv", "steer/results.png"}
    _no_local_gs_dir(REPO, tmp_path)


def _no_local_gs_dir(*roots: Path) -> None:
    for root in roots:
        assert not (root / "gs:").exists(), f"a local gs: directory appeared under {root}"


@pytest.mark.slow  # ~1 min on 2 idle cores: one cold compile, then two warm runs
def test_kill_9_resume_from_a_bucket_equals_an_uninterrupted_local_run(tmp_path, gcs):
    gcs.create_bucket("resume")
    cache = tmp_path / "jax_cache"
    straight = tmp_path / "straight"
    killed = epath.Path("gs://resume/killed")
    out = _finish(_start(straight, steps=4, cache_dir=cache))
    assert sorted(_losses(out)) == [1, 2, 3, 4]

    first = _finish(_start(killed, "--kill-after", "2", steps=4, cache_dir=cache,
                           extra_env=gcs.env), expect_rc=-signal.SIGKILL)
    assert "CHECKPOINTED 2" in first
    objects = gcs.objects("resume", "killed/")
    assert {"killed/ckpt/1/spade_manifest.json", "killed/ckpt/2/spade_manifest.json"} <= set(
        objects)
    assert "killed/final.npz" not in objects
    resumed = _finish(_start(killed, steps=4, cache_dir=cache, extra_env=gcs.env))
    assert "RESUMED 2" in resumed and sorted(_losses(resumed)) == [3, 4]
    _no_local_gs_dir(REPO, Path.cwd(), tmp_path)

    # Losses (hex floats) bit for bit: steps 1-2 before the kill, 3-4 after the resume.
    assert {**_losses(first), **_losses(resumed)} == _losses(out)
    _assert_bitwise_equal(_load(straight / "final.npz"), _load(killed / "final.npz"))
    want, want_run_state = _checkpoint_leaves(straight / "ckpt", 4)
    got, got_run_state = _checkpoint_leaves(killed / "ckpt", 4)  # restored from the bucket
    _assert_bitwise_equal(want, got)
    assert want_run_state == got_run_state


SHRINK = [  # the smallest tiny run that still has every phase (warm start short, one eval)
    "--set", "warm_start.steps=2",
    "--set", "spade.rounds=2",
    "--set", "spade.eval_every=2",
    "--set", "eval.suites=('RG-Math',)",
    "--set", "eval.tasks_per_suite=1",
    "--set", "eval.problems_per_task=1",
    "--set", "eval.max_new_tokens=4",
    "--set", "designer_sampler.max_new_tokens=48",
    "--set", "agent.max_turn_tokens=8",
    "--set", "checkpoint_every=1",
]


def _train_command(workdir: str) -> list[str]:
    return [sys.executable, "-m", "spade_jax.train", "--experiment=tiny",
            f"--workdir={workdir}", *SHRINK]


def _kill_after_first_checkpoint(proc: subprocess.Popen, gcs: GcsEmulator, manifest: str,
                                 timeout_s: float = 900) -> None:
    """SIGKILLs ``proc`` as soon as the bucket holds ``manifest`` (the save is complete)."""
    deadline = time.monotonic() + timeout_s
    while manifest not in gcs.objects("runs", manifest):
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"run ended (rc {proc.returncode}) before its first "
                                 f"checkpoint:\n{err[-3000:]}")
        assert time.monotonic() < deadline, "no checkpoint in the bucket in time"
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


@pytest.mark.slow  # a few minutes: two short tiny runs and an export
def test_tiny_run_in_a_bucket_is_killed_resumes_and_exports(tmp_path, gcs):
    gcs.create_bucket("runs")
    env = {**_env(tmp_path / "jax_cache"), **gcs.env}  # the resume reuses the compiles
    workdir = "gs://runs/tiny"
    proc = subprocess.Popen(_train_command(workdir), cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _kill_after_first_checkpoint(proc, gcs, "tiny/checkpoints/1/spade_manifest.json")
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert "tiny/checkpoints/2/spade_manifest.json" not in gcs.objects("runs", "tiny/")

    resumed = subprocess.run(_train_command(workdir), cwd=tmp_path, env=env, text=True,
                             capture_output=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _no_local_gs_dir(tmp_path, REPO)

    objects = gcs.objects("runs", "tiny/")
    for name in ("config.json", "model.json", "metrics.jsonl", "report.md", "train.log",
                 "tokenizer/spm.model", "checkpoints/1/spade_manifest.json",
                 "checkpoints/2/spade_manifest.json"):
        assert objects.get(f"tiny/{name}", 0) > 0, name
    assert any(n.startswith("tiny/tensorboard/events.out.tfevents") and size > 0
               for n, size in objects.items())
    assert any(n.startswith("tiny/plots/") and n.endswith(".png") for n in objects)
    run = epath.Path(workdir)
    assert "resumed from step 0" in (run / "train.log").read_text()
    # Round 0 was logged by the killed run, round 1 by the resumed one: one file, appended.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    # designs.jsonl too: the killed run's step-0 attempts survive the resume's upload.
    designs = [json.loads(line) for line in (run / "designs.jsonl").read_text().splitlines()]
    assert designs and designs[0]["step"] == 0 and all("verdict" in d for d in designs)
    assert "validity_rate" in (run / "report.md").read_text()

    # The last checkpoint, exported bucket -> bucket, loads from the bucket bit for bit.
    from flax import nnx

    from spade_jax import export
    from spade_jax.checkpoint import CheckpointConfig, CheckpointManager, manifest_problem
    from spade_jax.models import load_hf

    assert manifest_problem(run / "checkpoints" / "2", 2) is None  # every file's SHA-256
    # Round 1's held-out score is stored with checkpoint 2 (the best-checkpoint ranking).
    score = json.loads((run / "checkpoints" / "2" / "metrics" / "metrics").read_text())
    assert score == {"eval/mean/pass@1": rows[1]["eval/mean/pass@1"]}
    assert export.main([f"--workdir={workdir}", "--step=best", "--out=gs://runs/exported"]) == 0
    config, options = export.read_model_spec(workdir)
    model, _ = load_hf("gs://runs/exported", options=options)
    with CheckpointManager(CheckpointConfig(run / "checkpoints")) as manager:
        restored = manager.restore(2)
    assert restored.run_state["step"] == 1
    keys = export.param_keys(config, options)
    loaded = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert loaded
    for path, variable in loaded.items():
        assert np.array_equal(np.asarray(variable.get_value()),
                              np.asarray(restored.state[keys[path]])), path
    assert "exported/spm.model" in gcs.objects("runs", "exported/")
