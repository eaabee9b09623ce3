"""Architecture config for the Qwen3 family (dense, MoE, and the shared-expert MoE block).

One frozen dataclass covers Qwen3 (dense), Qwen3-MoE and Qwen2-MoE-style blocks with a
sigmoid-gated shared expert. It is built from a Hugging Face ``config.json`` with
:meth:`ModelConfig.from_hf` and written back with :meth:`ModelConfig.to_hf`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_MODEL_TYPES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}


class ConfigError(ValueError):
    """A config.json or ModelConfig that the model cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen3-family architecture.

    Attributes:
      architecture: Hugging Face architecture name (one of SUPPORTED_ARCHITECTURES).
      vocab_size: V, rows of the embedding table.
      hidden_size: D, residual stream width.
      num_layers: L, decoder layers.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (GQA group = N / K).
      head_dim: H, per-head width (explicit, not D / N, as in Qwen3).
      intermediate_size: F, dense SwiGLU width.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base frequency.
      max_position_embeddings: longest supported position.
      tie_word_embeddings: the LM head reuses the embedding table.
      qkv_bias: bias on q/k/v projections (Qwen2-MoE: True).
      o_bias: bias on the output projection (Qwen3 ``attention_bias``).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3: True, Qwen2-MoE: False).
      num_experts: E, routed experts per MoE layer (0 = dense model).
      num_experts_per_tok: k, experts each token is routed to.
      moe_intermediate_size: per-expert SwiGLU width.
      norm_topk_prob: renormalise the k selected router probabilities to sum to 1.
      decoder_sparse_step: layer i is MoE when (i + 1) % step == 0 (and not mlp-only).
      mlp_only_layers: layers forced to use the dense MLP.
      shared_expert_intermediate_size: width of the sigmoid-gated shared expert (0 = none).
      router_aux_loss_coef: weight of the load-balancing loss when training uses it.
      bos_token_id, eos_token_id, pad_token_id: carried through for export.
    """

    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = 151936
    hidden_size: int = 2560
    num_layers: int = 36
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 9728
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        # Hashable fields only: the config is static metadata of jitted model graphs.
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                    f"{self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size must be positive for an MoE model")
            if self.decoder_sparse_step <= 0:
                raise ConfigError("decoder_sparse_step must be positive")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers {bad} outside [0, {self.num_layers})")
        if self.intermediate_size <= 0 and any(
            not self.is_moe_layer(i) for i in range(self.num_layers)
        ):
            raise ConfigError("intermediate_size must be positive when any layer is dense")

    # ---- structure -------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        """Hugging Face's rule for which layers hold a sparse MoE block."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- parameter counting -----------------------------------------------------------
    def param_count(self, active: bool = False) -> int:
        """Number of parameters (``active=True``: those one token uses, MoE only)."""
        d, h = self.hidden_size, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * h
        total = 0
        for i in range(self.num_layers):
            layer = attn + 2 * d
            if self.is_moe_layer(i):
                experts = self.num_experts_per_tok if active else self.num_experts
                layer += d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
                if self.shared_expert_intermediate_size:
                    layer += 3 * d * self.shared_expert_intermediate_size + d
            else:
                layer += 3 * d * self.intermediate_size
            total += layer
        embed = self.vocab_size * d
        total += embed + d + (0 if self.tie_word_embeddings else embed)
        return total

    # ---- Hugging Face config.json ----------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | Path) -> ModelConfig:
        """Builds a config from a Hugging Face config dict, config.json path or model dir."""
        if not isinstance(hf, dict):
            from etils import epath  # local or gs://

            path = epath.Path(hf)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise ConfigError(f"no config.json at {path}")
            try:
                hf = json.loads(path.read_bytes().decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): {e.reason}") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from e
            except OSError as e:
                raise ConfigError(f"cannot read {path}: {e.strerror}") from None
            if not isinstance(hf, dict):
                raise ConfigError(f"{path} must hold a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(hf.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {arch!r} (model_type={hf.get('model_type')!r}); "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )
        if hf.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=True is not supported")
        rope_params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        num_heads = _require(hf, "num_attention_heads")
        hidden = _require(hf, "hidden_size")
        is_qwen2 = arch == "Qwen2MoeForCausalLM"
        num_experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
        if arch == "Qwen3ForCausalLM":
            num_experts = 0
        return cls(
            architecture=arch,
            vocab_size=_require(hf, "vocab_size"),
            hidden_size=hidden,
            num_layers=_require(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            intermediate_size=hf.get("intermediate_size", 0) or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("qkv_bias", True)) if is_qwen2 else bool(
                hf.get("attention_bias", False)),
            o_bias=False if is_qwen2 else bool(hf.get("attention_bias", False)),
            qk_norm=not is_qwen2,
            num_experts=int(num_experts),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
            moe_intermediate_size=int(hf.get("moe_intermediate_size", 0) or 0) if num_experts else 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0) or 0)
            if is_qwen2 else 0,
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config.json dict that ``transformers`` loads into the same model."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                             else self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.architecture == "Qwen2MoeForCausalLM":
            hf["qkv_bias"] = self.qkv_bias
        else:
            hf["attention_bias"] = self.o_bias
        if self.num_experts:
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        if self.architecture == "Qwen2MoeForCausalLM":
            hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return hf


def _require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ConfigError(f"config.json is missing required field {key!r}")
    return hf[key]


def _arch_from_model_type(model_type: str | None) -> str | None:
    inverse = {v: k for k, v in _MODEL_TYPES.items()}
    return inverse.get(model_type or "")


# ---- presets ------------------------------------------------------------------------
# Published shapes (Hugging Face config.json of each release). The 2507 releases change
# only RoPE theta and the context length.
_QWEN3_4B = ModelConfig(
    vocab_size=151936, hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=9728, tie_word_embeddings=True,
    rope_theta=1_000_000.0, max_position_embeddings=40960,
    bos_token_id=151643, eos_token_id=151645,
)
_QWEN3_8B = _QWEN3_4B.replace(
    hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False
)
_QWEN3_30B_A3B = ModelConfig(
    architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, num_layers=48,
    num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    rope_theta=1_000_000.0, max_position_embeddings=40960, bos_token_id=151643,
    eos_token_id=151645,
)

PRESETS: dict[str, ModelConfig] = {
    "qwen3_4b": _QWEN3_4B,
    "qwen3_4b_instruct_2507": _QWEN3_4B.replace(
        rope_theta=5_000_000.0, max_position_embeddings=262144),
    "qwen3_8b": _QWEN3_8B,
    "qwen3_30b_a3b": _QWEN3_30B_A3B,
    "qwen3_30b_a3b_instruct_2507": _QWEN3_30B_A3B.replace(
        rope_theta=10_000_000.0, max_position_embeddings=262144),
    # The benchmark MoE of the rollout/trainer issues (~17.5M parameters).
    "bench_moe_17m": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=8192, hidden_size=256, num_layers=4,
        num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=768, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
        rope_theta=1_000_000.0, max_position_embeddings=4096,
    ),
}


def preset(name: str) -> ModelConfig:
    """A named preset; raises a KeyError listing the known names."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def human_count(n: int) -> str:
    """4_022_468_096 -> '4.02B'."""
    if n <= 0:
        return str(n)
    exp = min(int(math.log10(n)) // 3, 4)
    return f"{n / 10 ** (3 * exp):.2f}{['', 'K', 'M', 'B', 'T'][exp]}"
