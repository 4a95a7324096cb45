"""MTP draft module: h' = eh_proj([enorm(embed(next_token)); hnorm(h)]) -> one decoder layer
-> shared_head.norm (returned) -> shared_head.head (compute_logits).

`h` is the main model's final-normed hidden state at the previous position, or,
when the one MTP layer is reused for draft position 2, 3, ..., the draft's own
previous shared_head.norm output. The draft has its own cache (one layer).
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState
from mtp_runtime.layers.attention import AttentionMetadata, RowSelection
from mtp_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mtp_runtime.layers.linear import ReplicatedLinear
from mtp_runtime.layers.norm import RMSNorm
from mtp_runtime.layers.rotary_embedding import RotaryEmbedding
from mtp_runtime.models.decoder import AttentionFactory, DecoderLayer
from mtp_runtime.models.graph import GraphMode


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState | None):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)


class MtpDraft(GraphMode, nn.Module):
    def __init__(self, config: ModelConfig, make_attention: AttentionFactory,
                 parallel: ParallelState | None = None, moe: bool | None = None):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, parallel)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        # By default the layer is dense or MoE as a main layer at its index would be.
        self.layer = DecoderLayer(config, config.mtp_layer_index, make_attention, parallel, moe)
        self.shared_head = SharedHead(config, parallel)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def kv_cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        return [self.layer.self_attn.kv_cache_spec()]

    def use_main_head(self, lm_head: ParallelLMHead) -> None:
        """Checkpoints without shared_head.head share the main model's lm_head (same for embeddings)."""
        self.shared_head.head = lm_head

    def use_main_embedding(self, embed_tokens: VocabParallelEmbedding) -> None:
        self.embed_tokens = embed_tokens

    def _combine(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds = self.enorm(self.embed_tokens(input_ids))
        return self.eh_proj(torch.cat([embeds, self.hnorm(hidden)], dim=-1))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                caches: list[dict[str, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] (the token after positions[t]), hidden [T, H] -> shared_head.norm output [T, H]
        (compiled in graph mode)."""
        return GraphMode.forward(self, input_ids, hidden, positions, caches, meta)

    def forward_selected(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                         caches: list[dict[str, torch.Tensor]], meta: AttentionMetadata,
                         select: RowSelection) -> torch.Tensor:
        """As `forward` (not compiled on its own), but only the selected rows attend and run the MLP:
        -> [R, H]. Every row's keys still enter the cache, as a draft pass over the positions a step
        made final needs, while only each sequence's last row feeds the next draft."""
        return self._forward_eager(input_ids, hidden, positions, caches, meta, select)

    def write_keys(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   caches: list[dict[str, torch.Tensor]], meta: AttentionMetadata) -> None:
        """Only the cache writes of `forward` (same inputs): a prompt chunk's keys, and the keys adaptive
        depth's steps at k = 0 (which draft nothing) left out, written when a step drafts again
        (ModelRunner._fill_draft_keys), so its drafts attend to a complete context."""
        if len(caches) != 1:
            raise ValueError(f"the MTP draft has one layer and takes one cache, got {len(caches)}")
        cos, sin = self.rotary(positions)
        x = self.layer.input_layernorm(self._combine(input_ids, hidden))
        self.layer.self_attn.write_keys(x, cos, sin, caches[0], meta)

    def _forward_eager(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       caches: list[dict[str, torch.Tensor]], meta: AttentionMetadata,
                       select: RowSelection | None = None) -> torch.Tensor:
        if len(caches) != 1:
            raise ValueError(f"the MTP draft has one layer and takes one cache, got {len(caches)}")
        cos, sin = self.rotary(positions)
        x = self.layer(self._combine(input_ids, hidden), cos, sin, caches[0], meta, select)
        return self.shared_head.norm(x)

    def forward_batched(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None, queries_from: int = 0) -> torch.Tensor:
        """Training: input_ids [B, S], hidden [B, S, H] -> [B, S - queries_from, H]. Rows sit at `positions`
        [S] (default 0..S-1) and each sees the rows `mask` [S, S] allows (default: itself and every earlier
        row); rows before `queries_from` only give keys."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary(positions)
        x = self.layer.forward_batched(self._combine(input_ids, hidden), cos, sin, mask, queries_from)
        return self.shared_head.norm(x)

    def compute_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(hidden_out)
