"""The builtin engine's flags, judged by `mtp serve`'s own validator before any pod starts.

    builtin_flag_errors(spec) -> list[str]   # ["runtime.blockSize: mtp serve refuses it at start: --block_size: ..."]

A spec the builtin runtime would refuse at start-up makes every rank pod
crash-loop, so `parse_spec` refuses it instead. The check builds the argv the
plan gives process 0 of rank 0 (with the flags the per-device script adds),
parses it with the runtime's own parser and runs the runtime's own
`validate_serve_args`, leaving out only what the serving machine alone can
tell (model files, devices). No range or fit rule is repeated here.
"""

from __future__ import annotations

import re

from mtp_runtime.server.args import ServeArgsError, parse_serve_argv, validate_serve_args

from mtp_operator.engines import PER_DEVICE_PROGRAM, LaunchContext, builtin_argv, is_per_device
from mtp_operator.plan import accelerator_kind, device_list
from mtp_operator.spec import MtpDeploymentSpec

# `mtp serve` flag -> the spec field that sets it (relative to spec).
FLAG_FIELDS = {
    "model": "model.path",
    "draft_model": "draftModel.path",
    "num_speculative_tokens": "speculative.numSpeculativeTokens",
    "devices": "accelerator",
    "draft_devices": "accelerator",
    "port": "ports.http",
    "master_node_addr": "ports.master",
    "nnodes": "nnodes",
    "node_rank": "nnodes",
    "max_memory_utilization": "runtime.maxMemoryUtilization",
    "max_tokens_per_batch": "runtime.maxTokensPerBatch",
    "max_seqs_per_batch": "runtime.maxSeqsPerBatch",
    "block_size": "runtime.blockSize",
    "ep_size": "runtime.epSize",
    "dp_size": "runtime.dpSize",
    "enable_prefix_cache": "runtime.enablePrefixCache",
    "enable_chunked_prefill": "runtime.enableChunkedPrefill",
    "shutdown_timeout": "runtime.shutdownTimeout",
}
_FLAG = re.compile(r"--([A-Za-z0-9_-]+)")


def first_process_flags(spec: MtpDeploymentSpec) -> list[str]:
    """`mtp serve`'s flags (no program) for process 0 of rank 0, as the pod would run it."""
    kind = accelerator_kind(spec)
    count = spec.accelerator.count
    ctx = LaunchContext(rank=0, nnodes=spec.nnodes, master_host="rank-0", draft_model_path=(
        spec.draft_model.path if spec.draft_model else spec.export.output_path),  # type: ignore[union-attr]
        devices=device_list(kind, count), http_port=spec.ports.http)
    argv = builtin_argv(spec, ctx)
    if not is_per_device(argv):
        return argv[2:]  # past "mtp serve"
    # The per-device script's positional arguments: count, total processes, pod rank, first port, kind, first device.
    _, total, rank, port, kind, first = argv[4:PER_DEVICE_PROGRAM]
    return argv[PER_DEVICE_PROGRAM + 2:] + [f"--devices={kind}:{first}", f"--draft_devices={kind}:{first}",
                                            f"--port={port}", f"--nnodes={total}", f"--node_rank={rank}"]


def _extra_arg_flags(spec: MtpDeploymentSpec) -> set[str]:
    return {m.group(1).replace("-", "_") for a in spec.extra_args if (m := _FLAG.match(a))}


def _field_of(message: str, spec: MtpDeploymentSpec) -> str:
    match = _FLAG.search(message)
    flag = match.group(1).replace("-", "_") if match else ""
    if flag in _extra_arg_flags(spec) or flag not in FLAG_FIELDS:
        return "extraArgs"  # the last value of a flag wins, and extraArgs come last
    return FLAG_FIELDS[flag]


def builtin_flag_errors(spec: MtpDeploymentSpec) -> list[str]:
    """Why `mtp serve` would refuse this spec's flags at start (empty: it would not); other engines: []."""
    if spec.engine != "builtin":
        return []
    try:
        validate_serve_args(parse_serve_argv(first_process_flags(spec)), env={}, check_devices=False,
                            check_files=False)
    except ServeArgsError as exc:
        return [f"{_field_of(str(exc), spec)}: the builtin engine (mtp serve) would refuse it at start: {exc}"]
    return []
