"""Metrics: the JSONL log and TensorBoard events hold what was written (TensorBoard read
back by decoding the event records directly), bad input fails clearly, non-finite values
survive, only process 0 writes, the progress line's rate/ETA, and the plot entry point."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spade_jax import metrics as metrics_lib


def read_tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Decodes TFRecord-framed Event protos: u64 length, u32 crc, payload, u32 crc."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_writer_logs_jsonl_and_tensorboard(tmp_path):
    with metrics_lib.MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss/pg_loss": jnp.float32(0.5), "reward/mean": np.float64(0.25),
                         "count": 3, "flag": True, "lr": jnp.asarray([1e-3])})
        writer.write(2, {"loss/pg_loss": float("nan"), "reward/mean": jnp.inf,
                         "count": np.int32(4), "flag": False, "lr": -math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: no bare NaN / Infinity
    assert records[0]["step"] == 1 and records[0]["count"] == 3 and records[0]["flag"] == 1
    assert records[0]["loss/pg_loss"] == 0.5 and records[0]["lr"] == pytest.approx(1e-3)
    assert records[1]["loss/pg_loss"] == "NaN" and records[1]["reward/mean"] == "Infinity"
    assert records[1]["lr"] == "-Infinity" and records[1]["count"] == 4
    assert all("wall_time" in r for r in records)

    scalars = read_tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss/pg_loss"][1] == 0.5 and math.isnan(scalars["loss/pg_loss"][2])
    assert scalars["reward/mean"] == {1: 0.25, 2: math.inf}
    assert scalars["count"] == {1: 3.0, 2: 4.0}

    back = metrics_lib.read_metrics(tmp_path)
    steps, values = back["reward/mean"]
    assert steps.tolist() == [1, 2] and values.tolist() == [0.25, math.inf]
    assert math.isnan(back["loss/pg_loss"][1][1])


def test_writer_appends_design_records_across_writers(tmp_path):
    with metrics_lib.MetricsWriter(tmp_path) as writer:
        writer.write_designs(0, [{"verdict": "valid", "level": 3, "reply": "LEVEL = 3"}])
        writer.write_designs(1, [])
    with metrics_lib.MetricsWriter(tmp_path) as writer:  # a resumed run continues the file
        writer.write_designs(2, [{"verdict": "invalid/syntax_error", "level": None, "reply": ""},
                                 {"verdict": "valid", "level": 1, "reply": "x"}])
    records = [json.loads(line) for line in
               (tmp_path / metrics_lib.DESIGNS_FILE).read_text().splitlines()]
    assert [(r["step"], r["verdict"], r["level"]) for r in records] == [
        (0, "valid", 3), (2, "invalid/syntax_error", None), (2, "valid", 1)]


def test_writer_rejects_non_scalars_and_reserved_names(tmp_path):
    with metrics_lib.MetricsWriter(tmp_path, metrics_lib.MetricsConfig(tensorboard=False)) as w:
        with pytest.raises(ValueError, match=r"metric 'hist' has shape \(3,\)"):
            w.write(0, {"hist": np.zeros(3)})
        with pytest.raises(ValueError, match="'step' is reserved"):
            w.write(0, {"step": 1})
        with pytest.raises(ValueError, match="metric 'name' has dtype <U3"):
            w.write(0, {"name": np.asarray("abc")})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # nothing half-written
    assert not (tmp_path / "tensorboard").exists()


def test_only_process_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    writer = metrics_lib.MetricsWriter(tmp_path / "run")
    writer.write(0, {"x": 1.0})
    writer.close()
    assert not (tmp_path / "run").exists()
    printed = []
    progress = metrics_lib.Progress(10, print_fn=printed.append)
    assert progress.update(10) is None and printed == []


def test_read_metrics_after_resume_and_torn_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "wall_time": 0.0, "loss": float(s)}) for s in (1, 2, 3)]
    lines += [json.dumps({"step": 3, "wall_time": 1.0, "loss": 30.0}), '{"step": 4, "lo']
    path.write_text("\n".join(lines) + "\n")
    steps, values = metrics_lib.read_metrics(path)["loss"]
    assert steps.tolist() == [1, 2, 3] and values.tolist() == [1.0, 2.0, 30.0]
    assert "metrics.jsonl:5 is not a complete JSON record" in caplog.text
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        metrics_lib.read_metrics(tmp_path / "missing")


def test_progress_line_rate_and_eta():
    now = [100.0]
    printed: list[str] = []
    progress = metrics_lib.Progress(100, start_step=20, every_seconds=10.0,
                                    print_fn=printed.append, clock=lambda: now[0])
    now[0] = 105.0
    first = progress.update(30, {"loss": jnp.float32(0.125)})
    # 10 steps in 5 s -> 2 steps/s; 70 steps left -> 35 s.
    assert first == "step 30/100 (30.0%) | 2 steps/s | elapsed 0:00:05 | ETA 0:00:35 | loss=0.125"
    now[0] = 106.0
    assert progress.update(32) is None  # not due yet
    now[0] = 140.0
    assert "step 100/100 (100.0%)" in progress.update(100) and len(printed) == 2
    slow = metrics_lib.Progress(10, clock=lambda: now[0], print_fn=printed.append)
    now[0] += 250.0
    assert "| 125 s/step |" in slow.update(2)
    with pytest.raises(ValueError, match="start_step"):
        metrics_lib.Progress(10, start_step=11)


@pytest.mark.slow  # JAX subprocess (~10 s loaded)
def test_plot_entry_point_writes_one_png_per_group(tmp_path):
    rng = np.random.default_rng(0)
    with metrics_lib.MetricsWriter(tmp_path, metrics_lib.MetricsConfig(tensorboard=False)) as w:
        for step in range(30):
            w.write(step, {"loss/pg_loss": rng.normal(), "loss/kl": abs(rng.normal()),
                           "reward/mean": step / 30 if step != 7 else float("nan"),
                           "lr": 1e-3})
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
               PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-m", "spade_jax.plot", str(tmp_path), "--smooth", "3"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["loss.png", "misc.png", "reward.png"]
    assert sorted(Path(line).name for line in proc.stdout.split()) == pngs
    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "plots" / "loss.png")
    assert image.shape[0] > 100 and image.shape[1] > 300  # two panels side by side
    assert image[..., :3].std() > 0.01  # not a blank canvas

    missing = subprocess.run([sys.executable, "-m", "spade_jax.plot", str(tmp_path / "nope")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "no metrics file" in missing.stderr
