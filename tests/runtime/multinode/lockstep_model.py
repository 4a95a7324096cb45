"""A sharded tiny model stepping in lockstep, run as one real process per rank.

    python lockstep_model.py RANK NNODES PORT MODEL_DIR --ep-size E --k K --tokens N

Rank 0 runs `greedy_mtp_generate` (a plain greedy speculative loop over the
runtime's model interface) through the broadcasting wrappers; the other ranks
follow with `run_worker`. Rank 0 prints the generated tokens; every rank
prints the checkpoint bytes it read. With NNODES 1 the same loop runs
unsharded, which is the reference the tests compare against.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from mtp_runtime.checkpoint.safetensors_io import READ_STATS
from mtp_runtime.distributed import ParallelState, set_parallel_state
from mtp_runtime.layers.attention import AttentionMetadata
from mtp_runtime.models.loader import load_draft, load_model
from mtp_runtime.multinode.leader import LockstepLeader
from mtp_runtime.multinode.parallel_setup import build_parallel_state
from mtp_runtime.multinode.plan_executor import PlanExecutor, allocate_caches, run_worker
from mtp_runtime.multinode.rendezvous import RendezvousConfig, leave_group, rendezvous
from mtp_runtime.multinode.step_plan import DRAFT, MAIN

PROMPT = [5, 17, 300, 42, 7, 99, 123]
BLOCK_SIZE, NUM_BLOCKS = 4, 32


def load(model_dir: str, parallel: ParallelState):
    set_parallel_state(parallel)
    model = load_model(model_dir, parallel=parallel)
    draft = load_draft(model_dir, main=model, parallel=parallel)
    return model, draft


def greedy_mtp_generate(model, draft, prompt: list[int], k: int, max_new: int) -> dict:
    """Greedy MTP speculative decoding of one sequence, block table [0, 1, 2, ...]."""
    caches = allocate_caches(model, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    draft_caches = allocate_caches(draft, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    table = list(range(NUM_BLOCKS))

    def meta(start: int, n: int) -> AttentionMetadata:
        return AttentionMetadata([0, n], [start + n], [table], torch.arange(start, start + n), BLOCK_SIZE)

    def run_main(tokens: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(tokens))
        return model(torch.tensor(tokens), pos, caches, meta(start, len(tokens)))

    proposals: list[int] = []  # every draft token, in order: the outputs alone cannot show a wrong draft

    def run_draft(tokens: list[int], hidden: torch.Tensor, start: int) -> list[int]:
        """Draft k tokens: one pass over `tokens`, then k-1 single steps on its own output."""
        out, drafts = None, []
        for step in range(k):
            n = len(tokens) if step == 0 else 1
            ids = torch.tensor(tokens if step == 0 else drafts[-1:])
            pos = torch.arange(start, start + n)
            out = draft(ids, hidden if step == 0 else out[-1:], pos, draft_caches, meta(start, n))
            last = out[torch.tensor([out.shape[0] - 1])] if step == 0 else out[-1:]  # traced rows, a view
            drafts.append(int(draft.compute_logits(last).argmax(-1)))
            start += n
        proposals.extend(drafts)
        return drafts

    tokens = list(prompt)
    hidden = run_main(tokens, 0)
    tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    drafts = run_draft(tokens[1:], hidden, 0)
    accepted = proposed = 0
    while len(tokens) - len(prompt) < max_new:
        n = len(tokens) - 1  # position of the last accepted token
        hidden = run_main([tokens[-1]] + drafts, n)
        # index_select copies rows the wrappers cannot trace, so rank 0 sends them: that path too.
        picks = model.compute_logits(hidden.index_select(0, torch.arange(hidden.shape[0]))).argmax(-1).tolist()
        a = 0
        while a < k and drafts[a] == picks[a]:
            a += 1
        accepted, proposed = accepted + a, proposed + k
        tokens += drafts[:a] + [picks[a]]
        drafts = run_draft(tokens[n + 1:], hidden[: a + 1], n)
    return {"tokens": tokens[len(prompt):len(prompt) + max_new], "accepted": accepted, "proposed": proposed,
            "drafts": proposals}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("nnodes", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("model_dir")
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
    torch.manual_seed(0)

    cfg = RendezvousConfig(f"127.0.0.1:{args.port}", args.nnodes, node_rank=args.rank, startup_timeout_s=60)
    group = rendezvous(cfg)
    parallel = build_parallel_state(group.rank, group.world_size, ep_size=args.ep_size)
    model, draft = load(args.model_dir, parallel)
    print(f"BYTES {READ_STATS.bytes_read}", flush=True)
    with torch.inference_mode():
        if group.rank != 0:
            code = run_worker(PlanExecutor(model, draft))
            leave_group()
            return code
        leader = LockstepLeader()
        result = greedy_mtp_generate(leader.wrap(model, MAIN), leader.wrap(draft, DRAFT), PROMPT, args.k,
                                     args.tokens)
        leader.stop_workers()
    leave_group()
    result["plans"], result["rows_sent"] = leader.plans_sent, leader.hidden_rows_sent
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
