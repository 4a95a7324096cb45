"""GLM-4.5 / 4.5-Air: grouped-query attention with partial rotary, optional qk-norm and q/k/v bias,
dense-then-MoE layers with shared experts and sigmoid routing (the MoE block is DeepSeek's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState, get_parallel_state
from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.layers.attention import (AttentionMetadata, RowSelection, attend, attend_decode_batch,
                                         attend_prompts, causal_mask, gather_cache, query_rows, write_cache)
from mtp_runtime.layers.linear import ColumnParallelLinear, RowParallelLinear, fuse_linears
from mtp_runtime.layers.norm import RMSNorm
from mtp_runtime.layers.rotary_embedding import apply_rope_halves
from mtp_runtime.models.decoder import CausalLM


class GQAttention(nn.Module):
    """Cache per token: "k" and "v", each [kv_heads, head_dim] (this rank's heads)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None):
        super().__init__()
        parallel = parallel or get_parallel_state()
        d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        _, self.num_heads = parallel.shard(heads, "num_attention_heads")
        _, self.num_kv_heads = parallel.shard(kv_heads, "num_key_value_heads")
        self.head_dim, self.scale = d, config.softmax_scale
        bias = config.attention_bias
        self.q_proj = ColumnParallelLinear(config.hidden_size, heads * d, bias=bias, parallel=parallel)
        self.k_proj = ColumnParallelLinear(config.hidden_size, kv_heads * d, bias=bias, parallel=parallel)
        self.v_proj = ColumnParallelLinear(config.hidden_size, kv_heads * d, bias=bias, parallel=parallel)
        self.o_proj = RowParallelLinear(heads * d, config.hidden_size, parallel=parallel)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv: torch.Tensor | None = None  # q, k and v projections as one weight
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_packed: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        self.qkv, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def pack_weights(self) -> None:
        self.qkv_packed = cpu_gemm.pack(self.qkv)

    def kv_cache_spec(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.qkv is not None:
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = cpu_gemm.linear(x, self.qkv, self.qkv_bias, self.qkv_packed).split(
                [self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope_halves(q, cos, sin), apply_rope_halves(k, cos, sin), v

    def write_keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: dict[str, torch.Tensor], meta: AttentionMetadata) -> None:
        """Only the cache writes of `forward`: every row's k and v."""
        _, k, v = self._project(x, cos, sin)
        write_cache(cache["k"], k, meta.slot_mapping)
        write_cache(cache["v"], v, meta.slot_mapping)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: dict[str, torch.Tensor], meta: AttentionMetadata,
                select: RowSelection | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H] (with `select`: [R, H], its rows only); writes every row's k and v."""
        q, k, v = self._project(x, cos, sin)
        write_cache(cache["k"], k, meta.slot_mapping)
        write_cache(cache["v"], v, meta.slot_mapping)
        if select is not None:
            q, meta = q.index_select(0, select.rows), select.meta
        batch = meta.decode_batch()
        if batch is not None:  # decode / verify: every sequence in one padded batch
            out = attend_decode_batch(batch, q, batch.keys(cache["k"]), batch.keys(cache["v"]), self.scale)
            return self.o_proj(out.flatten(-2))
        out = torch.empty_like(q)
        prompts = meta.prompt_batch()  # whole prompts together
        if prompts is not None:
            keys, values = gather_cache(cache["k"], meta.slot_mapping), gather_cache(cache["v"], meta.slot_mapping)
            prompts.scatter(out, attend_prompts(prompts, q, keys.to(q.dtype), values.to(q.dtype), self.scale))
        for rows, positions, slots in meta.sequences(skip=prompts):
            keys, values = gather_cache(cache["k"], slots), gather_cache(cache["v"], slots)
            # A single new token (decode) sees its whole context: no mask to build or apply.
            allowed = None if positions.shape[0] == 1 else causal_mask(positions, keys.shape[0])
            out[rows] = attend(q[rows], keys, values, allowed, self.scale)
        return self.o_proj(out.flatten(-2))

    def forward_batched(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        mask: torch.Tensor | None = None, queries_from: int = 0) -> torch.Tensor:
        """Training path, as MLAttention.forward_batched (mask [S, S] replaces the causal one)."""
        q, k, v = self._project(x, cos, sin)
        q, mask = query_rows(q, mask, queries_from, x.shape[1], x.device)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             is_causal=mask is None, scale=self.scale, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class Glm4MoeForCausalLM(CausalLM):
    make_attention = GQAttention
