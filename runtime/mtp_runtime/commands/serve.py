"""`mtp serve`: the OpenAI-compatible server each pod runs (xLLM launch flags)."""

from __future__ import annotations

import argparse
import sys

from mtp_runtime.server.args import add_serve_arguments

HELP = "serve a model over the OpenAI API with MTP speculative decoding (/health, /metrics)"
DESCRIPTION = """\
Serve a model over the OpenAI HTTP API: /v1/completions, /v1/chat/completions
(stream: true for server-sent events), /v1/models, plus /health and Prometheus
/metrics. The flags are the xLLM launch flags, as `--flag=value` or
`--flag value`; booleans as `--x=true|false`.

  mtp serve --model /models/tiny --draft_model /models/tiny-mtp --num_speculative_tokens 1 --port 8000

SIGTERM stops accepting requests, lets in-flight ones finish within
--shutdown_timeout seconds (then aborts them) and exits 0.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_serve_arguments(parser)
    parser.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error"),
                        help="log verbosity")


def run(args: argparse.Namespace) -> int:
    import logging

    from mtp_runtime.server.args import ServeArgsError, validate_serve_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve_args = validate_serve_args(args)
    except ServeArgsError as exc:
        print(f"mtp serve: {exc}", file=sys.stderr)
        return 2
    from mtp_runtime.server.launch import ServerSetupError, serve

    try:
        return serve(serve_args, log_level=args.log_level)
    except ServerSetupError as exc:
        print(f"mtp serve: {exc}", file=sys.stderr)
        return 2
