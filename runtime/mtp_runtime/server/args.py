"""`mtp serve` flags: the xLLM launch names, parsed and validated up front.

Both `--flag=value` and `--flag value` work (argparse); booleans take
`--x=true|false` (a bare `--x` means true). Everything this build cannot
honour is rejected here, at start, with the flag named, so a pod fails fast
with a readable log instead of misbehaving under load.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

from mtp_runtime.flag_spellings import add_alternate_spellings
from mtp_runtime.multinode.node_rank import POD_INDEX_ENV, NodeRankError, resolve_node_rank

API_KEY_ENV = "MTP_API_KEY"  # used when --api_key is not given
# Seconds SIGTERM lets in-flight requests finish; the operator sizes the pods'
# terminationGracePeriodSeconds above it.
SHUTDOWN_TIMEOUT_DEFAULT = 30.0

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Far above any prompt a context holds (a 163840-token context is about 1 MB of token ids), far
# below what parsing would turn into gigabytes; bodies over it get 413 before they are read.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
_DEVICE_RE = re.compile(r"^(cpu|cuda:\d+|npu:\d+)$")


class ServeArgsError(ValueError):
    """A flag value this build cannot honour; the message starts with the flag."""


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_auto_bool(text: str) -> bool | None:
    """true/false as parse_bool, or auto (None: the engine decides)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected true, false or auto, got {text!r}") from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    # Abbreviations would let a typo like --draft silently mean --draft_model.
    parser.allow_abbrev = False
    add = parser.add_argument
    add("--model", required=True, help="main model directory (Hugging Face layout)")
    add("--draft_model", default=None, help="MTP draft model directory (from `mtp export`)")
    add("--num_speculative_tokens", type=int, default=None,
        help="draft tokens per step (default 1 with --draft_model, else 0)")
    add("--devices", default="cpu", help="cpu, cuda:N or npu:N (comma list for several)")
    add("--draft_devices", default=None, help="devices of the draft model (default: --devices)")
    add("--host", default="0.0.0.0", help="address to listen on")
    add("--port", type=int, default=8000, help="HTTP port (API, /health, /metrics)")
    add("--master_node_addr", default=None, help="HOST:PORT of rank 0 (multi-node)")
    add("--nnodes", type=int, default=1, help="number of node ranks")
    add("--node_rank", default="0", help=f"this node's rank, or auto (${POD_INDEX_ENV} or hostname ordinal)")
    add("--max_memory_utilization", type=float, default=0.9,
        help="fraction of device memory (CPU: free RAM) for weights and KV cache")
    add("--max_tokens_per_batch", type=int, default=2048, help="token budget of one engine step")
    add("--max_seqs_per_batch", type=int, default=64, help="sequences in one engine step")
    add("--block_size", type=int, default=16, help="tokens per KV cache block")
    add("--single_thread_tokens", type=int, default=8,
        help="a step of fewer tokens than this runs on one torch thread, larger ones on all (a second "
             "thread slows a step this small down); 0: every step on every thread (default 8)")
    add("--ep_size", type=int, default=1, help="expert-parallel size")
    add("--dp_size", type=int, default=1, help="attention data-parallel size")
    for name, default, what in (
        ("enable_prefix_cache", True, "reuse KV blocks of shared prompt prefixes"),
        ("enable_chunked_prefill", True, "split long prompts over several steps"),
        ("speculative_adaptive", False, "pick every step's k in 0..--num_speculative_tokens from measured "
                                        "acceptance and step cost"),
    ):
        add(f"--{name}", type=parse_bool, nargs="?", const=True, default=default,
            metavar="true|false", help=f"{what} (default {str(default).lower()})")
    add("--enable_graph", type=parse_auto_bool, nargs="?", const=True, default=None, metavar="true|false|auto",
        help="run decode steps as compiled graphs (torch.compile; start-up compiles them, or loads them from "
             "the disk cache, $TORCHINDUCTOR_CACHE_DIR); auto: wherever it can run (one node, a model that "
             "supports it, a C++ compiler on CPU), else eager (default auto)")
    add("--aot_step", type=parse_auto_bool, nargs="?", const=True, default=None, metavar="true|false|auto",
        help="graph mode's one-call decode step compiled ahead of time (AOTInductor; no Python compiler "
             "layer on the step's call path; cached in $MTP_AOT_CACHE_DIR, default $MTP_CACHE_DIR/aot); "
             "auto: where it can be (DeepSeek-V3 on CPU), else the torch.compile step (default auto)")
    add("--served_model_name", default=None, help="model name in the API (default: --model's folder name)")
    add("--dtype", default="auto", choices=DTYPES, help="working dtype (auto: bfloat16 on accelerators, float32 on cpu)")
    add("--api_key", default=None, help=f"required Bearer token (or ${API_KEY_ENV})")
    add("--max_waiting_requests", type=int, default=256,
        help="queued requests beyond which new ones get 429")
    add("--max_model_len", type=int, default=None, help="context limit (default: the model's)")
    add("--shutdown_timeout", type=float, default=SHUTDOWN_TIMEOUT_DEFAULT,
        help="seconds SIGTERM waits for in-flight requests before aborting them")
    add("--max_request_bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 8 MiB)")
    add_alternate_spellings(parser)


