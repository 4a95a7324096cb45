"""Multi-head latent attention (DeepSeek-V3/R1/V3.2).

The cache holds, per token, the normed KV latent and the rotated shared rope
key: kv_lora_rank + qk_rope_head_dim values ("latent"). Decoding attends to the
latent directly: kv_b_proj's key half is folded into the query and its value
half applied after attention, so K/V are never expanded per head. Training
(the batched path) expands them instead, where a fused SDPA is cheaper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState, get_parallel_state
from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.layers.attention import (AttentionMetadata, RowSelection, attend, attend_decode_batch_cached,
                                         attend_prompts_shared, causal_mask, gather_cache, query_rows, write_cache)
from mtp_runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, fuse_linears
from mtp_runtime.layers.norm import RMSNorm
from mtp_runtime.models.graph import contiguous_copy
from mtp_runtime.layers.rotary_embedding import apply_rope_halves, apply_rope_interleaved
from mtp_runtime.models.sparse_indexer import SparseIndexer


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None):
        super().__init__()
        parallel = parallel or get_parallel_state()
        self.config = config
        _, self.num_heads = parallel.shard(config.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        heads, hidden = config.num_attention_heads, config.hidden_size
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * config.qk_head_dim, parallel=parallel)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * config.qk_head_dim, parallel=parallel)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_rank + self.rope, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v_dim), parallel=parallel)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=config.attention_bias, parallel=parallel)
        self.indexer = SparseIndexer(config) if config.arch == "deepseek_v32" else None
        self.rotate = apply_rope_interleaved if config.rope_interleave else apply_rope_halves
        self.qkv_a: torch.Tensor | None = None  # q_a_proj and kv_a_proj_with_mqa as one weight
        self.qkv_a_bias: torch.Tensor | None = None
        self.qkv_a_packed: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        if self.config.q_lora_rank is not None:
            self.qkv_a, self.qkv_a_bias = fuse_linears(self.q_a_proj, self.kv_a_proj_with_mqa)

    def pack_weights(self) -> None:
        self.qkv_a_packed = cpu_gemm.pack(self.qkv_a)

    def kv_cache_spec(self) -> dict[str, tuple[int, ...]]:
        spec = {"latent": (self.kv_rank + self.rope,)}
        if self.indexer is not None:
            spec["index_k"] = (self.indexer.head_dim,)
        return spec

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., H] -> q_nope [..., h, nope], q_rot [..., h, rope], latent [..., r + rope], q latent."""
        if self.qkv_a is not None:  # one matmul for both down-projections
            q_latent, kv = cpu_gemm.linear(x, self.qkv_a, self.qkv_a_bias, self.qkv_a_packed).split(
                [self.config.q_lora_rank, self.kv_rank + self.rope], dim=-1)
            q_latent = self.q_a_layernorm(q_latent)
            q = self.q_b_proj(q_latent)
        elif self.config.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x)
            kv = self.kv_a_proj_with_mqa(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
            kv = self.kv_a_proj_with_mqa(x)
        q_nope, q_rot = q.unflatten(-1, (self.num_heads, -1)).split([self.nope, self.rope], dim=-1)
        c, k_rot = kv.split([self.kv_rank, self.rope], dim=-1)
        # Rotate the query heads and the shared key as one tensor: half the small ops of two calls.
        rotated = self.rotate(torch.cat([q_rot, k_rot.unsqueeze(-2)], dim=-2), cos, sin)
        q_rot, k_rot = rotated[..., :-1, :], rotated[..., -1, :]
        latent = torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)
        return q_nope, q_rot, latent, q_latent

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as per-head key [h, nope, r] and value [h, v, r] up-projections."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def write_keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: dict[str, torch.Tensor], meta: AttentionMetadata) -> None:
        """Only the cache writes of `forward`: x [T, H] -> this step's latents (and V3.2's index keys).
        Without an indexer no query is computed: only the key down-projection, its norm and the rope
        key (the draft's keys at adaptive depth's k = 0 steps, which draft nothing)."""
        if self.indexer is not None:  # V3.2's index keys read the query latent
            _, _, latent, q_latent = self._project(x, cos, sin)
            _, index_k, _ = self.indexer.queries_and_keys(x, q_latent, cos, sin)
            write_cache(cache["index_k"], index_k, meta.slot_mapping)
        else:
            c, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
            k_rot = self.rotate(k_rot.unsqueeze(-2), cos, sin).squeeze(-2)
            latent = torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)
        write_cache(cache["latent"], latent, meta.slot_mapping)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: dict[str, torch.Tensor], meta: AttentionMetadata,
                select: RowSelection | None = None) -> torch.Tensor:
        """x [T, H] (flattened batch) -> [T, H] (with `select`: [R, H], its rows only); writes this
        step's latents into the paged cache."""
        q_nope, q_rot, latent, q_latent = self._project(x, cos, sin)
        write_cache(cache["latent"], latent, meta.slot_mapping)
        index_q = index_w = None
        if self.indexer is not None:
            index_q, index_k, index_w = self.indexer.queries_and_keys(x, q_latent, cos, sin)
            write_cache(cache["index_k"], index_k, meta.slot_mapping)
        if select is not None:  # every latent is written above; only the selected rows attend
            q_nope, q_rot, meta = q_nope.index_select(0, select.rows), q_rot.index_select(0, select.rows), select.meta
            if index_q is not None:
                index_q, index_w = index_q.index_select(0, select.rows), index_w.index_select(0, select.rows)
        w_uk, w_uv = self._kv_b()
        # Fold the key up-projection into the query: q . (W_uk c) = (W_uk^T q) . c
        # (bmm over heads directly: einsum's own dispatch costs more than the product at decode sizes)
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rot], dim=-1)  # [T, h, r + rope]
        # Decode / verify steps attend as one padded batch; prefill chunks (and V3.2's per-sequence
        # top-k key selection) one sequence at a time.
        batch = meta.decode_batch() if self.indexer is None else None
        if batch is not None:
            out = attend_decode_batch_cached(batch, q, cache["latent"], self.kv_rank, self.scale)
        else:
            out = self._attend_per_sequence(q, cache, meta, index_q, index_w)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # value up-projection, [T, h, v]
        # a copy then view, not flatten() or contiguous(): both ask whether T == 1, which a compiled
        # graph would otherwise specialise on.
        return self.o_proj(contiguous_copy(out).view(-1, self.num_heads * self.v_dim))

    def _attend_per_sequence(self, q: torch.Tensor, cache: dict[str, torch.Tensor], meta: AttentionMetadata,
                             index_q: torch.Tensor | None, index_w: torch.Tensor | None) -> torch.Tensor:
        out = q.new_empty(q.shape[0], self.num_heads, self.kv_rank)
        # Whole prompts together (V3.2's indexer picks keys per sequence: not there).
        prompts = meta.prompt_batch() if self.indexer is None else None
        if prompts is not None:
            keys = gather_cache(cache["latent"], meta.slot_mapping)  # this step's latents, as the cache holds them
            prompts.scatter(out, attend_prompts_shared(prompts, q, keys.to(q.dtype), self.kv_rank, self.scale))
        for rows, positions, slots in meta.sequences(skip=prompts):
            keys = gather_cache(cache["latent"], slots).unsqueeze(1)  # [L, 1, r + rope]
            # A single new token (decode) sees its whole context: no mask to build or apply.
            allowed = None if self.indexer is None and positions.shape[0] == 1 else \
                causal_mask(positions, keys.shape[0])
            if self.indexer is not None:
                allowed = self.indexer.select(index_q[rows], gather_cache(cache["index_k"], slots), index_w[rows],
                                              allowed)
            out[rows] = attend(q[rows], keys, keys[..., : self.kv_rank], allowed, self.scale)
        return out

    def forward_batched(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        mask: torch.Tensor | None = None, queries_from: int = 0) -> torch.Tensor:
        """Training path: x [B, S, H] (rotated by cos/sin [S, rope]), no cache -> [B, S - queries_from, H].
        mask [S, S] (True: the query row may see the key row) replaces the causal mask; rows before
        `queries_from` are keys only."""
        q_nope, q_rot, latent, q_latent = self._project(x, cos, sin)
        c, k_rot = latent.split([self.kv_rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(c).unflatten(-1, (self.num_heads, -1)).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        seq_len = x.shape[1]
        if self.indexer is not None and seq_len > self.indexer.topk:
            with torch.no_grad():
                iq, ik, iw = self.indexer.queries_and_keys(x, q_latent, cos, sin)
                allowed = causal_mask(torch.arange(seq_len, device=x.device), seq_len) if mask is None else mask
                mask = self.indexer.select(iq, ik, iw, allowed.expand(x.shape[0], -1, -1)).unsqueeze(1)  # [B, 1, S, S]
        q, mask = query_rows(q, mask, queries_from, seq_len, x.device)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).flatten(-2))
