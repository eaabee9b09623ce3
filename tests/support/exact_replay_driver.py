"""Bit-exactness measurements for ``test_exact_replay.py``, run in a fresh process.

    XLA_FLAGS=--xla_cpu_max_isa=AVX python tests/support/exact_replay_driver.py

Exactness needs FMA off on XLA:CPU (``spade_jax.models.numerics``), and XLA reads its
flags once per process, so the test starts this script with the flag instead of running
in pytest's process. It prints one JSON object of measurements (counts of differing
values, max gaps); the test asserts on them.

What is measured:
  numerics  ordered contractions/sums against a NumPy left-to-right reference, row-subset
            and zero-insertion invariance, position invariance of exp/log;
  decode    KV-cache decode (left-padded prompt, then one token per call) against the
            one-shot forward, looped and scanned layers;
  replay    the production sampler (``rollout.sample``, temperature 0.7, top-p 0.9,
            ragged prompts, routing recorded) against the trainer's ``policy_logprobs``
            with router replay (and without: the trainer's own routing), and the real train
            step's logged gap (two roles, two microbatches); the re-scoring with
            ``batch_invariant=False`` as the control;
  batching  the sampler in batches of 2 prompts (``max_rows``), and prefilled 3 rows a call
            (``max_prefill_tokens``), against all at once;
  sharded   the forward of an HF-loaded MoE on three 8-device meshes against one device
            (the script adds ``--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path

# Eight simulated devices for the sharded check; set before JAX starts its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax
import numpy as np
from flax import nnx

from spade_jax import sharding
from spade_jax.models import ModelConfig, ModelOptions, Qwen3, load_hf, numerics
from spade_jax.rl.batch import ROLES, PackConfig, TrainSequence, pack_sequences
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import (
    RoleConfig,
    TrainConfig,
    init_train_state,
    make_train_step,
    policy_logprobs,
)
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.sampler import sample

VOCAB, TEMPERATURE = 64, 0.7
PROMPT_LENGTHS = (3, 7, 1, 5, 9, 2, 4, 6)


def tiny_moe(invariant: bool, scan: bool = False, seed: int = 3) -> Qwen3:
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=VOCAB, hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        mlp_only_layers=() if scan else (0,),  # scanned layers must all be MoE
    )
    options = ModelOptions(batch_invariant=invariant, scan_layers=scan)
    return Qwen3(config, options, rngs=nnx.Rngs(seed))


def count_diff(a, b) -> int:
    return int(np.sum(np.asarray(a) != np.asarray(b)))


# ---- numerics ---------------------------------------------------------------------------


def numerics_checks() -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 53)).astype(np.float32)
    w = rng.standard_normal((53, 29)).astype(np.float32)
    matmul = jax.jit(lambda a, b: numerics.einsum("md,df->mf", a, b, invariant=True))
    out = np.asarray(matmul(x, w))
    ref = np.zeros((37, 29), np.float32)
    for k in range(53):  # left to right, each product and sum rounded to fp32
        ref = ref + x[:, k:k + 1] * w[k:k + 1, :]
    subset_diff = sum(count_diff(matmul(x[s:s + n], w), out[s:s + n])
                      for n in (1, 3, 8, 9) for s in (0, 5, 28))

    terms = rng.standard_normal((6, 40)).astype(np.float32)
    sums = np.asarray(jax.jit(numerics.ordered_sum)(terms))
    sum_ref = np.zeros(6, np.float32)
    for k in range(40):
        sum_ref = sum_ref + terms[:, k]
    padded = np.insert(terms, [3, 3, 17, 40], 0.0, axis=1)  # exact zeros anywhere: no-ops
    zero_diff = count_diff(jax.jit(numerics.ordered_sum)(padded), sums)

    values = (rng.standard_normal(512) * 20).astype(np.float32)
    position_diff = {}
    for name, fn, dom in (("exp", numerics.exp, values),
                          ("log", numerics.log, np.exp(values / 5).astype(np.float32))):
        f = jax.jit(fn)
        full = np.asarray(f(dom))
        position_diff[name] = sum(count_diff(f(dom[s:s + n]), full[s:s + n])
                                  for n in (1, 2, 3, 5, 9, 13, 33) for s in range(0, 24, 3))
    return dict(matmul_vs_numpy=count_diff(out, ref), matmul_row_subsets=subset_diff,
                sum_vs_numpy=count_diff(sums, sum_ref), sum_zero_insertion=zero_diff,
                position=position_diff)


# ---- decode vs forward --------------------------------------------------------------------


def decode_checks(scan: bool) -> dict:
    model = tiny_moe(invariant=True, scan=scan)
    rng = np.random.default_rng(6)
    ids = rng.integers(2, VOCAB, (2, 12)).astype(np.int32)
    mask = np.ones((2, 12), np.int32)
    mask[1, :3] = 0  # left padding
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    full = jax.jit(lambda i, p, m: model(i, positions_bt=p, attention_mask_bt=m).logits)(
        ids, pos, mask)
    prompt = 5
    step = jax.jit(lambda i, p, m, c: model(i, p, m, cache=c))
    out = step(ids[:, :prompt], pos[:, :prompt], mask[:, :prompt], model.init_cache(2, 20))
    logits, cache = [out.logits], out.cache
    for t in range(prompt, 12):
        out = step(ids[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache)
        logits.append(out.logits)
        cache = out.cache
    decoded = np.concatenate([np.asarray(x) for x in logits], axis=1)
    real = mask.astype(bool)
    return dict(logits_diff=count_diff(decoded[real], np.asarray(full)[real]),
                tokens=int(real.sum()))


# ---- sampler vs trainer -------------------------------------------------------------------


def rollout(model: Qwen3, max_rows: int = 0, max_prefill_tokens: int = 0):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
    config = SamplerConfig(max_new_tokens=12, temperature=TEMPERATURE, top_p=0.9, seed=1,
                           return_router=True, max_rows=max_rows, new_tokens_bucket=16,
                           max_prefill_tokens=max_prefill_tokens)
    return prompts, sample(model, prompts, config, stop_tokens=[])


def to_batch(model: Qwen3, prompts, result):
    seqs = []
    for i, prompt in enumerate(prompts):
        n = len(result.tokens[i])
        routing = [None] * model.config.num_layers
        for j, layer in enumerate(result.moe_layers):
            routing[layer] = result.selected_experts[i][:, j]
        seqs.append(TrainSequence(
            token_ids=prompt + result.tokens[i],
            loss_mask=np.r_[np.zeros(len(prompt)), np.ones(n)],
            logprobs=np.r_[np.zeros(len(prompt)), result.logprobs[i]],
            advantage=float(i % 3) - 1.0, role=i % 2, routing=routing))
    return pack_sequences(seqs, PackConfig(buckets=(32,)))


def replay_checks(invariant: bool, train_step: bool = True) -> dict:
    model = tiny_moe(invariant)
    prompts, result = rollout(model)
    batch = to_batch(model, prompts, result)
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=2)
    def rescore(params, batch, replay):
        return policy_logprobs(nnx.merge(graphdef, params), batch, router_replay=replay,
                               temperature=TEMPERATURE)[0]

    mask = np.asarray(batch.loss_mask) > 0
    gap = np.abs(np.asarray(rescore(params, batch, True))[mask] - np.asarray(batch.old_logp)[mask])
    report = dict(tokens=int(mask.sum()), differing=int((gap > 0).sum()), max_gap=float(gap.max()))
    # Without replay the trainer routes for itself: from bit-identical router logits.
    own = np.asarray(rescore(params, batch, False))[mask]
    report["differing_without_replay"] = int(np.sum(own != np.asarray(batch.old_logp)[mask]))
    if not train_step:
        return report

    config = TrainConfig(
        optimizer=OptimizerConfig(learning_rate=1e-3),
        agent=RoleConfig(policy_loss="grpo", temperature=TEMPERATURE),
        designer=RoleConfig(policy_loss="gspo", temperature=TEMPERATURE),
        router_replay=True, microbatches=2,
    )
    graphdef, state = init_train_state(model, config, seed=0)
    _, metrics = make_train_step(graphdef, config)(state, batch)
    metrics = jax.device_get(metrics)
    report["step_gap_max"] = {r: float(metrics[f"{r}/logp_gap_max"]) for r in ROLES}
    return report


def batching_checks() -> dict:
    model = tiny_moe(invariant=True)
    _, together = rollout(model)
    _, in_pairs = rollout(model, max_rows=2)
    # 8 rows of a 16-token bucket prefilled 3 rows a call (SamplerConfig.max_prefill_tokens)
    _, in_groups = rollout(model, max_prefill_tokens=3 * 16)
    return dict(
        tokens_equal=together.tokens == in_pairs.tokens,
        logprob_diff=sum(count_diff(a, b) for a, b in zip(together.logprobs, in_pairs.logprobs,
                                                          strict=True)),
        prefill_groups=in_groups.stats["prefill_calls"],
        groups_tokens_equal=together.tokens == in_groups.tokens,
        groups_logprob_diff=sum(count_diff(a, b) for a, b in zip(
            together.logprobs, in_groups.logprobs, strict=True)),
    )


def engine_two_turns(model: Qwen3, slots: int, max_prefill_tokens: int = 0,
                     stats: dict | None = None) -> tuple[list, list, list]:
    """Two turns per prompt through the slot engine with ``slots`` slots: the second turn
    extends the first's KV cache (its last token plus a few "observation" tokens). Returns
    per prompt the stream, its loss mask and its log-probs (0 off the mask); ``stats``, if
    given, gets the engine's counters."""
    from collections import deque

    from spade_jax.rollout.engine import Request, SlotEngine

    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
    extra = [rng.integers(2, VOCAB, size=n).tolist() for n in (4, 1, 6, 2, 3, 5, 1, 2)]
    config = SamplerConfig(max_new_tokens=6, temperature=TEMPERATURE, top_p=0.9,
                           chunk_steps=2, new_tokens_bucket=8)
    # 128 cache slots: calls attend over a 64-slot window of them (the trainer: 32)
    engine = SlotEngine(model, slots, config, stop_tokens=[], cache_len=128,
                        max_prefill_tokens=max_prefill_tokens)
    streams = [list(p) for p in prompts]
    masks = [[0] * len(p) for p in prompts]
    logps = [[0.0] * len(p) for p in prompts]
    waiting, holder = deque(range(len(prompts))), {}  # slot -> [prompt index, turn]
    while waiting or holder:
        fresh = []
        for slot in range(engine.num_slots):
            if slot not in holder and waiting:
                holder[slot] = [j := waiting.popleft(), 0]
                fresh.append(Request(slot, prompts[j], True, 6, 1000 + j))
        engine.admit(fresh)
        engine.decode(2)
        follow = []
        for done in engine.finished():
            j, turn = holder[done.slot]
            streams[j] += done.tokens
            masks[j] += [1] * len(done.tokens)
            logps[j] += done.logprobs
            if turn == 0:
                holder[done.slot][1] = 1
                follow.append(Request(done.slot, [done.tokens[-1]] + extra[j], False, 6,
                                      2000 + j))
                streams[j] += extra[j]
                masks[j] += [0] * len(extra[j])
                logps[j] += [0.0] * len(extra[j])
            else:
                del holder[done.slot]
        engine.admit(follow)
    if stats is not None:
        stats.update(engine.stats)
    return streams, masks, logps


