"""A simple reference loop: one prompt, main model + optional MTP draft, speculative steps as in
runtime/README.md. The engine replaces this for serving; tests use it as the plain-decoding oracle.

Acceptance is by exact match: main picks its token at every verified position (greedy, or a
sample at temperature > 0); a draft token is kept while it equals main's pick. The output is
therefore exactly what main alone would produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_runtime.layers.attention import AttentionMetadata
from mtp_runtime.models.decoder import CausalLM
from mtp_runtime.models.mtp import MtpDraft

BLOCK_SIZE = 16


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verify_steps: int = 0
    finish_reason: str = "length"


def allocate_caches(spec: list[dict[str, tuple[int, ...]]], num_tokens: int, dtype: torch.dtype,
                    device: torch.device | str) -> list[dict[str, torch.Tensor]]:
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    return [{name: torch.zeros(num_blocks, BLOCK_SIZE, *shape, dtype=dtype, device=device)
             for name, shape in layer.items()} for layer in spec]


class PagedRunner:
    """Runs a main model or a draft on one sequence whose cache holds positions 0..context-1."""

    def __init__(self, module: CausalLM | MtpDraft, max_tokens: int, device: torch.device | str):
        self.module, self.device = module, device
        dtype = next(p.dtype for n, p in module.named_parameters() if n.endswith("norm.weight"))
        self.caches = allocate_caches(module.kv_cache_spec(), max_tokens, dtype, device)

    def run(self, input_ids: list[int], start: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens at positions start.. -> hidden [n, H]; the cache keeps everything before `start`."""
        meta = AttentionMetadata.for_sequence(start, len(input_ids), BLOCK_SIZE, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(input_ids), device=self.device)
        if hidden is None:
            return self.module(ids, positions, self.caches, meta)
        return self.module(ids, hidden, positions, self.caches, meta)


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> list[int]:
    """logits [n, V] -> one token per row: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).tolist()


@torch.inference_mode()
def generate(model: CausalLM, prompt_ids: list[int], max_tokens: int, draft: MtpDraft | None = None,
             num_speculative_tokens: int = 0, temperature: float = 0.0, eos_ids: tuple[int, ...] = (),
             seed: int = 0) -> GenerationResult:
    if not prompt_ids:
        raise ValueError("prompt is empty: give at least one token")
    k = num_speculative_tokens if draft is not None else 0
    device = next(model.parameters()).device
    capacity = len(prompt_ids) + max_tokens + k + 1
    main = PagedRunner(model, capacity, device)
    drafter = PagedRunner(draft, capacity, device) if k else None
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    result = GenerationResult(token_ids=[], accepted_per_position=[0] * k)
    if max_tokens <= 0:
        return result
    tokens = list(prompt_ids)

    def emit(new: list[int]) -> bool:
        """Append accepted tokens; True when generation is finished."""
        for t in new:
            tokens.append(t)
            result.token_ids.append(t)
            if t in eos_ids:
                result.finish_reason = "stop"
                return True
            if len(result.token_ids) >= max_tokens:
                return True
        return False

    # prefill: main over the prompt, then the draft over the same positions, one token ahead
    n = len(tokens)
    hidden = main.run(tokens, 0)  # [n, H]
    if emit(pick(model.compute_logits(hidden[-1:]), temperature, gen)):
        return result
    if not k:
        while True:  # plain decoding
            hidden = main.run(tokens[-1:], len(tokens) - 1)
            if emit(pick(model.compute_logits(hidden), temperature, gen)):
                return result
    drafts, draft_hidden = _draft_chain(draft, drafter, tokens[1:], 0, hidden, k)
    while True:
        # verify: main over [t_n, d_1..d_k] at positions n..n+k in one forward
        n = len(tokens) - 1
        hidden = main.run([tokens[-1], *drafts], n)  # [k+1, H]
        chosen = pick(model.compute_logits(hidden), temperature, gen)
        accepted = 0
        while accepted < k and drafts[accepted] == chosen[accepted]:
            accepted += 1
        result.verify_steps += 1
        result.draft_tokens += k
        result.accepted_tokens += accepted
        for i in range(accepted):
            result.accepted_per_position[i] += 1
        new = drafts[:accepted] + [chosen[accepted]]
        if emit(new):
            return result
        # redraft from the verified hiddens h_n..h_{n+a}, inputs = the a+1 new tokens
        drafts, draft_hidden = _draft_chain(draft, drafter, new, n, hidden[: accepted + 1], k)


def _draft_chain(draft: MtpDraft, drafter: PagedRunner, next_tokens: list[int], start: int,
                 hidden: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor]:
    """Draft over positions start.. (inputs = the token after each position), then k-1 single steps
    that feed the layer its own shared_head.norm output. Returns k draft tokens."""
    out = drafter.run(next_tokens, start, hidden)[-1:]  # [1, H]
    position = start + len(next_tokens) - 1
    drafts = [int(draft.compute_logits(out).argmax(dim=-1))]
    for _ in range(k - 1):
        position += 1
        out = drafter.run([drafts[-1]], position, out)
        drafts.append(int(draft.compute_logits(out).argmax(dim=-1)))
    return drafts, out
