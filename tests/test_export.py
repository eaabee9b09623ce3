"""`python -m spade_jax.export`: a run checkpoint -> a Hugging Face checkpoint that
transformers (logits), load_hf (parameters, bit for bit) and the evaluate/steer/filter
loader (`load_policy`, greedy text) all read as the trained policy; and its bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hf
import torch
from flax import nnx

from spade_jax import export
from spade_jax.checkpoint import CheckpointConfig, CheckpointManager, named_arrays
from spade_jax.models import ModelConfig, ModelOptions, Qwen3, load_hf
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import TrainConfig, init_train_state
from spade_jax.tokenizers import train_sentencepiece


def _make_run(workdir, *, scan_layers: bool, step: int = 3):
    """A run directory as `python -m spade_jax.train` leaves it: model.json, config.json,
    the trained tokenizer and a TrainState checkpoint (random weights, Adam moments set by
    one fake update so the optimizer state differs from the parameters)."""
    tokenizer = train_sentencepiece(["one two three four five six seven answer " * 4,
                                     "user assistant system\n"], workdir / "tokenizer" / "spm",
                                    vocab_size=300)
    hf = tiny_hf.hf_config("moe", vocab_size=tokenizer.vocab_size).to_dict()
    config = ModelConfig.from_hf(hf)
    model = Qwen3(config, ModelOptions(moe_impl="ragged", scan_layers=scan_layers),
                  rngs=nnx.Rngs(1))
    graphdef, state = init_train_state(model, TrainConfig(
        optimizer=OptimizerConfig(learning_rate=1e-3)), seed=0)
    state = state.replace(step=jnp.asarray(step, jnp.int32))
    export.write_model_spec(workdir, model)
    (workdir / "config.json").write_text(json.dumps({
        "tokenizer": {"path": ""}, "best_checkpoint_metric": "eval/mean/pass@1"}))
    with CheckpointManager(CheckpointConfig(workdir / "checkpoints", async_save=False)) as ckpt:
        ckpt.save(step, named_arrays(state), {"round": step - 1})
    return nnx.merge(graphdef, state.params), tokenizer


class _RecordingArray:
    """Wraps a TensorStore array; records the size of every read (streaming check)."""

    def __init__(self, array, reads: list[int]) -> None:
        self.array, self.reads, self.shape = array, reads, array.shape

    def __getitem__(self, index):
        return _RecordingArray(self.array[index], self.reads)

    def read(self):
        self.reads.append(int(np.prod(self.array.shape)))
        return self.array.read()


@pytest.mark.slow  # ~40 s + ~25 s on 2 cores (tokenizer, two models, transformers, sampler)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_export_round_trip_transformers_load_hf_and_load_policy(tmp_path, monkeypatch,
                                                                 scan_layers):
    workdir, out = tmp_path / "run", tmp_path / "hf"
    trained, tokenizer = _make_run(workdir, scan_layers=scan_layers)
    reads: list[int] = []
    opened = export.CheckpointArrays.open
    monkeypatch.setattr(export.CheckpointArrays, "open",
                        lambda self, *a: _RecordingArray(opened(self, *a), reads))
    assert export.main([f"--workdir={workdir}", f"--out={out}", "--max_shard_gb=0.00005"]) == 0
    # Streamed: no read is larger than one layer's largest parameter (or the embedding).
    config = trained.config
    largest = max(config.vocab_size * config.hidden_size,
                  config.num_experts * config.hidden_size * config.moe_intermediate_size)
    assert reads and max(reads) <= largest
    assert sum(reads) == sum(int(np.prod(v.get_value().shape)) for _, v in
                             nnx.to_flat_state(nnx.state(trained, nnx.Param)))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()  # streamed
    assert (out / "spm.model").read_bytes() == (workdir / "tokenizer" / "spm.model").read_bytes()

    # load_hf: every parameter bit for bit (fp32 export of the fp32 master weights).
    loaded, _ = load_hf(out, options=ModelOptions(scan_layers=scan_layers))
    want = dict(nnx.to_flat_state(nnx.state(trained, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert want.keys() == got.keys()
    for path in want:
        assert np.array_equal(np.asarray(want[path].get_value()),
                              np.asarray(got[path].get_value())), path

    # transformers: the same logits as our model from the checkpoint.
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, tokenizer.vocab_size, (2, 9))
    ours = np.asarray(trained(jnp.asarray(ids)).logits)
    reference_logits = tiny_hf.hf_logits(reference, ids).logits.numpy()
    np.testing.assert_allclose(ours, reference_logits, atol=2e-5, rtol=1e-5)

    # evaluate / steer / filter: load_policy reads the model and the tokenizer from OUT.
    from spade_jax.evaluation import SamplerPolicy, SamplerPolicyConfig, load_policy

    greedy = SamplerPolicyConfig(temperature=0.0)
    policy = load_policy(str(out), config=greedy)
    conversation = [[{"role": "user", "content": "one two three"}]]
    expected = SamplerPolicy(trained, tokenizer, greedy).complete(
        conversation, n=1, seed=0, max_new_tokens=4)
    assert policy.complete(conversation, n=1, seed=0, max_new_tokens=4) == expected


@pytest.mark.slow  # ~26 s loaded: initialises an optimizer state
def test_checkpoint_keys_follow_the_train_state_leaves():
    """param_keys names the same arrays the run stores (``checkpoint.named_arrays`` of its
    TrainState; guards the format), and the names are the variables' tree paths."""
    config = ModelConfig.from_hf(tiny_hf.hf_config("moe").to_dict())
    model = Qwen3(config, ModelOptions(moe_impl="ragged"), rngs=nnx.Rngs(0))
    _, state = init_train_state(model, TrainConfig(), seed=0)
    saved = named_arrays(state)
    flat = dict(nnx.to_flat_state(state.params))
    keys = export.param_keys(config, model.options)
    assert keys.keys() == flat.keys()
    for path, key in keys.items():
        assert key == "params/" + "/".join(map(str, path))
        assert np.array_equal(np.asarray(saved[key]), np.asarray(flat[path].get_value())), path
    assert keys[("layers", 1, "attn", "q_dnh")] == "params/layers/1/attn/q_dnh"
    assert {"step", "rng", "opt_state/1/0/mu/layers/1/attn/q_dnh"} <= saved.keys()


