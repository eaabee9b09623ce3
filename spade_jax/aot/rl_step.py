"""An RL step estimate from the plan's cost model: sampling a step's episodes (prefill and
decode at the batch the slot engine keeps), resharding the weights for the sampler, and the
train step, as seconds per step and generated tokens per second per chip.

This is a roofline *estimate*, not a measurement: every call costs max(FLOPs / peak, HBM
bytes / HBM bandwidth, ICI bytes / ICI bandwidth) of :func:`~spade_jax.aot.cost.
analytic_cost` (perfect overlap, no launch or host time, no env steps, no stragglers), at
shapes set by :class:`EpisodeShape`, an assumption about the episodes (the plan has no
data). Episodes per step are the plays of the step's games plus the hint plays of a
regeneration step spread over the regeneration interval; the designer's samples are left
out. Every slot is assumed busy (continuous batching with equal episodes) and every decode
step attends over the whole cache (as the engine's masked attention does).

The public anchor to compare with: about 925 generated tokens/s per H100 for Qwen3-30B-A3B
GRPO at 4k-token responses (an H100 has 990 TFLOP/s bf16 dense and 3.35 TB/s HBM; a v5p chip
459 TFLOP/s and 2.77 TB/s).
"""

from __future__ import annotations

import dataclasses
import math

from spade_jax.aot.cost import Parallelism, analytic_cost

ANCHOR_TOKENS_PER_SECOND_PER_H100 = 925.0  # Qwen3-30B-A3B GRPO, 4k tokens (public report)


@dataclasses.dataclass(frozen=True)
class EpisodeShape:
    """The assumed shape of one episode (the estimate's inputs; defaults: 4k generated
    tokens, as the anchor).

    Attributes:
      turns: policy turns per episode.
      turn_tokens: tokens generated per turn.
      prompt_tokens: the first turn's prompt (system, rules, first observation).
      observation_tokens: tokens added between turns (template pieces + observation).
    """

    turns: int = 8
    turn_tokens: int = 512
    prompt_tokens: int = 1024
    observation_tokens: int = 128

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"EpisodeShape.{f.name} must be >= 1, got {getattr(self, f.name)}")

    @property
    def generated(self) -> int:
        return self.turns * self.turn_tokens

    @property
    def context(self) -> int:
        """Tokens of the finished episode (its KV cache and its training row)."""
        return self.prompt_tokens + self.generated + (self.turns - 1) * self.observation_tokens


@dataclasses.dataclass(frozen=True)
class RlStepEstimate:
    """Seconds of one RL step with the sampler's weights in ``layout`` (see module doc)."""

    layout: str
    episodes: int  # per step
    generated_tokens: int  # per step, whole slice
    slots: int  # decode rows the engine keeps
    cache_len: int
    decode_steps: int
    decode_seconds: float  # all decode steps
    decode_bound: str  # the roofline term of one decode step
    prefill_seconds: float
    reshard_seconds: float
    train_seconds: float
    train_shape: str
    chips: int

    @property
    def seconds(self) -> float:
        return self.decode_seconds + self.prefill_seconds + self.reshard_seconds + self.train_seconds

    @property
    def tokens_per_second_per_chip(self) -> float:
        return self.generated_tokens / self.seconds / self.chips


def _roofline(cost: dict[str, float], chip, chips: int) -> tuple[float, str]:
    terms = {"compute": cost["hardware_flops"] / chips / chip.peak_flops,
             "HBM": cost["hbm_traffic"] / chip.hbm_bandwidth,
             "ICI": cost["ici_traffic"] / chip.ici_bandwidth}
    bound = max(terms, key=terms.get)
    return terms[bound], bound


def episodes_per_step(spade) -> int:
    """The step's plays, plus a regeneration step's hint plays spread over its interval."""
    hint = spade.envs_per_round * spade.hint_plays / max(1, spade.regeneration_interval)
    return spade.envs_per_round * spade.plays_per_game + math.ceil(hint)


def estimate_rl_step(experiment, arch, options, *, layout: str, train_par: Parallelism,
                     decode_par: Parallelism, chip, reshard_bytes: float, param_itemsize: int,
                     cache_itemsize: int, episode: EpisodeShape,
                     decode_itemsize: float | None = None) -> RlStepEstimate:
    """The step's costs under one decode layout (``decode_par``: its mesh's parallelism).
    ``param_itemsize``: the master parameters' (the train step); ``decode_itemsize``: bytes
    per parameter of the weights the samplers read (default: the master's)."""
    from spade_jax.rollout.sampler import next_pow2, round_up  # jax: imported late

    chips = train_par.chips
    episodes = episodes_per_step(experiment.spade)
    slots = min(episodes, experiment.agent.decode_slots or episodes)
    rows = round_up(slots, decode_par.batch)
    cache_len = next_pow2(episode.context)
    sampler = dict(param_itemsize=decode_itemsize or param_itemsize)
    step, bound = _roofline(analytic_cost(
        "decode", arch, options, decode_par, rows=rows, length=1, keys=cache_len,
        cache_itemsize=cache_itemsize, **sampler), chip, chips)
    decode_steps = math.ceil(episodes * episode.generated / rows)
    prefill = _roofline(analytic_cost(  # the first turn's prompts, then each observation
        "prefill", arch, options, decode_par, rows=rows, length=episode.prompt_tokens,
        keys=cache_len, **sampler), chip, chips)[0] * math.ceil(episodes / rows)
    prefill += (episode.turns - 1) * math.ceil(episodes / rows) * _roofline(analytic_cost(
        "prefill", arch, options, decode_par, rows=rows, length=episode.observation_tokens,
        keys=cache_len, **sampler), chip, chips)[0]
    train = experiment.train
    train_rows = round_up(episodes, train.microbatches * train_par.batch)  # one row each
    train_seconds = _roofline(analytic_cost(
        "train", arch, options, train_par, rows=train_rows, length=cache_len, keys=cache_len,
        microbatches=train.microbatches, param_itemsize=param_itemsize), chip, chips)[0]
    return RlStepEstimate(
        layout=layout, episodes=episodes, generated_tokens=episodes * episode.generated,
        slots=rows, cache_len=cache_len, decode_steps=decode_steps,
        decode_seconds=decode_steps * step, decode_bound=bound, prefill_seconds=prefill,
        reshard_seconds=reshard_bytes / chip.ici_bandwidth, train_seconds=train_seconds,
        train_shape=f"B={train_rows} T={cache_len} M={train.microbatches}", chips=chips)