@dataclass
class ServeArgs:
    model: str
    draft_model: str | None
    num_speculative_tokens: int
    devices: list[str]
    draft_devices: list[str]
    host: str
    port: int
    master_node_addr: str | None
    nnodes: int
    node_rank: int
    max_memory_utilization: float
    max_tokens_per_batch: int
    max_seqs_per_batch: int
    block_size: int
    ep_size: int
    dp_size: int
    enable_prefix_cache: bool
    enable_chunked_prefill: bool
    served_model_name: str
    dtype: str
    api_key: str | None
    max_waiting_requests: int
    max_model_len: int | None
    shutdown_timeout: float
    env: dict[str, str] = field(default_factory=dict, repr=False)
    enable_graph: bool | None = None  # None: auto (models/graph.py, resolve_graph)
    aot_step: bool | None = None  # None: auto (engine/aot_step.py)
    speculative_adaptive: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    single_thread_tokens: int = 8  # EngineConfig.single_thread_tokens


def resolve_dtype(dtype: str, device: str) -> str:
    """--dtype auto as a dtype name: CPUs have no fast bf16 matmul everywhere; accelerators do."""
    if dtype != "auto":
        return dtype
    return "float32" if device == "cpu" else "bfloat16"


def parse_devices(flag: str, text: str) -> list[str]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise ServeArgsError(f"--{flag}: empty device list; use cpu, cuda:N or npu:N")
    for d in devices:
        if not _DEVICE_RE.match(d):
            raise ServeArgsError(f"--{flag}: {d!r} is not a device; use cpu, cuda:N or npu:N")
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) > 1:
        raise ServeArgsError(f"--{flag}: mixes device kinds {sorted(kinds)}; use one kind")
    if len(set(devices)) != len(devices):
        raise ServeArgsError(f"--{flag}: lists a device twice: {text}")
    return devices


def _check_range(flag: str, value: float, low: float, high: float | None = None,
                 low_inclusive: bool = True) -> None:
    too_low = value < low if low_inclusive else value <= low
    if too_low or (high is not None and value > high):
        bound = f"{'>=' if low_inclusive else '>'} {low}" + (f" and <= {high}" if high is not None else "")
        raise ServeArgsError(f"--{flag}: {value} is out of range; it must be {bound}")


def _check_accelerator(flag: str, devices: list[str]) -> None:
    kind = devices[0].split(":")[0]
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise ServeArgsError(
                f"--{flag}: {devices[0]} needs torch_npu, which is not installed ({exc}); "
                "install the npu extra (pip install 'mtp-operator[npu]') on an Ascend CANN image, "
                "or use --devices cpu"
            ) from None
    elif kind == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for d in devices:
            if int(d.split(":")[1]) >= count:
                raise ServeArgsError(f"--{flag}: {d} is not available (this host has {count} CUDA devices)")


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises ServeArgsError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ServeArgsError(message)


def parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    """`mtp serve`'s flags (no program name) parsed as the server parses them
    (both spellings, as the `mtp` command adds them); ServeArgsError for an
    unknown flag or a value of the wrong type."""
    from mtp_runtime.flag_spellings import add_alternate_spellings

    parser = _RaisingParser(prog="mtp serve", add_help=False)
    add_serve_arguments(parser)
    add_alternate_spellings(parser)
    return parser.parse_args(argv)


