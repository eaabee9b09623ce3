"""benchmarks/device_check.py at tiny shapes on this CPU: every row of the table is
produced (the numbers are noise at these shapes; nothing is asserted on speed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"


@pytest.mark.slow  # two tiny models' sampler and train-step compiles (~60 s)
def test_the_device_check_runs_at_tiny_shapes(tmp_path):
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    assert module.main(["--tiny", f"--out={tmp_path}", "--skip_job"]) == 0
    rows = json.loads((tmp_path / "device_check.json").read_text())
    names = [row["model"] for row in rows]
    assert not [row for row in rows if str(row.get("note", "")).startswith("failed")]
    assert names[0] == "device" and names.count("Qwen3-1.7B") == 2  # default, one-call decode
    assert names.count("Qwen3-30B-A3B-shaped (8 layers), moe_impl=auto") == 1
    assert names.count("Qwen3-30B-A3B-shaped (8 layers), moe_impl=dense") == 1
    assert any(n.startswith("generate (HF") for n in names)
    train = next(row for row in rows if row["model"].startswith("train step"))
    assert 0 < train["MFU"] and train["train tokens/s"] > 0
    assert all(row["prefill tokens/s"] > 0 for row in rows if row["model"].startswith("Qwen3"))
    assert (tmp_path / "device_check.md").read_text().startswith("| model | B |")


@pytest.mark.slow  # a tiny model's sampler compiles and one profiled call (~15 s)
def test_the_decode_profile_runs_at_tiny_shapes(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "decode_profile", SCRIPT.parent / "decode_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--tiny", f"--out={tmp_path}"]) == 0
    printed = capsys.readouterr().out
    for form in ("ours", "heads-major", "jax.nn (xla)"):  # the attention forms, each timed
        assert any(line.split()[:len(form.split())] == form.split() and " ms " in line
                   for line in printed.splitlines()), form
    assert "decode step in the loop" in printed and "the model's step alone" in printed
    # The kernel table read the profiler's trace: a busy line and at least one kernel row.
    table = printed.split("kernels of one call")[1]
    assert " busy " in table and " ms " in table.split("busy", 1)[1]
    assert list(tmp_path.rglob("perfetto_trace.json.gz"))


def test_the_decode_floor_counts_each_weight_matmul_at_its_bytes_or_flops():
    """``decode_step_floor`` against the sum written out by hand for Qwen3-1.7B (the H200
    profile in docs/rollout.md): at B = 256 the weight matmuls are compute-bound; at B = 1
    the floor is the bytes-only roofline."""
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cfg, bandwidth, peak = module.QWEN3_1_7B, 3.26e12, 718e12
    layer_params = 28 * (2048 * 16 * 128 * 2 + 2048 * 8 * 128 * 2 + 3 * 2048 * 6144)
    head_params = 2048 * 151936

    def by_hand(batch, context):
        layers = max(2 * layer_params / bandwidth, 2 * batch * layer_params / peak)
        head = max(2 * head_params / bandwidth, 2 * batch * head_params / peak)
        cache = 2 * batch * context * 28 * 2 * 8 * 128  # bf16 K and V, 28 layers, 8 kv heads
        return layers + head + cache / bandwidth

    floor = module.decode_step_floor(cfg, 256, 192, bandwidth, peak)
    assert floor == pytest.approx(by_hand(256, 192), rel=1e-12)
    assert floor == pytest.approx(2.956e-3, rel=1e-3)  # the figure docs/rollout.md quotes
    assert floor > module.decode_step_bytes(cfg, 256, 192) / bandwidth  # compute-bound
    assert module.decode_step_floor(cfg, 1, 192, bandwidth, peak) == pytest.approx(
        module.decode_step_bytes(cfg, 1, 192) / bandwidth, rel=1e-12)
