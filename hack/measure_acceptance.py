#!/usr/bin/env python
"""Greedy MTP acceptance of a trained model on held-out text (stdlib files never used for training).

Two measurements, side by side:
  teacher-forced: over held-out windows, the draft at position t gets token t+1 and the main
      model's hidden at t; acceptance = share of positions where its greedy token equals the main
      model's greedy token at t+1 (draft position 1, exact definition, large sample).
  speculative:  the reference loop generates from held-out prompts with K draft tokens per step
      (the MTP layer reused for positions 2..K, fed its own shared_head.norm output);
      acceptance of position i = accepted at i / verify steps (and conditional on i-1 accepted).

Example:
  mtp make-tiny --arch deepseek_v3 --preset bench --out /tmp/bench
  python hack/measure_acceptance.py --model /tmp/bench --k 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mtp_runtime.reference_generate import PagedRunner
from mtp_runtime.reference_session import ReferenceSession
from mtp_runtime.train import corpus_ids


def teacher_forced(session: ReferenceSession, ids: torch.Tensor, windows: int, seq_len: int) -> tuple[float, int]:
    model, draft = session.model, session.draft
    stride = max(1, (ids.numel() - seq_len - 1) // windows)
    batch = torch.stack([ids[i * stride:i * stride + seq_len + 1] for i in range(windows)])  # [W, S+1]
    agree = total = 0
    with torch.inference_mode():
        for rows in batch.split(8):
            hidden = model.forward_batched(rows[:, :seq_len])  # [b, S, H]
            main_next = model.compute_logits(hidden).argmax(-1)  # main's greedy token for t+1
            draft_out = draft.forward_batched(rows[:, 1:seq_len], hidden[:, :seq_len - 1])
            draft_next = draft.compute_logits(draft_out).argmax(-1)  # draft's guess for t+2
            agree += (draft_next == main_next[:, 1:]).sum().item()
            total += draft_next.numel()
    return agree / total, total


def speculative(session: ReferenceSession, ids: torch.Tensor, prompts: int, prompt_len: int, max_tokens: int,
                k: int) -> dict:
    stride = (ids.numel() - prompt_len) // prompts
    steps, per_position, generated, start = 0, [0] * k, 0, time.monotonic()
    for i in range(prompts):
        prompt = ids[i * stride:i * stride + prompt_len].tolist()
        result = session.generate(prompt, max_tokens, k)
        steps += result.verify_steps
        generated += len(result.token_ids)
        per_position = [a + b for a, b in zip(per_position, result.accepted_per_position)]
    rates = [a / steps for a in per_position]
    conditional = [per_position[0] / steps] + [per_position[i] / max(1, per_position[i - 1]) for i in range(1, k)]
    return {"verify_steps": steps, "generated_tokens": generated, "accepted_per_position": per_position,
            "acceptance_per_position": rates, "conditional_acceptance": conditional,
            "tokens_per_step": generated / steps, "seconds": time.monotonic() - start}


@torch.inference_mode()
def step_cost_ratio(session: ReferenceSession, ids: torch.Tensor, context: int = 64, steps: int = 30) -> float:
    """Wall time of one single-token draft step / one single-token main decode step, interleaved."""
    main = PagedRunner(session.model, context + steps + 1, "cpu")
    drafter = PagedRunner(session.draft, context + steps + 1, "cpu")
    tokens = ids[:context + steps + 1].tolist()
    hidden = main.run(tokens[:context], 0)
    drafter.run(tokens[1:context + 1], 0, hidden)
    main_s = draft_s = 0.0
    for i in range(steps):
        pos = context + i
        t0 = time.perf_counter()
        h = main.run([tokens[pos]], pos)
        t1 = time.perf_counter()
        drafter.run([tokens[pos + 1]], pos, h)
        t2 = time.perf_counter()
        main_s, draft_s = main_s + t1 - t0, draft_s + t2 - t1
    return draft_s / main_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="trained checkpoint (make-tiny --train-steps / --preset bench)")
    parser.add_argument("--draft_model", default=None, help="draft directory (default: the model's own MTP layer)")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per speculative step")
    parser.add_argument("--windows", type=int, default=32, help="teacher-forced held-out windows")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts for the speculative loop")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--heldout-bytes", type=int, default=1024 * 1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    session = ReferenceSession(args.model, args.draft_model or args.model)
    ids = corpus_ids(args.model, "heldout", args.heldout_bytes)
    tf_rate, tf_positions = teacher_forced(session, ids, args.windows, args.seq_len)
    spec = speculative(session, ids, args.prompts, args.prompt_len, args.max_tokens, args.k)
    spec["draft_to_main_step_time"] = step_cost_ratio(session, ids)
    print(f"held-out tokens: {ids.numel()}")
    print(f"teacher-forced acceptance, draft position 1: {tf_rate:.3f} over {tf_positions} positions")
    for i in range(args.k):
        print(f"speculative k={args.k}: position {i + 1} acceptance {spec['acceptance_per_position'][i]:.3f} "
              f"(conditional on the previous position: {spec['conditional_acceptance'][i]:.3f})")
    print(f"speculative: {spec['generated_tokens']} tokens in {spec['verify_steps']} verify steps = "
          f"{spec['tokens_per_step']:.2f} tokens per main-model step ({spec['seconds']:.0f}s)")
    print(f"one draft step costs {spec['draft_to_main_step_time']:.2f} of a main decode step (measured side by side)")
    print(json.dumps({"teacher_forced_position1": tf_rate, **spec}))


if __name__ == "__main__":
    main()