def engine_checks() -> dict:
    """Batch-invariant slot engine: 1, 3 or 8 slots, and 8 slots with a prefill budget of
    one 16-token row per admit call (split_admits: it made more calls), give bit-identical
    streams and log-probs, and the trainer's forward over the whole stream re-scores the
    two turns (the second decoded over the reused cache) bit for bit."""
    model = tiny_moe(invariant=True)
    stats: dict[str, dict] = {8: {}, "budget": {}}
    runs = {slots: engine_two_turns(model, slots, stats=stats.get(slots)) for slots in (1, 3, 8)}
    runs["budget"] = engine_two_turns(model, 8, max_prefill_tokens=16, stats=stats["budget"])
    streams, masks, logps = runs[8]
    others = (1, 3, "budget")
    report = dict(
        streams_equal=all(runs[s][0] == streams for s in others),
        logprob_diff=sum(count_diff(np.concatenate(runs[s][2]), np.concatenate(logps))
                         for s in others),
        split_admits=stats["budget"]["prefill_calls"] > stats[8]["prefill_calls"])
    seqs = [TrainSequence(token_ids=t, loss_mask=np.asarray(m), logprobs=np.asarray(lp),
                          advantage=0.0, role=0) for t, m, lp in zip(streams, masks, logps,
                                                                     strict=True)]
    batch = pack_sequences(seqs, PackConfig(buckets=(32,)))
    graphdef, params = nnx.split(model)
    own = jax.jit(lambda p, b: policy_logprobs(nnx.merge(graphdef, p), b, router_replay=False,
                                               temperature=TEMPERATURE)[0])(params, batch)
    mask = np.asarray(batch.loss_mask) > 0
    report["trainer_differing"] = int(np.sum(np.asarray(own)[mask]
                                             != np.asarray(batch.old_logp)[mask]))
    report["tokens"] = int(mask.sum())
    return report


