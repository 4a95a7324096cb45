"""Dense SwiGLU MLP and the DeepSeek-style MoE block (sigmoid, grouped top-k, shared experts).

Experts are stacked into two tensors so each one is a single matmul pair;
with expert parallelism a rank holds only experts `parallel.local_experts(E)`
and the partial outputs are summed across ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState, get_parallel_state
from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.kernels.cpu_gemm import in_graph
from mtp_runtime.layers.linear import ColumnParallelLinear, RowParallelLinear, check_shape, fuse_linears, load_full


# Accelerators, up to this many (token, expert) pairs per step: copying the chosen experts' weights
# and using bmm beats looping over experts (measured by hack/profile_step.py on the bench model).
GATHERED_MAX_PAIRS = 16
# CPU, up to this many tokens: read the routing on the host (free there) and run each chosen
# expert on its tokens' rows, with no weight copies and no per-expert mask.
HOST_ROUTED_MAX_TOKENS = 64
# Inside a compiled graph (--enable_graph), up to this many token x local-expert products: run every
# local expert on every token and zero the unchosen ones (no host sync, no weight copies, static shapes).
DENSE_MAX_PRODUCTS = 2048
DENSE_MAX_EXPERTS = 16  # ... and only with this few local experts (a 256-expert model reads the chosen ones)
# float32 on AVX2 CPUs, up to this many tokens (and in every compiled graph): the packed kernel
# (cpu_gemm.moe_experts). Longer prefill chunks run the per-expert loop on the library's GEMM, as fast
# at ~1024 tokens on the bench model (8 experts, hidden 128) and faster beyond; at 256, half the time.
PACKED_MAX_TOKENS = 512


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelState | None = None):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel=parallel)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel=parallel)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel=parallel)
        self.gate_up: torch.Tensor | None = None  # [2I, H] once fuse_weights() ran
        self.gate_up_packed: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        self.gate_up, _ = fuse_linears(self.gate_proj, self.up_proj)

    def pack_weights(self) -> None:
        self.gate_up_packed = cpu_gemm.pack(self.gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = cpu_gemm.linear(x, self.gate_up, None, self.gate_up_packed).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TopkRouter(nn.Module):
    """Picks num_experts_per_tok experts per token. Kept in float32, as the published models run it."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32))
        # Selection bias learned outside the gradient (aux-loss-free balancing); not trained here.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.last_load: torch.Tensor | None = None  # tokens per expert of the last training batch

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k])."""
        cfg = self.config
        weight = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        scores = F.linear(x if x.dtype == torch.float32 else x.float(), weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        if cfg.topk_group < cfg.n_group:
            # Keep the topk_group groups whose two best experts score highest, then top-k inside them.
            grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_ids = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
            group_drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, False)
            choice = grouped.masked_fill(group_drop.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        if self.training:
            self.last_load = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """w13 [E_local, 2*I, H] (gate rows then up rows), w2 [E_local, H, I]."""

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None):
        super().__init__()
        self.parallel = parallel or get_parallel_state()
        self.num_experts = config.n_routed_experts
        self.local = self.parallel.local_experts(self.num_experts)
        inter = config.moe_intermediate_size
        self.full_inter = inter
        # Without expert parallelism the experts' intermediate dim is split across tp ranks instead.
        self.inter_start, self.inter = (0, inter) if self.parallel.ep_size > 1 else \
            self.parallel.shard(inter, "moe_intermediate_size")
        hidden = config.hidden_size
        self.w13 = nn.Parameter(torch.empty(len(self.local), 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(len(self.local), hidden, self.inter))
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.w2_stacked: torch.Tensor | None = None  # [E_local * I, H], set by fuse_weights()
        # Each expert's weights packed for cpu_gemm.moe_experts, set by pack_weights() where it runs.
        self.w13_packed: torch.Tensor | None = None
        self.w2_packed: torch.Tensor | None = None

    def is_local(self, expert_id: int) -> bool:
        return expert_id in self.local

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "",
                      expert_id: int = 0, shard: str = "gate") -> None:
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"tensor {name}: expert {expert_id} does not exist (n_routed_experts "
                             f"{self.num_experts})")
        if not self.is_local(expert_id):
            return  # another expert-parallel rank owns it
        local = expert_id - self.local.start
        if shard == "down":
            if tuple(loaded.shape) != (param.shape[1], self.full_inter):
                raise ValueError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)}, the model expects "
                                 f"({param.shape[1]}, {self.full_inter})")
            load_full(param.data[local], loaded.narrow(1, self.inter_start, self.inter), name)
            return
        if loaded.dim() != 2 or loaded.shape[0] != self.full_inter:
            raise ValueError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)}, the model expects "
                             f"({self.full_inter}, {param.shape[2]})")
        rows = slice(0, self.inter) if shard == "gate" else slice(self.inter, 2 * self.inter)
        load_full(param.data[local, rows], loaded.narrow(0, self.inter_start, self.inter), name)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights/ids [N, k] -> weighted sum of this rank's experts [N, H]."""
        if self.uses_kernel(x):
            return self.kernel(x, weights, ids)
        if in_graph():
            # Up to twice as many (token, expert) pairs as local experts: copy just the chosen experts'
            # weights (measured faster on CPU); more: read every local expert once (the dense path),
            # if the rank has few of them.
            if self.w2_stacked is not None and ids.numel() > 2 * len(self.local) \
                    and x.shape[0] * len(self.local) <= DENSE_MAX_PRODUCTS:
                return self._forward_dense(x, weights, ids)
            return self._forward_gathered(x, weights, ids)
        if x.device.type == "cpu" and x.shape[0] <= HOST_ROUTED_MAX_TOKENS:
            return self._forward_host_routed(x, weights, ids)
        if ids.numel() <= GATHERED_MAX_PAIRS:
            return self._forward_gathered(x, weights, ids)
        return self._forward_per_expert(x, weights, ids)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """float32 on an AVX2 CPU: one kernel reads just the chosen experts' weights, in place."""
        # (in a graph first: the token count is a symbol there, and comparing it would add a guard)
        return self.w13_packed is not None and (in_graph() or x.shape[0] <= PACKED_MAX_TOKENS)

    def kernel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's experts on the packed kernel (and the shared expert's packed weights, if given)."""
        return cpu_gemm.moe_experts(x, weights, ids, self.w13_packed, self.w2_packed, self.local.start, shared)

    def _forward_gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Few tokens (decode, verify): copy each (token, expert) pair's weights and run all pairs in
        two bmm calls, with no host sync and no per-expert Python loop."""
        local_ids = ids - self.local.start
        is_local = (local_ids >= 0) & (local_ids < len(self.local))  # others belong to other EP ranks
        local_ids = local_ids.clamp(0, len(self.local) - 1).flatten()  # [N*k]
        h = x.unsqueeze(1).expand(-1, ids.shape[1], -1).reshape(-1, 1, x.shape[-1])  # [N*k, 1, H]
        w13, w2 = self.w13.index_select(0, local_ids), self.w2.index_select(0, local_ids)
        gate, up = torch.bmm(h, w13.transpose(1, 2)).chunk(2, dim=-1)  # [N*k, 1, I] each
        y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2)).view(*ids.shape, -1)  # [N, k, H]
        scale = torch.where(is_local, weights, torch.zeros_like(weights)).to(y.dtype)
        return (y * scale.unsqueeze(-1)).sum(dim=1)

    def fuse_weights(self) -> None:
        """Graph mode's dense path reads the down projections of all local experts as one [E*I, H]
        matrix; kept only where that path can run (few experts per rank)."""
        if len(self.local) <= DENSE_MAX_EXPERTS:
            self.w2_stacked = self.w2.detach().transpose(1, 2).reshape(-1, self.w2.shape[1]).contiguous()

    def pack_weights(self) -> None:
        self.w13_packed = cpu_gemm.pack_experts(self.w13.detach())
        self.w2_packed = cpu_gemm.pack_experts(self.w2.detach()) if self.w13_packed is not None else None
        self.w13_packed, self.w2_packed = cpu_gemm.matching(self.w13_packed, self.w2_packed)
        if self.w13_packed is not None:
            self.w2_stacked = None  # the kernel replaces the dense path

    def _forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, combined with the routing weights (zero if unchosen):
        two matmuls in all, since sum_e c_e W2_e a_e = [W2_1 .. W2_E] [c_1 a_1; ..; c_E a_E]."""
        num_local = len(self.local)
        local_ids = ids - self.local.start
        is_local = (local_ids >= 0) & (local_ids < num_local)
        combine = torch.zeros(x.shape[0], num_local, dtype=x.dtype, device=x.device)
        combine.scatter_add_(1, local_ids.clamp(0, num_local - 1),
                             torch.where(is_local, weights, torch.zeros_like(weights)).to(x.dtype))
        gate_up = F.linear(x, self.w13.view(-1, self.w13.shape[-1])).view(x.shape[0], num_local, -1)
        gate, up = gate_up.chunk(2, dim=-1)  # [N, E, I] each
        act = F.silu(gate) * up * combine.unsqueeze(-1)
        return F.linear(act.reshape(x.shape[0], -1), self.w2_stacked.t())

    def _expert(self, h: torch.Tensor, local: int) -> torch.Tensor:
        gate, up = F.linear(h, self.w13[local]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[local])

    def _forward_host_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CPU, few tokens: the routing as a Python list, then each chosen local expert on its rows."""
        routes = ids.tolist()
        first, count = self.local.start, len(self.local)
        weights = weights.to(x.dtype)
        if len(routes) == 1:  # one token (a decode step): no row gathers at all
            out = None
            for j, expert_id in enumerate(routes[0]):
                if 0 <= expert_id - first < count:
                    y = self._expert(x, expert_id - first) * weights[:, j:j + 1]
                    out = y if out is None else out + y
            return out if out is not None else torch.zeros_like(x)
        pairs: dict[int, list[int]] = {}  # local expert -> flat (token * k + slot) indices
        k = len(routes[0])
        for t, row in enumerate(routes):
            for j, expert_id in enumerate(row):
                if 0 <= expert_id - first < count:
                    pairs.setdefault(expert_id - first, []).append(t * k + j)
        out = torch.zeros_like(x)
        flat_weights = weights.reshape(-1)
        for local, flat in pairs.items():
            flat_idx = torch.tensor(flat, dtype=torch.long)
            rows = torch.div(flat_idx, k, rounding_mode="floor")
            y = self._expert(x.index_select(0, rows), local) * flat_weights.index_select(0, flat_idx)[:, None]
            out.index_add_(0, rows, y)
        return out

    def _forward_per_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Many tokens (prefill, training): one matmul pair per expert over the tokens routed to it."""
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        for local, expert_id in enumerate(self.local):
            if counts[expert_id] == 0:
                continue
            token_idx, slot = torch.where(ids == expert_id)
            h = x[token_idx]
            gate, up = F.linear(h, self.w13[local]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[local])
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None].to(y.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None):
        super().__init__()
        self.parallel = parallel or get_parallel_state()
        self.gate = TopkRouter(config)
        self.experts = RoutedExperts(config, parallel)
        self.shared_experts = (
            DenseMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, parallel)
            if config.n_shared_experts else None
        )
        # The shared expert's (this rank's shard of) gate/up and down weights packed for the experts'
        # kernel call, set by pack_weights() where it runs. Two tensor attributes, not a tuple: an
        # ahead-of-time compiled step names every tensor it reads by its module path
        # (engine/aot_step.py), and a tensor inside a tuple has none.
        self.shared_w13_packed: torch.Tensor | None = None
        self.shared_w2_packed: torch.Tensor | None = None

    @property
    def shared_packed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.shared_w13_packed is None or self.shared_w2_packed is None:
            return None
        return self.shared_w13_packed, self.shared_w2_packed

    def pack_weights(self) -> None:
        """Runs after the experts packed theirs (prepare_for_inference packs children first)."""
        shared = self.shared_experts
        if shared is None or self.experts.w13_packed is None or shared.gate_up is None \
                or shared.down_proj.bias is not None:
            return
        w13 = cpu_gemm.pack_experts(shared.gate_up.detach()[None])
        w2 = cpu_gemm.pack_experts(shared.down_proj.weight.detach()[None])
        if w13 is None or w2 is None:
            return
        self.shared_w13_packed, self.shared_w2_packed = cpu_gemm.matching(w13, w2)
        # The shared MLP now runs on its own only for eager chunks over PACKED_MAX_TOKENS, where its
        # packed linears would hand over to at::linear anyway: drop their copies.
        shared.gate_up_packed = None
        shared.down_proj.weight_packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        shared_packed = self.shared_packed
        if shared_packed is not None and self.experts.uses_kernel(flat):
            # The shared expert rides in the routed experts' kernel call; its partial sum (tensor
            # parallelism: this rank's slice of its intermediate) joins theirs in one all-reduce.
            return self.parallel.all_reduce(self.experts.kernel(flat, weights, ids, shared_packed)).view(shape)
        out = self.parallel.all_reduce(self.experts(flat, weights, ids))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
