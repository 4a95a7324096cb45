"""What the architectures share: the pre-norm decoder layer and the causal LM around it.

Two forwards use the same modules: `forward` (flattened tokens of many
sequences with paged caches, the runtime interface) and `forward_batched`
(a [B, S] batch from position 0 with no cache, for training).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState
from mtp_runtime.layers.attention import AttentionMetadata, RowSelection
from mtp_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mtp_runtime.layers.moe import MoE, DenseMLP
from mtp_runtime.layers.norm import RMSNorm
from mtp_runtime.layers.rotary_embedding import RotaryEmbedding
from mtp_runtime.models.graph import GraphMode

AttentionFactory = Callable[[ModelConfig, ParallelState | None], nn.Module]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, make_attention: AttentionFactory,
                 parallel: ParallelState | None = None, moe: bool | None = None):
        super().__init__()
        moe = config.is_moe_layer(layer_idx) if moe is None else moe
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = make_attention(config, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MoE(config, parallel) if moe
                    else DenseMLP(config.hidden_size, config.intermediate_size, parallel))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: dict[str, torch.Tensor], meta: AttentionMetadata,
                select: RowSelection | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; with `select`, every row's keys are cached but only its R rows go on: [R, H]."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, select)
        x = (x if select is None else x.index_select(0, select.rows)) + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_batched(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        mask: torch.Tensor | None = None, queries_from: int = 0) -> torch.Tensor:
        """x [B, S, H] -> [B, S - queries_from, H]: rows before `queries_from` only give keys (their
        outputs would be thrown away: the chained drafts of training)."""
        attn = self.self_attn.forward_batched(self.input_layernorm(x), cos, sin, mask, queries_from)
        # No slice at 0: a slice node would change the order in which backward sums x's gradients,
        # and so the bits of joint training.
        x = (x[:, queries_from:] if queries_from else x) + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class TransformerBody(nn.Module):
    """`model.*` of the checkpoint: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, make_attention: AttentionFactory, parallel: ParallelState | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, make_attention, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(GraphMode, nn.Module):
    """Main model: ids -> final-normed hidden states; `compute_logits` applies lm_head."""

    make_attention: AttentionFactory  # set by each architecture

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        self.model = TransformerBody(config, type(self).make_attention, parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def kv_cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        return [layer.self_attn.kv_cache_spec() for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[dict[str, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden [T, H] (compiled in graph mode)."""
        return GraphMode.forward(self, input_ids, positions, caches, meta)

    def _forward_eager(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       caches: list[dict[str, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if len(caches) != len(self.model.layers):
            raise ValueError(f"got caches for {len(caches)} layers, the model has {len(self.model.layers)}")
        cos, sin = self.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, cos, sin, cache, meta)
        return self.model.norm(x)

    def forward_batched(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] from position 0 -> final-normed hidden [B, S, H] (training)."""
        cos, sin = self.rotary(torch.arange(input_ids.shape[1], device=input_ids.device))
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer.forward_batched(x, cos, sin)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
