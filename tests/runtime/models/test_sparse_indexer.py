"""V3.2 indexer selection: ties are broken by key position, whatever masked keys follow."""

import torch

from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.config import ModelConfig
from mtp_runtime.models.sparse_indexer import SparseIndexer

HEADS, DIM, TOPK = 2, 4, 3


def indexer():
    config = ModelConfig.from_dict(build_config("deepseek_v32", hidden_size=32, q_lora_rank=16, qk_rope_head_dim=DIM,
                                                index_topk=TOPK, index_n_heads=HEADS, index_head_dim=DIM))
    return SparseIndexer(config)


def tied_keys(num_keys):
    """Keys 2 and 5 score positive against an all-ones query; every other key scores relu(<0) = 0."""
    keys = -torch.ones(num_keys, DIM)
    keys[2] = keys[5] = torch.ones(DIM)
    keys[5] *= 2
    return keys


def test_ties_go_to_the_earliest_key_and_masked_keys_change_nothing():
    ix = indexer()
    q, weights = torch.ones(1, HEADS, DIM), torch.ones(1, HEADS)
    decode = ix.select(q, tied_keys(8), weights, torch.ones(1, 8, dtype=torch.bool))
    # The same query inside a verify pass: four more keys (future, masked) that would win the tie.
    future = tied_keys(12)
    future[8:] = torch.ones(4, DIM) * 3
    allowed = torch.arange(12)[None, :] <= 7
    verify = ix.select(q, future, weights, allowed)
    assert decode[0].nonzero().flatten().tolist() == [0, 2, 5]
    assert verify[0, :8].equal(decode[0]) and not verify[0, 8:].any()


def test_fewer_allowed_keys_than_topk_select_only_allowed_ones():
    ix = indexer()
    allowed = torch.arange(6)[None, :] <= 1  # a query at position 1 of a 6-key chunk
    picked = ix.select(torch.ones(1, HEADS, DIM), tied_keys(6), torch.ones(1, HEADS), allowed)
    assert picked[0].nonzero().flatten().tolist() == [0, 1]
