"""ModelConfig: one validated view of a checkpoint's config.json.

The three supported architectures share most fields; the ones a given
architecture does not use keep their defaults. V3.2 checkpoints may still say
`model_type: deepseek_v3`, so the indexer fields decide the architecture.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe")
MTP_SUFFIX = "_mtp"
INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


class ConfigError(ValueError):
    """config.json is missing a field or holds a value the runtime cannot run."""


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    is_mtp: bool = False  # a standalone draft directory (`mtp export` output)
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # RoPE
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # YaRN parameters, or None for plain RoPE
    rope_interleave: bool = True  # DeepSeek rotates interleaved pairs
    partial_rotary_factor: float = 1.0
    # MoE (dense MLP for layers < first_k_dense_replace)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # MTP
    num_nextn_predict_layers: int = 0
    # MLA (DeepSeek)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # V3.2 indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # GQA (GLM)
    head_dim: int = 0
    attention_bias: bool = False
    use_qk_norm: bool = False
    # FP8 block quantisation of the stored weights, e.g. [128, 128]; None = not quantised
    fp8_block_size: tuple[int, int] | None = None
    source: str = field(default="config.json", repr=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"{self.source}: unsupported architecture {self.arch!r}; expected one of {ARCHS}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            self._require_positive(name)
        if self.hidden_act != "silu":
            raise ConfigError(f"{self.source}: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.n_routed_experts:
            self._validate_moe()
        if self.arch in ("deepseek_v3", "deepseek_v32"):
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                self._require_positive(name)
            if self.qk_rope_head_dim % 2:
                raise ConfigError(f"{self.source}: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.arch == "deepseek_v32":
            for name in INDEXER_FIELDS:
                self._require_positive(name)
            if self.q_lora_rank is None:
                raise ConfigError(f"{self.source}: deepseek_v32 needs q_lora_rank (the indexer reads the q latent)")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise ConfigError(f"{self.source}: index_head_dim must be >= qk_rope_head_dim")
        if self.arch == "glm4_moe":
            if not self.head_dim:
                self.head_dim = self.hidden_size // self.num_attention_heads
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(
                    f"{self.source}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_key_value_heads ({self.num_key_value_heads})"
                )
            if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
                raise ConfigError(f"{self.source}: partial_rotary_factor {self.partial_rotary_factor} gives "
                                  f"an unusable rotary dim {self.rotary_dim} for head_dim {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.get("factor") is None:
            raise ConfigError(f"{self.source}: rope_scaling of type yarn needs 'factor'")

    def _require_positive(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self.source}: field {name!r} must be a positive integer for {self.arch}, got {value!r}")

    def _validate_moe(self) -> None:
        for name in ("moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group"):
            self._require_positive(name)
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"{self.source}: n_routed_experts ({self.n_routed_experts}) must be divisible by "
                              f"n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ConfigError(f"{self.source}: grouped routing scores each group by its top-2 experts; "
                              f"n_routed_experts / n_group must be >= 2")
        if self.topk_group > self.n_group:
            raise ConfigError(f"{self.source}: topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(f"{self.source}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                              f"experts in topk_group groups ({self.topk_group * per_group})")

    # ---- derived values -------------------------------------------------
    @property
    def model_type(self) -> str:
        return self.arch + (MTP_SUFFIX if self.is_mtp else "")

    @property
    def uses_mla(self) -> bool:
        return self.arch in ("deepseek_v3", "deepseek_v32")

    @property
    def rotary_dim(self) -> int:
        if self.uses_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        head_dim = self.qk_head_dim if self.uses_mla else self.head_dim
        scale = head_dim**-0.5
        # DeepSeek's YaRN also sharpens the softmax by mscale(factor, mscale_all_dim)^2.
        if self.uses_mla and self.rope_scaling and self.rope_scaling.get("mscale_all_dim"):
            m = yarn_mscale(self.rope_scaling["factor"], self.rope_scaling["mscale_all_dim"])
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @property
    def mtp_layer_index(self) -> int:
        """Index of the (first) MTP layer in the main checkpoint's `model.layers.*`."""
        return self.num_hidden_layers

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out

    # ---- parsing --------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if not isinstance(model_type, str):
            raise ConfigError(f"{source}: missing 'model_type'")
        is_mtp = model_type.endswith(MTP_SUFFIX)
        arch = model_type[: -len(MTP_SUFFIX)] if is_mtp else model_type
        if arch == "deepseek_v3" and any(raw.get(k) for k in INDEXER_FIELDS):
            arch = "deepseek_v32"
        if arch not in ARCHS:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported; expected one of "
                              f"{[a + s for a in ARCHS for s in ('', MTP_SUFFIX)]}")
        names = {f.name for f in dataclasses.fields(cls)} - {"arch", "is_mtp", "source", "rope_scaling",
                                                            "fp8_block_size", "rope_theta", "partial_rotary_factor"}
        kwargs: dict[str, Any] = {k: raw[k] for k in names if k in raw and raw[k] is not None}
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if k not in kwargs]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {missing}")
        rope = dict(raw.get("rope_parameters") or {})
        rope.update(raw.get("rope_scaling") or {})
        kwargs["rope_theta"] = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "yarn":
            kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "rope_type")}
            kwargs["rope_scaling"].setdefault("original_max_position_embeddings",
                                              raw.get("max_position_embeddings", 4096))
        elif rope_type not in ("default", None):
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (default or yarn)")
        default_partial = 0.5 if arch == "glm4_moe" else 1.0
        kwargs["partial_rotary_factor"] = float(raw.get("partial_rotary_factor",
                                                        rope.get("partial_rotary_factor", default_partial)))
        kwargs["fp8_block_size"] = _fp8_block_size(raw.get("quantization_config"), source)
        # The MoE router implemented is DeepSeek-V3's (and GLM-4.5's): sigmoid scores, biased grouped top-k.
        for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if raw.get(key) not in (None, supported):
                raise ConfigError(f"{source}: {key} {raw[key]!r} is not supported (only {supported!r})")
        return cls(arch=arch, is_mtp=is_mtp, source=source, **kwargs)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: not found; a model directory needs config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _fp8_block_size(quant: dict[str, Any] | None, source: str) -> tuple[int, int] | None:
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        raise ConfigError(f"{source}: quantization_config.quant_method {quant.get('quant_method')!r} is not "
                          f"supported (only DeepSeek's block 'fp8')")
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ConfigError(f"{source}: quantization_config.weight_block_size must be [rows, cols], got {block}")
    return int(block[0]), int(block[1])
