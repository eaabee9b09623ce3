"""The run builder (``spade_jax/run.py``): what it hands the SPADE loop. (Resume from its
named checkpoints: tests/cli/test_train_cli.py; the names: tests/test_checkpoint.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import pytest

from spade_jax import run
from spade_jax.experiment import load_experiment


def test_designer_and_hint_samplers_get_the_whole_sampler_config(monkeypatch):
    """16.6: run.py's designer sampling passes max_rows, chunk_steps, compact_batch,
    buckets and the loop's seed through (it used to build its own arguments)."""
    seen = []

    def fake_sample(model, prompts, config, **kwargs):
        seen.append(config)
        assert kwargs["stop_tokens"] == [3, 7]  # the tokenizer's end-of-turn ids, both purposes
        return SimpleNamespace(tokens=[[1] for _ in prompts], logprobs=[[0.0] for _ in prompts],
                               selected_experts=None)

    monkeypatch.setattr(run, "sample", fake_sample)
    tokenizer = SimpleNamespace(eos_ids=frozenset({7, 3}))
    config = load_experiment("tiny", [
        "designer_sampler.max_rows=3", "designer_sampler.chunk_steps=5",
        "designer_sampler.compact_batch=False", "designer_sampler.prompt_bucket_min=32",
        "designer_sampler.new_tokens_bucket=16", "spade.hint_temperature=0.25",
        "spade.hint_top_p=0.9"])
    generate, _ = run.loop_sampling(config, lambda: None, tokenizer=tokenizer, mesh=None)
    generate([[1, 2]], seed=1234, purpose="design")
    generate([[1]], seed=99, purpose="hint")
    design, hint = seen
    assert (design.max_rows, design.chunk_steps, design.compact_batch, design.prompt_bucket_min,
            design.new_tokens_bucket, design.seed) == (3, 5, False, 32, 16, 1234)
    assert design.temperature == config.designer_sampler.temperature
    assert (hint.temperature, hint.max_new_tokens, hint.seed, hint.max_rows) == (
        0.25, config.spade.hint_max_tokens, 99, 3)
    # The recipe's hint writer samples at top-p 0.9 (issue 30 item 15); the designer's own.
    assert (hint.top_p, design.top_p) == (0.9, config.designer_sampler.top_p)
    # Router replay (tiny has it on): the designer's sampler records routing, the
    # untrained hint writer's does not; experts only (no router logits kept on device).
    assert design.return_router == "experts" and not hint.return_router


@pytest.mark.slow  # ~8 s: a transformers checkpoint, a load and two sampler compiles
def test_designer_stops_at_end_of_turn_on_a_checkpoint_whose_end_token_differs(
        tmp_path, chat_tokenizer):
    """Issue 37 item 5: a base checkpoint's config ends documents with <|endoftext|>, while
    a chat turn ends with <|im_end|>. The designer's replies (the loop's ``generate``) stop
    at end-of-turn like the agent's turns, not only at the config's eos. The checkpoint's
    weights are set so that every next token is <|im_end|> (all embeddings equal: one
    hidden state everywhere; the LM head scores only <|im_end|>)."""
    import jax.numpy as jnp
    import numpy as np

    tiny_hf = pytest.importorskip("tiny_hf")
    from spade_jax.experiment import ModelSpec, load_experiment

    im_end, endoftext = (chat_tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    tiny_hf.make_hf_model("dense", tmp_path / "hf", vocab_size=chat_tokenizer.vocab_size,
                          bos_token_id=endoftext, eos_token_id=endoftext)
    model = run.build_model(ModelSpec(hf_checkpoint=str(tmp_path / "hf")), chat_tokenizer,
                            seed=0, mesh=None)
    assert model.config.eos_token_id == endoftext != im_end
    model.embed_vd[...] = jnp.broadcast_to(model.embed_vd[...][:1], model.embed_vd.shape)
    hidden = model(jnp.asarray([[1, 2, 3]]), return_logits=False).hidden[0, 0]
    head = np.zeros(model.lm_head_dv.shape, np.float32)
    head[:, im_end] = 50.0 * np.asarray(hidden) / float(jnp.sum(hidden**2))
    model.lm_head_dv[...] = jnp.asarray(head)
    config = load_experiment("tiny", ["train.router_replay=False",
                                      "designer_sampler.max_new_tokens=8"])
    generate, _ = run.loop_sampling(config, lambda: model, chat_tokenizer, mesh=None)
    prompt = chat_tokenizer.apply_chat_template([{"role": "user", "content": "design"}],
                                                add_generation_prompt=True)
    for purpose in ("design", "hint"):
        tokens, logprobs, _ = generate([list(prompt)], seed=1, purpose=purpose)
        assert tokens == [[im_end]] and len(logprobs[0]) == 1  # not 8 x <|im_end|>


@pytest.mark.slow  # ~10 s: a checkpoint load and a bf16 model per layer (fast tier < 5 min)
def test_a_checkpoint_computes_in_the_run_dtype_in_every_layer(tmp_path):
    """``build_model`` on a checkpoint: the loaders build in fp32, and the run's compute
    dtype must reach every layer (not only the top-level options): its logits equal, bit
    for bit, those of a model built with the run's options and given the same weights, and
    every module agrees on bf16 (so the decode copy can be bf16)."""
    import jax.numpy as jnp
    import numpy as np
    import pytest
    from flax import nnx

    tiny_hf = pytest.importorskip("tiny_hf")
    from spade_jax.experiment import ModelSpec
    from spade_jax.models import Qwen3, load_hf
    from spade_jax.rl.trainer import decode_cast_dtype
    from spade_jax.sharding import MeshConfig

    tiny_hf.make_hf_model("moe", tmp_path / "hf")
    spec = ModelSpec(hf_checkpoint=str(tmp_path / "hf"), dtype="bfloat16")
    tokenizer = SimpleNamespace(vocab_size=tiny_hf.VOCAB, eos_ids=frozenset({1}), pad_id=1)
    model = run.build_model(spec, tokenizer, seed=0, mesh=None)
    assert decode_cast_dtype(model, MeshConfig()) == jnp.dtype("bfloat16")
    loaded, config = load_hf(tmp_path / "hf")
    reference = Qwen3(config, spec.options(), rngs=nnx.Rngs(0))
    nnx.update(reference, nnx.state(loaded, nnx.Param))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, tiny_hf.VOCAB, (2, 9)))
    got, want = model(tokens).logits, reference(tokens).logits
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got, np.float32),
                              np.asarray(loaded(tokens).logits, np.float32))  # not fp32
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
        jnp.dtype("float32")}  # master weights stay fp32
