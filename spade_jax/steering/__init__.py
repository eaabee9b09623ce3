"""Routes of Reasoning: read, identify and steer reasoning behaviour through the MoE router.

Model-independent pieces, all on plain arrays (no model imports here):

  operator   steer_router_logits (eqs. 5-6) and make_steering_hook for the router hook
  schedule   first-answer detectors for the "steer only after the first answer" schedule
  segment    sentence/clause segmenter and label projection onto tokens
  labels     the six behaviours, JSONL label import, the judge protocol and codebook prompt
  probe      L2 multinomial logistic probes on router logits, macro-F1
  controls   position / TF-IDF / prefix-drop controls for the probes
  experts    risk difference, Top-n expert sets, cross-dataset Jaccard, transfer AUC
  telemetry  chunked on-disk router traces

Model-facing (import the model / sampler lazily):

  capture      teacher-forced and generation-time router capture into telemetry
  expert_sets  expert-set files and the hook's per-layer masks
  compare      steered sampler policy and the unmodified/steered/control table
"""

from spade_jax.steering.labels import BEHAVIOURS
from spade_jax.steering.operator import (
    CONCISE_SYSTEM_PROMPT,
    SteeringConfig,
    make_steering_hook,
    random_expert_sets_like,
    steer_router_logits,
    validate_expert_sets,
)

__all__ = [
    "BEHAVIOURS",
    "CONCISE_SYSTEM_PROMPT",
    "SteeringConfig",
    "make_steering_hook",
    "random_expert_sets_like",
    "steer_router_logits",
    "validate_expert_sets",
]
