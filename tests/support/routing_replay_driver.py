"""Router replay through the SPADE paths, measured in a fresh process for
``test_router_replay.py`` (exactness needs FMA off on XLA:CPU, read once per process):

    XLA_FLAGS=--xla_cpu_max_isa=AVX python tests/support/routing_replay_driver.py [--default]

A tiny three-layer model (MoE, dense, MoE) samples
  episodes   multi-turn ``run_episodes`` (routing recorded per token, each token keeping
             the call that first fed it) -> ``TrainSequence`` as the loop builds it;
  designer   one ``sample`` call as the loop's designer sampler -> ``DesignerSample`` ->
             JSON (the run state a checkpoint stores) -> back -> ``TrainSequence``;
  steered    episodes under a router hook that allows experts {0, 1} only;
then ``pack_sequences`` packs each set and ``policy_logprobs`` re-scores with and without
replay, and ``ReplayTelemetry`` measures the same batch. Prints one JSON object.
``--default`` uses default numerics (no batch invariance): the control (episodes and
designer only).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax.models import ModelConfig, ModelOptions, Qwen3
from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
from spade_jax.rl.replay_stats import ReplayTelemetry
from spade_jax.rl.train_step import TrainConfig, policy_logprobs
from spade_jax.rl.update_rule import DEFAULT_DESIGNER_RULE, RoleConfig
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig, EpisodeSpec, run_episodes
from spade_jax.rollout.routing import compact_routing
from spade_jax.rollout.sampler import sample
from spade_jax.spade.loop import _designer_episode
from spade_jax.spade.window import DesignerSample
from spade_jax.tokenizers import train_sentencepiece

TEMPERATURE = 0.8
ALLOWED = (0, 1)  # the steered run's experts


class CountingEnv(gymnasium.Env):
    """Three steps, then terminated; observations name the step."""

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return f"start seed {seed}", {}

    def step(self, action):
        self.t += 1
        return f"obs {self.t}", 0.5, self.t == 3, False, {}


def build(invariant: bool, vocab: int) -> Qwen3:
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=vocab, hidden_size=32, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        mlp_only_layers=(1,))
    return Qwen3(config, ModelOptions(batch_invariant=invariant), rngs=nnx.Rngs(5))


def steer_hook(logits_btE, layer):
    allowed = jnp.isin(jnp.arange(logits_btE.shape[-1]), jnp.asarray(ALLOWED))
    return jnp.where(allowed, logits_btE, -1e9)


def episodes(model, tokenizer, hook=None) -> list[TrainSequence]:
    config = AgentLoopConfig(
        max_turns=3, max_turn_tokens=6,
        sampler=SamplerConfig(max_new_tokens=6, temperature=TEMPERATURE, seed=2,
                              return_router=True))
    specs = [EpisodeSpec(CountingEnv(), f"env{i}", seed=i) for i in range(3)]
    records = run_episodes(model, tokenizer, specs, config, router_hook=hook, seed=7)
    for rec in records:
        assert rec.routing is not None and rec.routing.dtype == np.uint8
        assert len(rec.routing) == len(rec.token_ids) - 1, (rec.routing.shape, len(rec.token_ids))
    return [TrainSequence(r.token_ids, r.loss_mask, r.logprobs, 1.0, "agent", routing=r.routing)
            for r in records]


def designer(model) -> tuple[list[TrainSequence], int]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (9, 4, 13)]
    out = sample(model, prompts, SamplerConfig(max_new_tokens=10, temperature=TEMPERATURE,
                                               seed=3, return_router=True), stop_tokens=[])
    seqs, state_bytes = [], 0
    for p, t, lp, r in zip(prompts, out.tokens, out.logprobs, out.selected_experts, strict=True):
        s = DesignerSample(slot=0, skill="x", prompt_ids=p, output_ids=list(t),
                           output_logprobs=list(lp), env_id="e",
                           routing=compact_routing(r, model.config.num_experts))
        text = json.dumps(s.to_json())  # the run state a checkpoint stores
        state_bytes += len(text)
        back = DesignerSample.from_json(json.loads(text))
        assert np.array_equal(back.routing, s.routing) and back.routing.dtype == np.uint8
        ep = _designer_episode(back)  # as the loop hands it to the update rule
        seqs.append(TrainSequence(ep.token_ids, ep.loss_mask, ep.logprobs, 1.0, "designer",
                                  routing=ep.routing))
    return seqs, state_bytes


class Measure:
    """Re-scores packed sequences with and without replay and measures their telemetry.
    One instance per model: its jitted programs are traced and lowered once, not again
    for every set (the exact run from a cold compile cache: 94 -> 91 s, 2026-12-07)."""

    def __init__(self, model):
        cfg = model.config
        self.moe = tuple(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
        self.num_layers = cfg.num_layers
        self.graphdef, self.params = nnx.split(model)
        graphdef = self.graphdef
        self.rescore = jax.jit(lambda p, b, replay: policy_logprobs(
            nnx.merge(graphdef, p), b, replay, temperature=TEMPERATURE)[0], static_argnums=2)
        roles = TrainConfig(
            agent=RoleConfig(temperature=TEMPERATURE),
            designer=dataclasses.replace(DEFAULT_DESIGNER_RULE, temperature=TEMPERATURE))
        self.telemetry = ReplayTelemetry(graphdef, roles)

    def __call__(self, seqs: list[TrainSequence]) -> dict:
        # One 128-token bucket for every set (the episodes fill ~110 tokens, the designer
        # samples ~25): the three sets pack to one [3, 128] shape, so the re-scoring and
        # the telemetry compile once, not again for the designer's shorter rows.
        batch = pack_sequences(seqs, PackConfig(buckets=(128, 256), moe_layers=self.moe,
                                                num_layers=self.num_layers))
        mask = np.asarray(batch.loss_mask) > 0
        old = np.asarray(batch.old_logp)[mask]
        out = {"tokens": int(mask.sum())}
        for name, replay in (("replay", True), ("free", False)):
            gap = np.abs(np.asarray(self.rescore(self.params, batch, replay))[mask] - old)
            out[f"differing_{name}"], out[f"max_gap_{name}"] = int((gap > 0).sum()), float(gap.max())
        telemetry = self.telemetry(self.params, batch)
        out["telemetry"] = {k.split("/", 1)[1]: v for k, v in telemetry.items()}
        fed = np.asarray(batch.attention_mask)[:, 1:] > 0  # positions that feed a next token
        routes = [np.asarray(batch.routing_replay[layer])[:, :-1][fed] for layer in self.moe]
        out["recorded_experts"] = sorted({int(e) for r in routes for e in r.ravel()})
        return out


def main() -> None:
    invariant = "--default" not in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        text = ["start seed obs alpha beta 0 1 2 3 4 5 6 7 8 9 " * 4, "user assistant\n"]
        tokenizer = train_sentencepiece(text, Path(tmp) / "tok", vocab_size=300)
        model = build(invariant, tokenizer.vocab_size)
        designer_seqs, state_bytes = designer(model)
        measure = Measure(model)
        report = {
            "episodes": measure(episodes(model, tokenizer)),
            "designer": measure(designer_seqs),
            "designer_state_bytes": state_bytes,
        }
        if invariant:  # the default-numerics run checks the replay bound only: a steered
            # pass would compile a second agent loop (the hook) that nothing reads
            report["steered"] = measure(episodes(model, tokenizer, hook=steer_hook))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
