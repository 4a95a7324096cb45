"""Sampling and speculative acceptance (torch; everything batched over rows).

Greedy rows take the argmax and accept a draft on exact match. Sampled rows
use speculative sampling: a draft token d drawn from the draft distribution
q is accepted with probability min(1, p(d) / q(d)); at the first rejection the
token is drawn from normalize(max(p - q, 0)); when all k drafts are accepted
a bonus token is drawn from p at position k. The emitted tokens are then
distributed exactly as sampling from the target p alone.

Randomness: each request with a seed owns a torch.Generator, so its tokens do
not depend on what else is in the batch; requests without a seed share the
sampler's generator (one draw for all of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_runtime.sampling_params import SamplingParams


@dataclass
class RowParams:
    """Per-row sampling settings as tensors, built once per step."""

    temperature: torch.Tensor  # [N] float, 0 for greedy rows (not used on them)
    top_k: torch.Tensor  # [N] long, vocab size when off
    top_p: torch.Tensor  # [N] float
    needs_top_k: bool
    needs_top_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device) -> "RowParams":
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        return cls(torch.tensor(temps, device=device), torch.tensor(top_k, device=device),
                   torch.tensor(top_p, device=device), any(k < vocab_size for k in top_k),
                   any(p < 1.0 for p in top_p))


def probabilities(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """logits [N, V] or [N, S, V] (float32) -> probabilities after temperature, top-k and top-p."""
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1])  # [N, S, V]
    flat = flat / rows.temperature.view(-1, 1, 1)
    if rows.needs_top_k or rows.needs_top_p:
        sorted_logits, order = flat.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if rows.needs_top_k:
            ranks = torch.arange(shape[-1], device=logits.device)
            drop |= ranks.view(1, 1, -1) >= rows.top_k.view(-1, 1, 1)
        if rows.needs_top_p:
            sorted_probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            drop |= mass_before >= rows.top_p.view(-1, 1, 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        flat = torch.empty_like(flat).scatter_(-1, order, sorted_logits)
    return flat.softmax(-1).reshape(shape)


def uniform_rows(generators: list[torch.Generator | None], num_cols: int, device,
                 shared: torch.Generator | None) -> torch.Tensor:
    """[N, num_cols] uniforms in (0, 1]; row i from generators[i], or `shared` where that is None."""
    out = torch.empty(len(generators), num_cols, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), num_cols, device=device, generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(num_cols, device=device, generator=g)
    return 1.0 - out  # (0, 1]: log() below stays finite


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax p / E with E = -log U ~ Exp(1) draws from p. probs, uniforms [N, V] -> [N]."""
    # The clamp keeps a zero-probability token from winning with 0 / 0 when U is exactly 1.
    return (probs / (-uniforms.log()).clamp_min(1e-30)).argmax(-1)


def greedy_verify(target_argmax: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """target_argmax [B, k+1], drafts [B, k] -> number of leading drafts that match, [B]."""
    # The index of the first mismatch, with a mismatch appended after the last draft. argmax (the
    # first maximum) compiles to a fused loop; the cumprod this replaces ran as a library call
    # costing more than the rest of the acceptance.
    mismatch = target_argmax[:, :-1] != drafts
    return torch.cat([mismatch, torch.ones_like(mismatch[:, :1])], dim=1).int().argmax(dim=1)


def speculative_verify(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor,
                       accept_uniforms: torch.Tensor, token_uniforms: torch.Tensor):
    """Speculative sampling for B rows with k drafts each.

    target_probs [B, k+1, V], draft_probs [B, k, V], drafts [B, k] (drawn from draft_probs),
    accept_uniforms [B, k], token_uniforms [B, V]
    -> (num_accepted [B], next_token [B]): the replacement token at the first
    rejection, or the bonus token after k acceptances.
    """
    b, k = drafts.shape
    p_d = target_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_d = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, k]
    accepted = (accept_uniforms * q_d <= p_d).int()  # u <= p/q without dividing by q
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    rows = torch.arange(b, device=drafts.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (p_next - q_pad[rows, num_accepted]).clamp_min(0)  # = p_next after k acceptances
    # A rejection implies p(d) < q(d), so the residual has mass; guard rounding anyway.
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual, p_next)
    return num_accepted, sample_from(residual, token_uniforms)