def sharded_checks() -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_hf  # test helper: a random tiny HF checkpoint

    path = Path(tempfile.mkdtemp())
    tiny_hf.make_hf_model("moe", path, num_hidden_layers=3, mlp_only_layers=[0],
                          num_attention_heads=8, num_key_value_heads=2)
    options = ModelOptions(batch_invariant=True)
    ids = np.random.RandomState(8).randint(0, tiny_hf.VOCAB, (8, 6))

    def logits(model):
        graphdef, params = nnx.split(model)
        return np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x).logits)(params, ids))

    reference = logits(load_hf(path, options=options)[0])
    out = {}
    for shape in [(1, 2, 2, 2), (2, 2, 2, 1), (8, 1, 1, 1)]:  # (data, fsdp, tensor, expert)
        mesh = sharding.make_mesh(sharding.MeshConfig(*shape))
        with sharding.activate(mesh):
            out["x".join(map(str, shape))] = count_diff(
                logits(load_hf(path, mesh=mesh, options=options)[0]), reference)
    return out


def main() -> None:
    report = dict(
        exact_cpu_math=numerics.exact_cpu_math_enabled(),
        numerics=numerics_checks(),
        decode={"loop": decode_checks(scan=False), "scan": decode_checks(scan=True)},
        replay={"invariant": replay_checks(True), "default": replay_checks(False, False)},
        batching=batching_checks(),
        sharded=sharded_checks(),
    )
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    if sys.argv[1:] == ["engine"]:  # its own process: the main report is near its timeout
        json.dump(engine_checks(), sys.stdout)
    else:
        main()
