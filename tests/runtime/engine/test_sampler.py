"""Sampler: top-k/top-p, seeded randomness, greedy and speculative acceptance (chi-square)."""

import torch

from mtp_runtime.engine.sampler import (RowParams, greedy_verify, probabilities, sample_from,
                                        speculative_verify, uniform_rows)
from mtp_runtime.sampling_params import SamplingParams

# 99.9% quantile of chi-square with 5 degrees of freedom (vocabulary of 6).
CHI2_5DF_999 = 20.515


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_top_k_and_top_p_mask_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=1.0, top_p=0.7)]
    probs = probabilities(logits, RowParams.build(params, 4, "cpu"))
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[2], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    hot = probabilities(logits, RowParams.build([SamplingParams(temperature=2.0)], 2, "cpu"))
    cold = probabilities(logits, RowParams.build([SamplingParams(temperature=0.5)], 2, "cpu"))
    assert cold[0, 0] > hot[0, 0] > 0.5


def test_seeded_rows_do_not_depend_on_the_batch():
    def rows(seeds):
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        return uniform_rows(gens, 8, "cpu", torch.Generator().manual_seed(99))

    a = rows([7, None, 8])
    b = rows([None, None, 8, 7])
    torch.testing.assert_close(a[0], b[3])
    torch.testing.assert_close(a[2], b[2])
    assert (a > 0).all() and (a <= 1).all()


def test_greedy_verify_counts_leading_matches():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    assert greedy_verify(target, drafts).tolist() == [3, 1, 0]


def test_greedy_verify_matches_a_loop_on_every_pattern():
    """Every match pattern of k = 1..4 drafts (later matches after a mismatch do not count)."""
    for k in range(1, 5):
        patterns = torch.tensor([[(p >> j) & 1 for j in range(k)] for p in range(2 ** k)], dtype=torch.bool)
        target = torch.randint(0, 50, (len(patterns), k + 1), generator=torch.Generator().manual_seed(k))
        drafts = torch.where(patterns, target[:, :k], target[:, :k] + 1)
        expected = []
        for row in patterns.tolist():
            a = 0
            while a < k and row[a]:
                a += 1
            expected.append(a)
        assert greedy_verify(target, drafts).tolist() == expected


def run_speculative(p, q, n, seed, accept_all=False):
    """Draw n speculative steps with fixed per-position target p [k+1, V] and draft q [k, V]."""
    g = torch.Generator().manual_seed(seed)
    k, v = q.shape
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    accept_u = 1.0 - torch.rand(n, k, generator=g)
    token_u = 1.0 - torch.rand(n, v, generator=g)
    target = p.expand(n, -1, -1)
    draft = q.expand(n, -1, -1)
    if accept_all:
        accept_u = torch.zeros_like(accept_u)
    num_acc, next_tok = speculative_verify(target, draft, drafts, accept_u, token_u)
    # Emitted tokens: the accepted drafts, then the replacement/bonus token.
    emitted = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
    emitted[torch.arange(n), num_acc] = next_tok
    return num_acc, emitted


def test_speculative_sampling_matches_the_target_distribution():
    p = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
                      [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                      [0.40, 0.05, 0.05, 0.20, 0.20, 0.10]])
    q = torch.tensor([[0.10, 0.40, 0.10, 0.20, 0.10, 0.10],
                      [0.20, 0.05, 0.05, 0.30, 0.30, 0.10]])
    num_acc, emitted = run_speculative(p, q, 60000, seed=1234)
    # Position j's token is emitted when the j-1 earlier drafts were accepted;
    # with context-free targets it must follow p[j].
    for j in range(3):
        rows = num_acc >= j
        assert rows.sum() > 5000
        stat = chi_square(emitted[rows, j], p[j])
        assert stat < CHI2_5DF_999, f"position {j}: chi-square {stat:.1f}"
    # Some drafts are rejected and some accepted: the test exercises both branches.
    assert 0 < (num_acc == 0).float().mean() < 1 and (num_acc == 2).any()


def test_filler_drafts_with_a_one_hot_draft_distribution_keep_the_target_distribution():
    """Adaptive depth verifies filler after a step at a lower k (ModelRunner._set_drafts): a fixed
    token whose q is one-hot. Speculative sampling stays exact for it: every position still follows p."""
    p = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
                      [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                      [0.40, 0.05, 0.05, 0.20, 0.20, 0.10]])
    real = torch.tensor([0.10, 0.40, 0.10, 0.20, 0.10, 0.10])
    q = torch.stack([real, torch.nn.functional.one_hot(torch.tensor(4), 6).float()])  # draft 2 is filler: token 4
    num_acc, emitted = run_speculative(p, q, 60000, seed=99)
    for j in range(3):
        rows = num_acc >= j
        assert rows.sum() > 5000
        stat = chi_square(emitted[rows, j], p[j])
        assert stat < CHI2_5DF_999, f"position {j}: chi-square {stat:.1f}"
    assert (num_acc == 2).any() and (num_acc == 1).any()  # the filler is accepted at times and rejected at others


def test_the_chi_square_check_catches_a_wrong_sampler():
    p = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05], [1 / 6] * 6])
    q = torch.tensor([[0.10, 0.40, 0.10, 0.20, 0.10, 0.10]])
    _, emitted = run_speculative(p, q, 60000, seed=1, accept_all=True)
    assert chi_square(emitted[:, 0], p[0]) > 10 * CHI2_5DF_999


def test_sample_from_follows_probs_and_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.2, 0.8, 0.0]]).expand(40000, -1)
    u = 1.0 - torch.rand(40000, 4, generator=torch.Generator().manual_seed(3))
    u[0] = 1.0  # the edge case where -log U is 0
    tokens = sample_from(probs, u)
    assert set(tokens.tolist()) <= {1, 2}
    assert abs((tokens == 2).float().mean().item() - 0.8) < 0.01
