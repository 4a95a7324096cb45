"""Command lines of the three engines, for one rank or for a whole StatefulSet.

    engine_argv(spec, ctx) -> list[str]

`ctx.rank` is an int for one concrete process (the local backend, tests) or
None for the rank-independent pod template, where the rank arrives in the
MTP_NODE_RANK environment variable (Kubernetes expands `$(MTP_NODE_RANK)` in
args). vLLM needs different flags per rank (`--headless` and the DP start rank
on non-zero ranks), and the builtin runtime and xLLM run one process per device
of a pod; those templates are fixed `sh -c` programs that receive every user value as a positional argument, so
nothing from the spec is ever parsed by a shell.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mtp_operator.constants import ENV_NODE_RANK
from mtp_operator.spec import MtpDeploymentSpec

RANK_FROM_ENV = f"$({ENV_NODE_RANK})"


class PlanError(ValueError):
    """A spec that validates but cannot be launched by its engine; names the field."""


@dataclass(frozen=True)
class LaunchContext:
    rank: int | None  # None: pod template (rank from the environment)
    nnodes: int
    master_host: str
    draft_model_path: str
    devices: str  # "cpu", "cuda:0,cuda:1", "npu:0,...,npu:7"
    http_port: int


def _flag(name: str, value: object) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"--{name}={value}"


def _serve_flags(spec: MtpDeploymentSpec) -> list[str]:
    """The runtime flags shared by the builtin runtime and xLLM (same names)."""
    rt = spec.runtime
    pairs = [
        ("max_memory_utilization", rt.max_memory_utilization), ("max_tokens_per_batch", rt.max_tokens_per_batch),
        ("max_seqs_per_batch", rt.max_seqs_per_batch), ("block_size", rt.block_size), ("ep_size", rt.ep_size),
        ("dp_size", rt.dp_size), ("enable_prefix_cache", rt.enable_prefix_cache),
        ("enable_chunked_prefill", rt.enable_chunked_prefill),
    ]
    return [_flag(name, value) for name, value in pairs if value is not None]


def _rank_text(ctx: LaunchContext) -> str:
    return RANK_FROM_ENV if ctx.rank is None else str(ctx.rank)


def _master_flag(spec: MtpDeploymentSpec, ctx: LaunchContext) -> str:
    return _flag("master_node_addr", f"{ctx.master_host}:{spec.ports.master}")


def _device_flags(ctx: LaunchContext) -> list[str]:
    return [_flag("devices", ctx.devices), _flag("draft_devices", ctx.devices), _flag("port", ctx.http_port)]


def _rank_flags(ctx: LaunchContext) -> list[str]:
    return [_flag("nnodes", ctx.nnodes), _flag("node_rank", _rank_text(ctx))]


# Both the builtin runtime and xLLM run one process per device (xLLM's
# published launch script starts 16 of them for 16 NPUs): `--nnodes` counts
# processes, `--node_rank` is the global process index, and each process has
# its own port. A pod with C devices runs C processes, each under a subshell
# that forwards SIGTERM to it; when one exits, the script stops the others and
# fails, so the container restarts and the gang restart sees it. Arguments: C,
# total processes, pod rank, first port, device kind, first device index (0 in
# a pod, which sees only its own devices), then the shared argv as "$@" (never
# parsed by the shell).
PER_DEVICE_SCRIPT = (
    'c=$1; total=$2; rank=$3; port=$4; kind=$5; first=$6; shift 6; self=$$; pids=; '
    'trap \'trap "" TERM INT; kill -TERM $pids 2>/dev/null; wait; exit 1\' TERM INT; '
    'i=0; while [ "$i" -lt "$c" ]; do '
    'd=$((first + i)); ( "$@" "--devices=$kind:$d" "--draft_devices=$kind:$d" "--port=$((port + i))" '
    '"--nnodes=$total" "--node_rank=$((rank * c + i))" & p=$!; '
    'trap \'kill -TERM $p 2>/dev/null\' TERM; wait $p; wait $p; kill -TERM $self ) & '
    'pids="$pids $!"; i=$((i + 1)); done; wait; exit 1'
)


def kubernetes_escaped(script: str) -> str:
    """A container arg the kubelet turns back into `script`: it reads `$$` as `$`
    and would expand `$(NAME)`, so every `$` is doubled."""
    return script.replace("$", "$$")


def devices_per_process(ctx: LaunchContext) -> int:
    """Devices of one pod (or local rank), each run by a process of its own."""
    return len(ctx.devices.split(","))


# Index of the engine's program in a per-device argv.
PER_DEVICE_PROGRAM = 10


def _per_device(shared: list[str], ctx: LaunchContext) -> list[str]:
    count = devices_per_process(ctx)
    script = PER_DEVICE_SCRIPT if ctx.rank is not None else kubernetes_escaped(PER_DEVICE_SCRIPT)
    kind, first = ctx.devices.split(",")[0].split(":")
    return ["/bin/sh", "-c", script, "per-device", str(count), str(ctx.nnodes * count), _rank_text(ctx),
            str(ctx.http_port), kind, first, *shared]


def is_per_device(argv: list[str]) -> bool:
    return argv[:2] == ["/bin/sh", "-c"] and argv[3:4] == ["per-device"]


def builtin_argv(spec: MtpDeploymentSpec, ctx: LaunchContext) -> list[str]:
    shared = ["mtp", "serve", _flag("model", spec.model.path), _flag("draft_model", ctx.draft_model_path),
              _flag("num_speculative_tokens", spec.speculative.num_speculative_tokens), _flag("host", "0.0.0.0")]
    if spec.speculative.adaptive:
        shared.append(_flag("speculative_adaptive", "true"))
    drain = [] if spec.runtime.shutdown_timeout is None else [_flag("shutdown_timeout", spec.runtime.shutdown_timeout)]
    tail = _serve_flags(spec) + drain + list(spec.extra_args)
    if devices_per_process(ctx) > 1:
        return _per_device([*shared, _master_flag(spec, ctx), *tail], ctx)
    if ctx.nnodes > 1:
        return shared + [_master_flag(spec, ctx)] + _device_flags(ctx) + _rank_flags(ctx) + tail
    return shared + _device_flags(ctx) + tail  # one process: no rendezvous


def xllm_argv(spec: MtpDeploymentSpec, ctx: LaunchContext) -> list[str]:
    # Flag names as in xLLM's published DeepSeek MTP launch script.
    shared = ["xllm", _flag("model", spec.model.path), _master_flag(spec, ctx),
              _flag("draft_model", ctx.draft_model_path),
              _flag("num_speculative_tokens", spec.speculative.num_speculative_tokens)]
    if ctx.devices.startswith("npu"):
        shared.append(_flag("communication_backend", "hccl"))
    tail = _serve_flags(spec) + list(spec.extra_args)
    if devices_per_process(ctx) > 1:
        return _per_device(shared + tail, ctx)
    return shared + _device_flags(ctx) + _rank_flags(ctx) + tail


def vllm_layout(spec: MtpDeploymentSpec, devices_per_node: int) -> tuple[int, int, int]:
    """(data-parallel size, DP ranks per node, tensor-parallel size) for vLLM."""
    dp = spec.runtime.dp_size or spec.nnodes
    if dp % spec.nnodes:
        raise PlanError(f"spec.runtime.dpSize={dp} must be a multiple of spec.nnodes={spec.nnodes} for engine vllm")
    dp_local = dp // spec.nnodes
    if devices_per_node % dp_local:
        raise PlanError(f"spec.accelerator.count={devices_per_node} must be a multiple of the DP ranks per node "
                        f"({dp_local} = spec.runtime.dpSize / spec.nnodes) for engine vllm")
    return dp, dp_local, devices_per_node // dp_local


def _vllm_common(spec: MtpDeploymentSpec, ctx: LaunchContext, devices_per_node: int) -> list[str]:
    dp, dp_local, tp = vllm_layout(spec, devices_per_node)
    speculative = {"method": "deepseek_mtp", "num_speculative_tokens": spec.speculative.num_speculative_tokens}
    argv = [
        "vllm", "serve", spec.model.path, "--host", "0.0.0.0", "--port", str(ctx.http_port),
        "--speculative-config", json.dumps(speculative, separators=(",", ":")),
        "--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp),
        "--data-parallel-size-local", str(dp_local),
    ]
    if spec.nnodes > 1:
        argv += ["--data-parallel-address", ctx.master_host, "--data-parallel-rpc-port", str(spec.ports.master)]
    rt = spec.runtime
    if (rt.ep_size or 1) > 1:
        argv.append("--enable-expert-parallel")
    if rt.max_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(rt.max_memory_utilization)]
    if rt.max_tokens_per_batch is not None:
        argv += ["--max-num-batched-tokens", str(rt.max_tokens_per_batch)]
    if rt.max_seqs_per_batch is not None:
        argv += ["--max-num-seqs", str(rt.max_seqs_per_batch)]
    if rt.block_size is not None:
        argv += ["--block-size", str(rt.block_size)]
    if rt.enable_prefix_cache is not None:
        argv.append("--enable-prefix-caching" if rt.enable_prefix_cache else "--no-enable-prefix-caching")
    if rt.enable_chunked_prefill is not None:
        argv.append("--enable-chunked-prefill" if rt.enable_chunked_prefill else "--no-enable-chunked-prefill")
    return argv + list(spec.extra_args)


# Non-zero ranks run headless and start at their first global DP rank. The
# script only reads MTP_NODE_RANK; everything else is "$@". `$$` is how a
# Kubernetes container arg spells a literal `$` before `(`.
VLLM_RANK_SCRIPT = (
    'if [ "${MTP_NODE_RANK:?}" -eq 0 ]; then exec "$@"; fi; '
    'exec "$@" --headless --data-parallel-start-rank "$$((MTP_NODE_RANK * MTP_DP_LOCAL))"'
)


def vllm_argv(spec: MtpDeploymentSpec, ctx: LaunchContext, devices_per_node: int) -> list[str]:
    argv = _vllm_common(spec, ctx, devices_per_node)
    _, dp_local, _ = vllm_layout(spec, devices_per_node)
    if ctx.rank is None:
        if spec.nnodes == 1:
            return argv
        return ["/bin/sh", "-c", VLLM_RANK_SCRIPT.replace("MTP_DP_LOCAL", str(dp_local)), "vllm-rank", *argv]
    if ctx.rank > 0:
        argv += ["--headless", "--data-parallel-start-rank", str(ctx.rank * dp_local)]
    return argv


# Why spec.speculative.adaptive is refused for an engine: neither has a per-step k chosen from acceptance
# and step cost. vLLM's dynamic speculation only switches drafting off above a batch size (and not when
# data-parallel ranks could disagree); xLLM's launch flags fix k.
NO_ADAPTIVE_DEPTH = {
    "vllm": "vllm has no adaptive speculative depth to map it to (its speculative config fixes "
            "num_speculative_tokens; its dynamic speculation only turns drafting off by batch size)",
    "xllm": "xllm has no adaptive speculative depth to map it to (its launch flags fix num_speculative_tokens)",
}


def engine_argv(spec: MtpDeploymentSpec, ctx: LaunchContext, devices_per_node: int) -> list[str]:
    if spec.speculative.adaptive and spec.engine in NO_ADAPTIVE_DEPTH:
        raise PlanError(f"spec.speculative.adaptive=true: {NO_ADAPTIVE_DEPTH[spec.engine]}; set it to false or "
                        f"use engine builtin")
    if spec.engine == "builtin":
        return builtin_argv(spec, ctx)
    if spec.engine == "xllm":
        return xllm_argv(spec, ctx)
    return vllm_argv(spec, ctx, max(devices_per_node, 1))


def serves_http(engine: str, rank: int) -> bool:
    """vLLM's headless ranks have no HTTP server; every other rank does."""
    return engine != "vllm" or rank == 0


def metrics_path(engine: str) -> str:
    return "/vars" if engine == "xllm" else "/metrics"