def validate_serve_args(ns: argparse.Namespace, env: dict[str, str] | None = None,
                        hostname: str | None = None, check_devices: bool = True,
                        check_files: bool = True) -> ServeArgs:
    """Turn parsed flags into ServeArgs, or raise ServeArgsError naming the flag.

    check_files=False and check_devices=False leave out what only the serving
    machine can tell (model directories, devices): the operator checks a spec's
    flags this way before it starts a pod that would refuse them.
    """
    env = dict(os.environ if env is None else env)
    if check_files and not os.path.isfile(os.path.join(ns.model, "config.json")):
        raise ServeArgsError(f"--model: {ns.model} has no config.json; pass a model directory")
    if (check_files and ns.draft_model is not None
            and not os.path.isfile(os.path.join(ns.draft_model, "config.json"))):
        raise ServeArgsError(f"--draft_model: {ns.draft_model} has no config.json; pass the `mtp export` output")
    k = ns.num_speculative_tokens
    if k is None:
        k = 1 if ns.draft_model else 0
    _check_range("num_speculative_tokens", k, 0, 8)
    if k > 0 and ns.draft_model is None:
        raise ServeArgsError("--num_speculative_tokens: needs --draft_model (the MTP draft to propose tokens)")
    if ns.speculative_adaptive and k < 1:
        raise ServeArgsError("--speculative_adaptive=true: needs --num_speculative_tokens >= 1 (the largest k "
                             "it may choose) and --draft_model")
    devices = parse_devices("devices", ns.devices)
    draft_devices = parse_devices("draft_devices", ns.draft_devices or ns.devices)
    if len(devices) > 1:
        raise ServeArgsError(
            f"--devices: {len(devices)} devices in one process are not supported by this build; "
            "run one rank per device with --nnodes"
        )
    if draft_devices != devices:
        raise ServeArgsError("--draft_devices: must equal --devices in this build (the draft shares the main device)")
    _check_range("port", ns.port, 1, 65535)
    _check_range("nnodes", ns.nnodes, 1)
    try:
        node_rank = resolve_node_rank(ns.node_rank, ns.nnodes, env, hostname)
    except NodeRankError as exc:
        message = str(exc)
        raise ServeArgsError(message if message.startswith("--node_rank") else f"--node_rank: {message}") from None
    if ns.master_node_addr is not None:
        host, sep, port = ns.master_node_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ServeArgsError(f"--master_node_addr: {ns.master_node_addr!r} is not HOST:PORT")
    if ns.nnodes > 1:
        if ns.master_node_addr is None:
            raise ServeArgsError("--master_node_addr: required when --nnodes > 1")
        if ns.enable_graph:
            raise ServeArgsError("--enable_graph: not supported with --nnodes > 1 in this build (the worker "
                                 "ranks run eager); use --enable_graph=false or auto")
        ns.enable_graph = False  # auto: a group of ranks runs eager
        if ns.ep_size not in (1, ns.nnodes):
            raise ServeArgsError(f"--ep_size: {ns.ep_size} must be 1 (experts split by size over all ranks) "
                                 f"or --nnodes {ns.nnodes} (one slice of the experts per rank)")
    _check_range("max_memory_utilization", ns.max_memory_utilization, 0.0, 1.0, low_inclusive=False)
    _check_range("max_tokens_per_batch", ns.max_tokens_per_batch, k + 1)  # a verify step takes k + 1 tokens
    _check_range("max_seqs_per_batch", ns.max_seqs_per_batch, 1)
    _check_range("block_size", ns.block_size, 1, 1024)
    _check_range("single_thread_tokens", ns.single_thread_tokens, 0)
    _check_range("ep_size", ns.ep_size, 1)
    if ns.ep_size > ns.nnodes * len(devices):
        raise ServeArgsError(
            f"--ep_size: {ns.ep_size} exceeds the {ns.nnodes * len(devices)} devices of the group"
        )
    _check_range("dp_size", ns.dp_size, 1)
    if ns.dp_size > 1:
        raise ServeArgsError("--dp_size: attention data parallelism is not supported by this build; use --dp_size 1")
    _check_range("max_waiting_requests", ns.max_waiting_requests, 0)
    if ns.max_model_len is not None:
        _check_range("max_model_len", ns.max_model_len, 2)
    _check_range("shutdown_timeout", ns.shutdown_timeout, 0.0)
    _check_range("max_request_bytes", ns.max_request_bytes, 1024)
    if check_devices:
        _check_accelerator("devices", devices)
    served = ns.served_model_name or os.path.basename(os.path.normpath(ns.model))
    if not served.strip():
        raise ServeArgsError("--served_model_name: must not be empty")
    api_key = ns.api_key if ns.api_key is not None else (env.get(API_KEY_ENV) or None)
    if api_key is not None and not api_key.strip():
        raise ServeArgsError("--api_key: must not be empty (omit it to serve without a key)")
    return ServeArgs(
        model=ns.model, draft_model=ns.draft_model, num_speculative_tokens=k,
        devices=devices, draft_devices=draft_devices, host=ns.host, port=ns.port,
        master_node_addr=ns.master_node_addr, nnodes=ns.nnodes, node_rank=node_rank,
        max_memory_utilization=ns.max_memory_utilization,
        max_tokens_per_batch=ns.max_tokens_per_batch, max_seqs_per_batch=ns.max_seqs_per_batch,
        block_size=ns.block_size, ep_size=ns.ep_size, dp_size=ns.dp_size,
        enable_prefix_cache=ns.enable_prefix_cache, enable_chunked_prefill=ns.enable_chunked_prefill,
        served_model_name=served, dtype=ns.dtype, api_key=api_key,
        max_waiting_requests=ns.max_waiting_requests, max_model_len=ns.max_model_len,
        shutdown_timeout=ns.shutdown_timeout, env=env, enable_graph=ns.enable_graph, aot_step=ns.aot_step,
        speculative_adaptive=ns.speculative_adaptive,
        max_request_bytes=ns.max_request_bytes, single_thread_tokens=ns.single_thread_tokens,
    )
