"""High-entropy token selection ("Beyond the 80/20 Rule", Wang et al. 2025): the policy
gradient is kept only on the highest-entropy share of the tokens, the "forking" tokens where
the policy actually chooses, and dropped on the rest::

    tau   = quantile_{1 - rho}(H_t : t a valid token of the role in this microbatch)
    A'_it = A_it * [H_it >= tau]

A token the policy writes with near certainty (program boilerplate, the answer's closing
brace) then gets no push from a sequence's advantage, so a string of negative advantages on
the programs of one level cannot erode the code around that level's choice; terms that do
not go through the advantage (the KL to the reference) still cover every token. The
paper takes the threshold over the whole batch; here it is over the role's tokens of each
microbatch (the same when ``microbatches`` is 1). Entropy is data: no gradient flows
through the selection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, token_weightings

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class HighEntropyConfig:
    """Settings of high-entropy token selection.

    Attributes:
      top_share: the share of valid tokens, highest entropy first, that keep their
        advantage (the paper's 0.2); 1.0 keeps every token (the identity).
    """

    top_share: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 < self.top_share <= 1.0:
            raise ValueError(f"top_share must be in (0, 1], got {self.top_share}")


@token_weightings.register("high_entropy", config=HighEntropyConfig)
def high_entropy_weighting(
    advantages: Array, entropy: Array, loss_mask: Array, cfg: HighEntropyConfig
) -> tuple[Array, Metrics]:
    """Keeps the advantages of the top ``top_share`` of valid tokens by entropy, zeroes the
    rest. Returns ``[B, T]`` advantages (0 off the mask)."""
    terms.check_token_arrays(loss_mask, entropy=entropy)
    mask = loss_mask.astype(jnp.float32)
    advantages_bt = terms.token_advantages(advantages, loss_mask)
    entropy = jax.lax.stop_gradient(entropy.astype(jnp.float32))
    threshold = jnp.nanquantile(jnp.where(mask > 0, entropy, jnp.nan), 1.0 - cfg.top_share)
    kept_bt = mask * (entropy >= threshold)
    metrics = {
        "high_entropy_threshold": threshold,
        "high_entropy_kept_share": jnp.sum(kept_bt) / jnp.maximum(jnp.sum(mask), 1.0),
    }
    return advantages_bt * kept_bt, metrics
