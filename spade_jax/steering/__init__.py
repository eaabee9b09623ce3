"""Routes of Reasoning: read, identify and steer reasoning behaviour through the MoE router.

Model-independent pieces, all on plain arrays (no model imports here):

  operator   steer_router_logits (eqs. 5-6) and make_steering_hook for the router hook
  schedule   first-answer detectors for the "steer only after the first answer" schedule
  segment    sentence/clause segmenter and label projection onto tokens
  labels     the six behaviours, JSONL label import, the judge protocol and codebook prompt
  probe      L2 multinomial logistic probes on router logits (full-batch, or streamed in
             minibatches from telemetry chunks), macro-F1
  controls   position / TF-IDF / prefix-drop / input-embedding / width-matched residual
             controls for the probes
  experts    risk difference, Top-n expert sets, cross-dataset Jaccard, transfer AUC
  telemetry  chunked on-disk router (and optional residual) traces, resumable

Model-facing (import the model / sampler lazily):

  capture      teacher-forced and generation-time router capture into telemetry
  expert_sets  expert-set files and the hook's per-layer masks
  compare      steered sampler policy and the unmodified/steered/control table
"""

from spade_jax.steering.controls import (
    input_embedding_features,
    project_features,
    width_matched_projection,
)
from spade_jax.steering.experts import (
    MultiJaccardResult,
    ProfileCorrelations,
    RoutingMass,
    SharedExperts,
    multi_dataset_jaccard,
    profile_correlations,
    shared_experts,
    top_n_sweep,
)
from spade_jax.steering.labels import BEHAVIOURS
from spade_jax.steering.operator import (
    CONCISE_SYSTEM_PROMPT,
    SteeringConfig,
    make_steering_hook,
    random_expert_sets_like,
    steer_router_logits,
    validate_expert_sets,
)
from spade_jax.steering.probe import (
    FeatureMoments,
    StreamingEvaluation,
    StreamingProbeConfig,
    StreamingProbeFit,
    evaluate_streaming_probe,
    fit_streaming_probe,
    macro_f1_from_confusion,
    residual_window_features,
    telemetry_feature_chunks,
)

__all__ = [
    "BEHAVIOURS",
    "CONCISE_SYSTEM_PROMPT",
    "SteeringConfig",
    "make_steering_hook",
    "random_expert_sets_like",
    "steer_router_logits",
    "validate_expert_sets",
    "MultiJaccardResult",
    "ProfileCorrelations",
    "RoutingMass",
    "SharedExperts",
    "multi_dataset_jaccard",
    "profile_correlations",
    "shared_experts",
    "top_n_sweep",
    "FeatureMoments",
    "StreamingEvaluation",
    "StreamingProbeConfig",
    "StreamingProbeFit",
    "evaluate_streaming_probe",
    "fit_streaming_probe",
    "input_embedding_features",
    "macro_f1_from_confusion",
    "project_features",
    "residual_window_features",
    "telemetry_feature_chunks",
    "width_matched_projection",
]
