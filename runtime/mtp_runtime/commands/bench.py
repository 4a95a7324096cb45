"""`mtp bench`: serving benchmark against an OpenAI-compatible server, or baseline vs MTP locally."""

from __future__ import annotations

import argparse
import shlex
import sys

HELP = "serving benchmark: TTFT, TPOT, throughput and acceptance vs concurrency"
DESCRIPTION = """\
Serving benchmark in the shape NPU serving engines publish for MTP: for each
concurrency level, requests of a set input and output length (prompts cut from
held-out corpus text, sent as token ids, ignore_eos, greedy unless
--temperature), reporting Mean TTFT (ms), Mean TPOT (ms), Output tokens/s,
Total tokens/s and the acceptance rate read from the server's own /metrics.

  mtp bench --url http://host:8000 --tokenizer MODEL_DIR      # any OpenAI-compatible server
  mtp bench --model DIR --draft_model DRAFT_DIR               # starts baseline and MTP servers itself

Writes bench.md, bench.json and bench.png to --out.
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server (http://host:port)")
    target.add_argument("--model", help="model directory: start a baseline and an MTP server locally")
    parser.add_argument("--draft_model", "--draft-model", dest="draft_model", default=None,
                        help="MTP draft directory for local mode (default: --model, whose MTP layer is used)")
    parser.add_argument("--num-speculative-tokens", type=_positive, default=1, help="MTP tokens for local mode")
    parser.add_argument("--serve-args", default="", help="extra `mtp serve` flags for both local servers")
    parser.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: --model)")
    parser.add_argument("--api-key", default=None, help="Bearer token for --url")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16], help="levels, e.g. 1,2,4,8,16")
    parser.add_argument("--input-len", type=_positive, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=_positive, default=128, help="generated tokens per request")
    parser.add_argument("--output-spread", type=int, default=0,
                        help="each request generates --output-len + a seeded offset in [-N, N] tokens, the same "
                             "on every server (default 0: all equal; equal lengths keep requests that start "
                             "together finishing together at k = 0, which real traffic does not)")
    parser.add_argument("--requests-per-level", type=int, default=0,
                        help="requests at each level (default: max(8, --requests-per-client x concurrency))")
    parser.add_argument("--requests-per-client", type=_positive, default=4,
                        help="each client's requests at a level when --requests-per-level is 0; more of them "
                             "weigh a level's steady state over its start and its end (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    parser.add_argument("--rounds", type=_positive, default=2,
                        help="turns the servers take within each level (evens out a machine's load drift)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; > 0: sampled, seeded per request, so acceptance is "
                             "speculative sampling's")
    parser.add_argument("--startup-timeout", type=_positive, default=900,
                        help="seconds each local server may take to load (and in graph mode, the default, compile) "
                             "before its /health answers 200")
    parser.add_argument("--out", default="bench-results", help="output directory")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    from pathlib import Path

    from mtp_runtime.bench.prompts import load_tokenizer
    from mtp_runtime.bench.report import markdown_table, throughput_ratios, write_outputs
    from mtp_runtime.bench.suite import BenchPlan, bench_local, bench_servers, output_spread_error

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
    if args.requests_per_level < 0:
        print("mtp bench: --requests-per-level must be >= 0", file=sys.stderr)
        return 2
    spread_error = output_spread_error(args.output_spread, args.output_len)
    if spread_error:
        print(f"mtp bench: {spread_error}", file=sys.stderr)
        return 2
    if not 0 <= args.temperature <= 2:
        print("mtp bench: --temperature must be in [0, 2]", file=sys.stderr)
        return 2
    tokenizer_dir = args.tokenizer or args.model
    if tokenizer_dir is None:
        print("mtp bench: --tokenizer DIR is required with --url (prompts are sent as token ids)", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (FileNotFoundError, Exception) as exc:  # tokenizers raises its own exception type
        print(f"mtp bench: --tokenizer: {exc}", file=sys.stderr)
        return 2
    plan = BenchPlan(concurrency=args.concurrency, input_len=args.input_len, output_len=args.output_len,
                     requests_per_level=args.requests_per_level, seed=args.seed, temperature=args.temperature,
                     rounds=args.rounds, requests_per_client=args.requests_per_client,
                     output_spread=args.output_spread)
    config = {"input_len": plan.input_len, "output_len": plan.output_len, "output_spread": plan.output_spread,
              "concurrency": plan.concurrency,
              "temperature": plan.temperature, "rounds": plan.rounds,
              "requests_per_level": [plan.requests_for(c) for c in plan.concurrency]}
    try:
        if args.url:
            runs = asyncio.run(bench_servers({"server": args.url.rstrip("/")}, tokenizer, plan, args.api_key))
            config["url"] = args.url
        else:
            draft = args.draft_model or args.model
            config.update(model=args.model, draft_model=draft, num_speculative_tokens=args.num_speculative_tokens,
                          serve_args=args.serve_args)
            runs = bench_local(args.model, draft, args.num_speculative_tokens, tokenizer, plan,
                               shlex.split(args.serve_args), startup_timeout_s=args.startup_timeout)
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        print(f"mtp bench: {exc}", file=sys.stderr)
        return 1
    paths = write_outputs(runs, config, Path(args.out), plot=not args.no_plot)
    print(markdown_table(runs))
    for concurrency, ratio in throughput_ratios(runs).items():
        print(f"MTP/baseline output tokens/s at concurrency {concurrency}: {ratio:.2f}x")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    failed = sum(r.failed for levels in runs.values() for r in levels)
    return 1 if failed else 0