@pytest.mark.slow  # JAX subprocess and a tiny run
def test_export_bad_input_is_a_clear_error(tmp_path, capsys):
    def run(*args: str) -> str:
        assert export.main(list(args)) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err
        return err

    assert "does not exist" in run(f"--workdir={tmp_path / 'nope'}", f"--out={tmp_path / 'o'}")
    cli = subprocess.run([sys.executable, "-m", "spade_jax.export", f"--workdir={tmp_path / 'x'}",
                          f"--out={tmp_path / 'o'}"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    assert f"run directory {tmp_path / 'x'} does not exist" in cli.stderr
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert "model.json" in run(f"--workdir={empty}", f"--out={tmp_path / 'o'}")

    workdir = tmp_path / "run"
    _make_run(workdir, scan_layers=False, step=3)
    assert "step=7" in run(f"--workdir={workdir}", f"--out={tmp_path / 'o'}", "--step=7")
    assert "eval/mean/pass@1" in run(f"--workdir={workdir}", f"--out={tmp_path / 'o'}",
                                     "--step=best")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert "not empty" in run(f"--workdir={workdir}", f"--out={busy}")
    for step in (workdir / "checkpoints").iterdir():
        if step.name.isdigit():
            (step / "spade_manifest.json").unlink()  # an unfinished save is not exported
    assert "no complete checkpoint" in run(f"--workdir={workdir}", f"--out={tmp_path / 'o'}")
    assert jax.process_count() == 1
