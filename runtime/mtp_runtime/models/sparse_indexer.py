"""DeepSeek-V3.2's lightning indexer: each query keeps only its index_topk best keys.

score(q, key) = sum_h w_h(x_q) * relu(q_h . k_key / sqrt(d)) with a small set of
heads and one shared key per token (cached as "index_k"). The selected keys
become the attention mask of that query; with no more than index_topk keys in
the context every key is selected, so the mask is exactly the causal one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_runtime.config import ModelConfig
from mtp_runtime.layers.linear import ReplicatedLinear
from mtp_runtime.layers.rotary_embedding import apply_rope_halves


class SparseIndexer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.n_heads)

    def queries_and_keys(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H], q_latent [..., q_lora_rank] -> (q [..., heads, d], k [..., d], head weights [..., heads]).

        Unlike MLA, the indexer rotates its first qk_rope_head_dim dims as two halves.
        """
        q = self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope_halves(q, cos, sin)
        k = apply_rope_halves(self.k_norm(self.wk(x)).unsqueeze(-2), cos, sin).squeeze(-2)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return q, k, weights

    def select(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, allowed: torch.Tensor
               ) -> torch.Tensor:
        """q [..., n, heads, d], keys [..., L, d], weights [..., n, heads], allowed [..., n, L] (causal)
        -> allowed narrowed to each query's top-k keys."""
        num_keys = keys.shape[-2]
        if num_keys <= self.topk:
            return allowed
        scores = torch.matmul(q.float(), keys.float().unsqueeze(-3).transpose(-1, -2)) * self.head_dim**-0.5
        scores = F.relu(scores)  # [..., n, heads, L]
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [..., n, L]
        index_scores = index_scores.masked_fill(~allowed, float("-inf"))
        # A stable descending sort breaks ties (e.g. keys whose relu scores are all zero) by key
        # position, so a query picks the same keys whether or not masked future keys follow it:
        # verify passes and chunked prefill select exactly what one-token decoding selects.
        top = index_scores.sort(dim=-1, descending=True, stable=True).indices[..., : self.topk]
        selected = torch.zeros_like(allowed).scatter_(-1, top, True)
        return allowed & selected  # masked keys sorted last; any picked (< topk allowed) drop out here
