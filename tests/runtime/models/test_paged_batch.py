"""Many sequences in one flattened batch with scattered block tables give each sequence's own logits."""

from __future__ import annotations

import pytest
import torch

from mtp_runtime.layers.attention import AttentionMetadata
from mtp_runtime.models.loader import load_model

BLOCK = 4


def seq(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def batch_meta(steps: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """steps[i] = (tokens already cached, new tokens) of sequence i."""
    qsl, slots = [0], []
    for (cached, new), table in zip(steps, tables):
        qsl.append(qsl[-1] + new)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new)]
    return AttentionMetadata(qsl, [c + n for c, n in steps], tables, torch.tensor(slots), BLOCK)


@pytest.mark.parametrize("case", ["deepseek_v32", "glm4_moe"])
def test_mixed_prefill_decode_and_verify_in_one_batch(tiny_dirs, reference_model, case):
    model, ref = load_model(tiny_dirs[case]), reference_model(tiny_dirs[case])
    seqs = [seq(19, 10), seq(25, 11), seq(7, 12)]
    # scattered, interleaved block ids across sequences (block 0 unused)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(5)).tolist()
    tables = [perm[0:5], perm[5:12], perm[12:14]]
    caches = [{k: torch.zeros(24, BLOCK, *s) for k, s in spec.items()} for spec in model.kv_cache_spec()]
    got: list[list[torch.Tensor]] = [[], [], []]

    def step(plan: list[tuple[int, int, int]]) -> None:
        """plan: (sequence, cached, new) for the sequences in this step."""
        meta = batch_meta([(c, n) for _, c, n in plan], [tables[i] for i, _, _ in plan])
        ids = torch.cat([seqs[i][c:c + n] for i, c, n in plan])
        positions = torch.cat([torch.arange(c, c + n) for _, c, n in plan])
        logits = model.compute_logits(model(ids, positions, caches, meta))
        for (i, _, n), part in zip(plan, logits.split([n for _, _, n in plan])):
            got[i].append(part)

    with torch.no_grad():
        step([(0, 0, 14), (1, 0, 9)])  # two prefills (seq 1 chunked)
        step([(1, 9, 16), (0, 14, 1), (2, 0, 7)])  # chunked prefill rest, a decode, a new prefill
        step([(2, 7, 0), (0, 15, 4)])  # an idle sequence and a 4-token verify
        for i, s in enumerate(seqs):
            expected = ref(s[None]).logits[0]
            assert (torch.cat(got[i]) - expected).abs().max().item() <= 1e-4, f"sequence {i}"


def test_metadata_rejects_inconsistent_batches():
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata([0, 5], [9], [[0]], torch.arange(5), 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        AttentionMetadata([0, 5], [5], [[0, 1]], torch.arange(4), 4)
    with pytest.raises(ValueError, match="context_len"):
        AttentionMetadata([0, 5], [3], [[0, 1]], torch.arange(5), 4)
