"""Each rank reads only its own shard of the checkpoint, and gets the same weights
as the slice of an unsharded load (no process group needed to load)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mtp_runtime.checkpoint.safetensors_io import READ_STATS
from mtp_runtime.distributed import ParallelState
from mtp_runtime.models.loader import load_draft, load_model


def load(model_dir, parallel: ParallelState) -> tuple[dict[str, torch.Tensor], int]:
    READ_STATS.reset()
    main = load_model(model_dir, parallel=parallel)
    draft = load_draft(model_dir, main=main, parallel=parallel)
    params = {f"main.{n}": p.detach() for n, p in main.named_parameters()}
    params.update({f"draft.{n}": p.detach() for n, p in draft.named_parameters()})
    return params, READ_STATS.bytes_read


def expected_shard(name: str, full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """The slice of the unsharded parameter that rank `rank` of 2 must hold."""
    if local.shape == full.shape:
        return full
    if name.endswith("experts.w13") and local.shape[0] == full.shape[0]:  # TP-split experts: gate rows, up rows
        inter, local_inter = full.shape[1] // 2, local.shape[1] // 2
        gate = full[:, :inter].narrow(1, rank * local_inter, local_inter)
        up = full[:, inter:].narrow(1, rank * local_inter, local_inter)
        return torch.cat([gate, up], dim=1)
    dim = next(d for d in range(full.dim()) if full.shape[d] != local.shape[d])
    size = local.shape[dim]
    return full.narrow(dim, rank * size, size)


@pytest.fixture(scope="module")
def tiny_dsv3_fp8(tmp_path_factory):
    """DeepSeek-V3's published layout: FP8 e4m3 linear weights with 128x128 block scales."""
    out = tmp_path_factory.mktemp("multinode-fp8") / "tiny-dsv3-fp8"
    subprocess.run([sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3", "--fp8",
                    "--out", str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def checkpoint(request):
    model_dir = request.getfixturevalue("tiny_dsv3" if request.param == "bf16" else "tiny_dsv3_fp8")
    return model_dir, load(model_dir, ParallelState())


@pytest.mark.parametrize("ep_size", [1, 2])
def test_each_rank_reads_and_holds_only_its_shard(checkpoint, ep_size):
    model_dir, (full, full_bytes) = checkpoint
    per_rank = []
    for rank in range(2):
        parallel = ParallelState(tp_rank=rank, tp_size=2, ep_rank=rank if ep_size > 1 else 0, ep_size=ep_size)
        params, bytes_read = load(model_dir, parallel)
        per_rank.append(bytes_read)
        assert params.keys() == full.keys()
        for name, local in params.items():
            assert not torch.isnan(local).any(), name
            assert torch.equal(local, expected_shard(name, full[name], local, rank)), name
    # Only replicated tensors (norms, low-rank projections, router, eh_proj, FP8 block scales) are read whole.
    assert all(b < 0.6 * full_bytes for b in per_rank), (per_rank, full_bytes)
