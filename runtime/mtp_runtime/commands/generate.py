"""`mtp generate`: continue one prompt on the engine (optionally speculative with an MTP draft)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "generate a continuation of one prompt (greedy by default)"
DESCRIPTION = """\
Continue --prompt with the model in --model. With --draft_model (an `mtp export`
directory, or the main checkpoint itself to use its built-in MTP layer) and
--num_speculative_tokens K, each step drafts K tokens and verifies them in one
main-model forward; the output is identical to decoding without the draft.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="main checkpoint directory (Hugging Face layout)")
    parser.add_argument("--draft_model", default=None, help="MTP draft directory (or the main checkpoint)")
    parser.add_argument("--num_speculative_tokens", type=int, default=None,
                        help="draft tokens per step (default 1 with --draft_model, else 0)")
    parser.add_argument("--max_tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="working dtype")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: text, token_ids, draft_tokens, accepted_tokens, "
                             "accepted_per_position")
    parser.add_argument("--prompt", required=True, help="prompt text")


def run(args: argparse.Namespace) -> int:
    k = args.num_speculative_tokens
    if k is None:
        k = 1 if args.draft_model else 0
    if k < 0 or args.max_tokens < 0 or args.temperature < 0:
        print("error: --num_speculative_tokens, --max_tokens and --temperature must be >= 0", file=sys.stderr)
        return 2
    if k > 0 and not args.draft_model:
        print("error: --num_speculative_tokens > 0 needs --draft_model", file=sys.stderr)
        return 2

    from mtp_runtime.engine.llm import LLM
    from mtp_runtime.sampling_params import SamplingParams

    try:
        llm = LLM(args.model, draft_model=args.draft_model if k else None, num_speculative_tokens=k,
                  dtype=args.dtype, device=args.device, max_seqs_per_batch=1)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        result = llm.generate(args.prompt, params)[0]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = result.text
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": result.token_ids,
            "draft_tokens": result.draft_tokens,
            "accepted_tokens": result.accepted_tokens,
            "accepted_per_position": result.accepted_per_position,
            "finish_reason": result.finish_reason,
        }))
    else:
        print(text)
    return 0
