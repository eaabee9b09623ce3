"""The run builder (``spade_jax/run.py``): what it hands the SPADE loop. (Resume from its
named checkpoints: tests/cli/test_train_cli.py; the names: tests/test_checkpoint.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from spade_jax import run
from spade_jax.experiment import load_experiment


def test_designer_and_hint_samplers_get_the_whole_sampler_config(monkeypatch):
    """16.6: run.py's designer sampling passes max_rows, chunk_steps, compact_batch,
    buckets and the loop's seed through (it used to build its own arguments)."""
    seen = []

    def fake_sample(model, prompts, config, **kwargs):
        seen.append(config)
        return SimpleNamespace(tokens=[[1] for _ in prompts], logprobs=[[0.0] for _ in prompts],
                               selected_experts=None)

    monkeypatch.setattr(run, "sample", fake_sample)
    config = load_experiment("tiny", [
        "designer_sampler.max_rows=3", "designer_sampler.chunk_steps=5",
        "designer_sampler.compact_batch=False", "designer_sampler.prompt_bucket_min=32",
        "designer_sampler.new_tokens_bucket=16", "spade.hint_temperature=0.25"])
    generate, _ = run.loop_sampling(config, lambda: None, tokenizer=None, mesh=None)
    generate([[1, 2]], seed=1234, purpose="design")
    generate([[1]], seed=99, purpose="hint")
    design, hint = seen
    assert (design.max_rows, design.chunk_steps, design.compact_batch, design.prompt_bucket_min,
            design.new_tokens_bucket, design.seed) == (3, 5, False, 32, 16, 1234)
    assert design.temperature == config.designer_sampler.temperature
    assert (hint.temperature, hint.max_new_tokens, hint.seed, hint.max_rows) == (
        0.25, config.spade.hint_max_tokens, 99, 3)
    # Router replay (tiny has it on): the designer's sampler records routing, the
    # untrained hint writer's does not; experts only (no router logits kept on device).
    assert design.return_router == "experts" and not hint.return_router
