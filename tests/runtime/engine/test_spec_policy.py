"""Adaptive speculative depth's policy (engine/spec_policy.py), without a model: a simulated
draft whose acceptance changes over time, and step costs that grow with k."""

import random
import statistics

import numpy as np
import pytest

from mtp_runtime.engine.spec_policy import AdaptivePolicy, FixedPolicy, batch_bucket, bucket_sizes, make_policy


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32]
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError):
        batch_bucket(0)


def test_acceptance_is_conditional_on_the_earlier_drafts_and_ignores_filler():
    policy = AdaptivePolicy(3, prior_weight=1e-9)
    policy.record_verify(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never judged
    policy.record_verify(3, 3)
    policy.record_verify(1, 3)  # one real draft: drafts 2 and 3 were filler, accepted or not
    p = policy.acceptance()
    assert p[0] == pytest.approx(1.0)  # 3 of 3
    assert p[1] == pytest.approx(0.5)  # tried twice, accepted once
    assert p[2] == pytest.approx(1.0)  # tried once (after draft 2 was accepted), accepted
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1 + 1 + 0.5)
    assert policy.expected_tokens(3) == pytest.approx(1 + 1 + 0.5 + 0.5)


def test_a_depth_without_evidence_is_expected_to_do_as_well_as_the_one_before():
    # A policy at k = 1 measures draft 1 every step and drafts 2 and 3 only in probes: their counts
    # decay to nothing between probes. They lean on draft 1's estimate, not on the fixed prior.
    def cost(k, b):  # k = 3 pays when the deeper drafts agree as often as the first (E 3.44 over 1.3)
        return 1.0 + 0.1 * k

    policy = _seeded(AdaptivePolicy(3, probe_interval=10**6), cost)
    for _ in range(4):
        policy.record_verify(3, 3)  # a probe's verifies: every draft accepted
    verifies = 0
    for _ in range(200):  # then many steps at k = 1, draft 1 accepted 9 times in 10
        for _i in range(4):
            verifies += 1
            policy.record_verify(1, int(verifies % 10 != 0))
        policy.end_step()
    p = policy.acceptance()
    assert p[0] == pytest.approx(0.9, abs=0.05)
    assert p[1] == pytest.approx(p[0], abs=0.01) and p[2] == pytest.approx(p[0], abs=0.01)
    assert policy.prior_acceptance == 0.5  # what drafts 2 and 3 fell to before
    policy._current = 1
    assert policy.choose(4) == 3
    # a draft that fails at position 1 makes the unmeasured deeper ones look as poor
    for _ in range(50):
        for _i in range(4):
            policy.record_verify(1, 0)
        policy.end_step()
    assert max(policy.acceptance()) < 0.1
    assert [policy.choose(4) for _ in range(policy.revise_interval)][-1] == 0  # at its next revision


def test_recent_steps_weigh_more():
    policy = AdaptivePolicy(1, decay=0.5, verify_decay=0.0, prior_weight=1e-9)
    for _ in range(10):
        policy.record_verify(1, 1)
        policy.end_step()
    policy.record_verify(1, 0)
    policy.record_verify(1, 0)
    # ten accepted steps, the last of them weighing 0.5 and the first 0.5 ** 10, against two fresh rejections
    assert policy.acceptance()[0] < 0.4


def test_the_counts_span_a_window_of_verifies_at_small_batches_and_of_steps_at_large_ones():
    """A step decays the counts by max(decay, verify_decay ** its verifies): at batch 1 a per-step window
    of ~10 verifies let one sequence's stretch of hard text (its drafts 2 and 3 missing for a few steps)
    drop k = 3 to k = 1 for 20-50 steps, where fixed k = 3 ran 10% faster (bench preset, requests one
    at a time); from batch 4 on the per-step window stands (~40 verifies at 4, ~320 at 32)."""
    def acceptance(batch: int, **settings) -> float:
        policy = AdaptivePolicy(1, prior_weight=1e-9, **settings)
        for verified in [1] * 20 + [0] * 5:
            policy.record_verifies([(1, verified)] * batch)
            policy.end_step()
        return policy.acceptance()[0]
    stepwise = dict(verify_decay=0.0)
    # batch 1: 20 accepted verifies, then 5 rejected, weighed per verify (0.97) rather than per step (0.9)
    assert acceptance(1) > 0.7 and acceptance(1, **stepwise) < 0.6
    assert acceptance(1) == pytest.approx(sum(0.97 ** i for i in range(5, 25)) / sum(0.97 ** i for i in range(25)))
    # batch 4 on: 0.97 ** 4 = 0.89 decays faster than a step's 0.9, which stands
    assert acceptance(4) == pytest.approx(acceptance(4, **stepwise))
    assert acceptance(32) == pytest.approx(acceptance(32, **stepwise)) and acceptance(32) < 0.6


def test_drafts_past_a_step_s_depth_age_by_steps_not_by_verifies():
    """At batch 1 the counts age by verifies (the test above), and the drafts past the depth in use get
    none: a 16-step hard stretch put p_2 at 0.47, the policy fell to k = 1, and p_2 held 0.47 for ~170
    steps after the stretch had ended (engine benchmark's prompts one at a time, where fixed k = 3 ran
    3% faster). A step's drafts past its depth age by the steps' window instead: within ~40 steps at
    k = 1 they lean on draft 1's estimate, and the policy goes back to k = 3."""
    def cost(k, b):
        return 1.0 + 0.4 * k

    def steps_back_at_3(**settings):
        policy = _seeded(AdaptivePolicy(3, probe_interval=10**6, **settings), cost)
        chosen = []
        for step in range(60):  # easy text, then a stretch of 24 steps where draft 2 misses
            k = policy.choose(1)
            chosen.append(k)
            if k:
                policy.record_verifies([(k, min(k, 1) if step >= 36 else k)])
            policy.end_step()
        assert chosen[20:36] == [3] * 16 and chosen[-1] < 3, chosen  # k = 3, and the stretch took it down
        for step in range(400):  # the text is easy again: every draft verified is accepted
            k = policy.choose(1)
            if k == 3:
                return step
            policy.record_verifies([(k, k)] if k else [])
            policy.end_step()
        return None

    back = steps_back_at_3()
    assert back is not None and back <= 60, back
    stalled = steps_back_at_3(decay=0.97)  # (the steps' window as long as the verifies': the old aging)
    assert stalled is None or stalled > 2 * back, (back, stalled)


def test_steps_without_drafts_keep_the_last_verifies_acceptance_and_the_next_probe_outweighs_it():
    """A server at concurrency 32 held k = 0 between probes 200-400 steps apart, and its acceptance, decayed
    every step, fell to the prior's 0.5 where the draft agreed 80-95% of the time: speculation looked poor
    until the next probe, and the probe's evidence was gone soon after it. Steps that verify no draft age
    the counts down to hold_weight (1) verifies of draft 1 and no further: the last probe's acceptance
    stands, and the next probe's verifies outweigh it (kept whole, the bad probes of a draft gone bad
    outweighed the good ones after it recovered for four probes)."""
    policy = AdaptivePolicy(3, prior_weight=0.1)
    bad = [(3, 0)] * 8
    good = [(3, 3), (3, 2), (3, 3), (3, 1), (3, 3), (3, 3), (3, 2), (3, 3)]
    idle = [[(0, 0)] * 8] * 200  # steps at k = 0
    for verifies in [bad] * 30 + idle + [good] * 2:  # a bad draft, k = 0, then a probe's two steps at batch 8
        policy.record_verifies(verifies)
        policy.end_step()
    known, long_known = policy.acceptance(), policy.long_run_acceptance()
    assert known[0] > 0.9
    for _ in range(1000):  # k = 0
        policy.record_verifies([(0, 0)] * 8)
        policy.end_step()
    held = policy.acceptance()
    assert held[0] == pytest.approx(known[0], abs=0.05) and held[1] == pytest.approx(known[1], abs=0.05)
    assert policy.long_run_acceptance()[0] == pytest.approx(long_known[0], abs=0.05)  # (not the prior's 0.5)
    policy.record_verifies(bad)  # the next probe's first step outweighs the held estimate
    assert policy.acceptance()[0] < 0.15
    with pytest.raises(ValueError, match="hold_weight"):
        AdaptivePolicy(1, hold_weight=-1)


def test_a_step_s_verifies_counted_together_weigh_as_the_decayed_counts_of_each_one():
    """The policy keeps its counts scaled (one division per step instead of decaying every count) and
    takes a step's verifies at once; its estimates equal counts decayed one by one, here written out."""
    rng = random.Random(5)
    decay, long_decay, w = 0.8, 0.99, 0.1
    policy = AdaptivePolicy(3, decay=decay, long_decay=long_decay, prior_weight=w)
    tries, hits, long_tries, long_hits = ([0.0] * 3 for _ in range(4))
    for step in range(3000):  # long enough for the scales to be folded into the counts several times
        verifies = [(rng.randint(0, 3), rng.randint(0, 3)) for _ in range(rng.randint(0, 5))]
        policy.record_verifies(verifies)
        for real, accepted in verifies:
            accepted = min(accepted, real)
            for j in range(min(accepted + 1, real)):
                for counts in (tries, long_tries):
                    counts[j] += 1
                if j < accepted:
                    for counts in (hits, long_hits):
                        counts[j] += 1
        if step % 997 == 0 or step == 2999:
            for got, (h, t) in ((policy.acceptance(), (hits, tries)),
                                (policy.long_run_acceptance(), (long_hits, long_tries))):
                prior, want = 0.5, []
                for hj, tj in zip(h, t):
                    prior = (hj + w * prior) / (tj + w)
                    want.append(prior)
                assert got == pytest.approx(want, rel=1e-9)
        policy.end_step()
        # a step that verified no real draft ages the counts only down to hold_weight verifies of draft 1
        # ... and one that did by decay, or by verify_decay per real verify where that ages them less
        evidence = sum(1 for real, _ in verifies if real)
        factor = max(decay, policy.verify_decay ** evidence) if evidence else decay
        if evidence or tries[0] * decay >= policy.hold_weight:
            tries[:] = [c * factor for c in tries]
            hits[:] = [c * factor for c in hits]
        if evidence or long_tries[0] * long_decay >= policy.hold_weight:
            long_tries[:] = [c * long_decay for c in long_tries]
            long_hits[:] = [c * long_decay for c in long_hits]
    assert policy._scale < 1e100  # folded: 0.8 ** -3000 is past what a float holds


def _seeded(policy: AdaptivePolicy, cost) -> AdaptivePolicy:
    for k in range(policy.max_k + 1):
        for b in (1, 4, 16):
            policy.record_step(k, b, cost(k, b))
    return policy


def test_chooses_the_depth_with_most_tokens_per_second():
    def cost(k, b):  # cheap verify at batch 1, expensive at batch 16
        return 1.0 + (0.05 if b == 1 else 0.6) * k

    policy = _seeded(AdaptivePolicy(3, prior_weight=1e-9, probe_interval=10**6), cost)
    for _ in range(50):
        policy.record_verify(3, 3)
        policy.record_verify(3, 1)  # p = [1, 0.5, 1]
    # batch 1: E = 1, 2, 2.5, 3 over 1, 1.05, 1.1, 1.15 -> k = 3; batch 16: over 1, 1.6, 2.2, 2.8 -> k = 1
    assert policy.choose(1) == 3
    assert policy.scores(16).index(max(policy.scores(16))) == 1
    assert [policy.choose(16) for _ in range(5)] == [1] * 5


def test_a_deeper_k_never_counts_as_cheaper_than_a_shallower_one():
    policy = AdaptivePolicy(3, prior_weight=1e-9, probe_interval=10**6)
    for k, seconds in enumerate((1.0, 1.1, 0.7, 1.2)):  # a noisy k = 2 timing
        policy.record_step(k, 1, seconds)
    for _ in range(20):
        policy.record_verify(3, 0)  # a draft that never agrees
    assert policy.scores(1)[2] <= policy.scores(1)[0]
    assert [policy.choose(1) for _ in range(5)] == [0] * 5


def test_a_near_tie_does_not_flip_the_choice():
    policy = _seeded(AdaptivePolicy(1, prior_weight=1e-9, probe_interval=10**6), lambda k, b: 1.0 + k)
    for _ in range(20):
        policy.record_verify(1, 1)  # p = 1: k = 1 gives 2 tokens for 2 s, k = 0 one for 1 s
    first = policy.choose(1)
    policy.record_step(1 - first, 1, 0.99 * policy.cost(1 - first, 1))  # the other depth now 1% better
    assert policy.choose(1) == first


class SimulatedDraft:
    """Each sequence's draft j is accepted with probability rate(step) once drafts 1..j-1 were;
    a step at a higher k than the one before verifies filler (no chance) past the earlier k."""

    def __init__(self, rate, seed=0):
        self.rate, self.rng, self.previous_k = rate, random.Random(seed), 0

    def step(self, policy, step, k, batch, cost):
        real = min(k, self.previous_k)
        for _ in range(batch):
            accepted = 0
            while accepted < real and self.rng.random() < self.rate(step):
                accepted += 1
            if real:
                policy.record_verify(real, accepted)
        policy.record_step(k, batch, cost(k, batch))
        policy.end_step()
        self.previous_k = k


def run_policy(policy, rate, steps, batch=4, cost=lambda k, b: 1.0 + 0.15 * k):
    draft = SimulatedDraft(rate)
    chosen = []
    for step in range(steps):
        k = policy.choose(batch)
        draft.step(policy, step, k, batch, cost)
        chosen.append(k)
    return chosen


def test_falls_back_to_no_speculation_when_the_draft_goes_bad_and_comes_back():
    def rate(step):  # good, then a draft that never matches, then good again
        return 0.0 if 300 <= step < 700 else 0.85

    chosen = run_policy(_seeded(AdaptivePolicy(3), lambda k, b: 1.0 + 0.15 * k), rate, 1100)
    good, bad, back = chosen[200:300], chosen[340:700], chosen[900:1100]
    assert sum(k == 3 for k in good) >= 90  # E[3] = 3.2 tokens for 1.45 s: the deepest k wins
    assert chosen[300:350].count(0) >= 25, "did not fall back within 25 steps"
    assert bad.count(0) >= 0.9 * len(bad)  # probes aside, no speculation while the draft is bad
    assert max(bad) > 0  # ... but it kept probing
    # the next probe of a k > 0 comes within 160 steps (probe_interval 128 + 25%)
    assert sum(k > 0 for k in chosen[700:900]) >= 60, "speculation did not come back within 160 steps"
    assert back.count(3) >= 0.85 * len(back)


def test_probes_keep_every_depth_measured_and_runs_repeat_from_the_seed():
    chosen = run_policy(AdaptivePolicy(3, seed=5, probe_interval=16), lambda step: 0.9, 600)
    assert set(chosen[100:]) == {0, 1, 2, 3}
    assert chosen == run_policy(AdaptivePolicy(3, seed=5, probe_interval=16), lambda step: 0.9, 600)
    assert chosen != run_policy(AdaptivePolicy(3, seed=6, probe_interval=16), lambda step: 0.9, 600)
    # at the deepest k only the cost refreshes remain: a probe of three steps every second probe time
    assert sum(k != 3 for k in chosen[100:]) <= 3 * (500 / 16 / 2) + 4


def test_unmeasured_depths_are_tried_first():
    policy = AdaptivePolicy(2, probe_steps=2, cold_steps=1)
    assert [policy.choose(1) for _ in range(2)] == [0, 0]  # nothing measured yet: k = 0 until it is
    policy.record_step(0, 1, 1.0)
    assert [policy.choose(1) for _ in range(2)] == [1, 1]  # a higher k than the current one: two steps
    policy.record_step(1, 1, 1.0)
    assert policy.choose(1) == 2


def test_probes_take_four_steps_and_alternate_higher_and_lower_k():
    def cost(k, b):
        return 1.0 + 0.1 * k

    policy = _seeded(AdaptivePolicy(2, probe_steps=4, prior_weight=1e-9, probe_interval=8, seed=1), cost)
    for _ in range(20):
        policy.record_verify(2, 1)  # p = [1, 0]: k = 1 is best (2 tokens for 1.1 s)
    chosen = [policy.choose(1) for _ in range(60)]
    runs, i = [], 0
    while i < len(chosen):
        j = i
        while j < len(chosen) and chosen[j] == chosen[i]:
            j += 1
        runs.append((chosen[i], j - i))
        i = j
    assert runs[0][0] == 1 and {k for k, _ in runs} == {0, 1, 2}
    runs = runs[:-1]  # the last may be cut short by the end of the window
    assert all(n == 4 for k, n in runs if k != 1)  # the first two steps of a probe run cold (not timed)
    assert abs(sum(k == 2 for k, _ in runs) - sum(k == 0 for k, _ in runs)) <= 1  # higher and lower in turn
    assert policy.cost(0, 32) == 1.0  # the nearest measured bucket stands in for an unmeasured one
    # in use between two higher depths and one lower, each is probed in its turn (the higher ones took the odd
    # turns, and at k = 1 of K = 3 those all went to k = 3: k = 2 was never probed)
    policy = _seeded(AdaptivePolicy(3, probe_steps=4, prior_weight=1e-9, probe_interval=8, seed=1, probe_budget=1e9), cost)
    for _ in range(20):
        policy.record_verify(3, 1)  # p = [1, 0, ...]: k = 1 is best
    chosen = [policy.choose(1) for _ in range(200)]
    assert chosen[0] == 1 and {1, 0, 2, 3} == set(chosen)


def test_each_bucket_takes_its_own_turns_of_higher_and_lower_probes():
    """A server whose batch fell to 1 and rose to 32 at every turn of the benchmark's clients (k = 3 at 1, k = 2
    at 8, k = 1 at 16 and 32) had its probe times alternate between the small batches and 32: the higher
    probes fell at the small batches and the lower ones at 32, where k = 3 was never probed and its cost stood
    at 3.1 times k = 1's (probes later measured 1.26), and the policy held k = 1 where fixed k = 3 was 7-9%
    faster. Each bucket alternates higher and lower probes on its own."""
    def cost(k, b):
        return 1.0 + 0.1 * k

    policy = _seeded(AdaptivePolicy(3, probe_steps=4, prior_weight=1e-9, probe_interval=10**6, probe_budget=1e9, seed=1), cost)
    for _ in range(20):
        policy.record_verify(3, 1)  # p = [1, 0, ...]: k = 1 is best
    policy._until_probe = 10**6
    assert [policy.choose(32) for _ in range(4)] == [1] * 4
    probed = {1: [], 32: []}
    for turn in range(8):  # probe times at 32 and 1 by turns
        b = 32 if turn % 2 == 0 else 1
        policy._until_probe = 0
        probed[b].append(policy.choose(b))
        assert [policy.choose(b) for _ in range(3)] == [probed[b][-1]] * 3  # the probe's other steps
    assert probed[32] == probed[1] == [2, 0, 3, 0]  # (one turn for all: 2, 3, 2, 3 at 32, all zeros at 1)


def test_the_first_two_steps_after_one_at_another_depth_are_not_timed():
    """A depth's first steps after a step at another depth run cold (its code and data are not in the
    caches): the engine measured a k = 0 step after a k = 3 step at 1.4x one after a k = 0 step. Timed,
    the cold steps of probes made k = 0 look dearer than it runs, and the policy kept speculating."""
    unit = {0: 1.0, 1: 1.7}  # p = 0.8: E = 1.8 tokens for 1.7 -> k = 1 (1.06 a unit) beats k = 0 (1.0)...
    cold = 1.4  # ... unless k = 0's cold probe steps count: 1.8 / 1.7 against 1 / (1.4 * 1.0) would hold
    policy = _seeded(AdaptivePolicy(1, prior_weight=1e-9, probe_interval=8, seed=3), lambda k, b: unit[k])
    for _ in range(20):
        for accepted in (1, 1, 1, 1, 0):
            policy.record_verify(1, accepted)
    chosen = []
    for _ in range(300):
        k = policy.choose(4)
        # the first step at a new depth runs 1.4x, the second still 1.15x (measured: 1.56 and 1.54 ms,
        # then 1.36 ms, for k = 0 after k = 3 at batch 4)
        before = chosen[-2:]
        slow = cold if before and before[-1] != k else 1.15 if len(before) == 2 and before[0] != k else 1.0
        policy.record_step(k, 4, unit[k] * slow)
        chosen.append(k)
    assert 0 in chosen[100:]  # k = 0 was probed ...
    assert policy.cost(0, 4) == pytest.approx(1.0, rel=0.02)  # ... and its warm steps alone timed
    assert policy.cost(1, 4) == pytest.approx(1.7, rel=0.02)


def test_a_probe_runs_six_steps_and_the_four_after_its_cold_two_set_its_depth_s_cost():
    """Two timed steps were too few: the cheapest of a probe's third and fourth steps still ran warm-up
    slow, and closed batches of 4 had k = 1 at up to 1.2 times its cost, the policy holding k = 2 and 3
    where k = 1 was best. A probe runs six steps, its first two cold (not timed), and the other four
    count: in an open batch their mean (set against the depth in use's smoothed mean; a closed batch's
    cheapest, against the cheapest, is the next test's)."""
    policy = _seeded(AdaptivePolicy(1, probe_interval=1, probe_budget=1e9, probe_cost_smoothing=1.0),
                     lambda k, b: 1.0 + k)
    assert policy.probe_steps == 6
    policy.record_verifies([(1, 0)] * 4)  # (not a fresh policy, which would probe at once)
    policy._until_probe = 10**6
    for _ in range(4):  # the depth in use's steps at this batch size, what the probe is set against
        assert policy.choose(4) == 0
        policy.record_step(0, 4, 1.0)
    policy._until_probe = 0
    for seconds in (3.0, 2.8, 2.4, 2.3, 2.1, 2.2):
        assert policy.choose(4) == 1
        policy.record_step(1, 4, seconds)
    assert policy.cost(1, 4) / policy.cost(0, 4) == pytest.approx(2.25)  # (2.4 + 2.3 + 2.1 + 2.2) / 4
    policy._until_probe = 10**6
    assert policy.choose(4) == 0  # the probe is over


def test_a_probe_is_set_fairly_against_the_depth_in_use_s_steps_in_closed_and_open_batches():
    """A step's time is its cost plus whatever else held the core then: noise that only slows. The
    probe's cheapest timed step counts, and set against a smoothed mean of the depth in use's steps it
    made every probed depth look cheaper than it ran (closed batches of 4, k = 3 in use, on a machine
    whose same work took 0.93-1.41 times its median: a probe put k = 2 at 0.757 of k = 3's step where
    the two ran 0.785 of each other, and the policy ran a quarter of the batches at k = 2, each 10%
    slower than at k = 3). In a closed batch it is set against the cheapest of the depth in use's last
    steps, as many as a probe times. An open batch's last steps of a size can lie hundreds of steps apart
    in a server (with the cheapest of them, a server at concurrency 32 fell to k = 0, mean k 0.2, where
    fixed k = 3 ran 1.3-1.4 times faster), and the cheapest against the smoothed mean put k = 1 at 0.55 of
    k = 2's step where they ran 0.68 (served at concurrency 4, the policy fell to k = 1 and ran 0.81 of
    the best fixed k): there the probe's mean is set against the smoothed mean."""

    def probed_ratio(draining):
        rng = random.Random(3)
        policy = _seeded(AdaptivePolicy(1, prior_weight=1e-9, probe_interval=16, probe_backoff=1,
                                        probe_budget=1e9, probe_cost_smoothing=1.0, seed=2), lambda k, b: 1.0 + k)
        ratios = []
        for _ in range(3000):
            k = policy.choose(4, draining)
            probing = policy._probe_left > 0
            policy.record_step(k, 4, (1.0 + k) * (1.0 + rng.expovariate(10.0)))  # k = 1 twice k = 0, noise 10%
            if k:
                policy.record_verifies([(1, 0)] * 4)  # k = 0 stays in use
            policy.end_step()
            if k and not probing:  # a probe's last step: its estimate is in
                ratios.append(policy.cost(1, 4) / policy.cost(0, 4))
        assert policy._current == 0 and len(ratios) > 100
        return statistics.median(ratios)

    assert probed_ratio([(40, [0], [0])] * 4) == pytest.approx(2.0, abs=0.05)  # (against the mean: 1.87)
    assert probed_ratio(None) == pytest.approx(2.0, abs=0.05)  # an open batch (its cheapest: 1.87)


def test_a_probe_is_compared_with_the_depth_in_use_s_recent_steps_of_its_batch_size():
    """Batch sizes 3 and 4 share a bucket; at an open batch of 4 a step with one row prefilling decodes 3
    (its one-call part is timed apart). A probe timed at 3 rows, set against the depth in use's 4-row
    steps, looked a quarter cheaper; counted only at the depth in use's last batch size, a server at
    concurrency 32 (26-32 rows decoding, another size nearly every step) seldom counted one. A probe
    is set against the depth in use's recent steps of its own batch size, and counts wherever the
    depth in use ran lately, once it has timed reference_steps (4) steps of it: its first steps after
    another depth's run cold (k = 0 after k = 3: 1.26, 1.15, 1.09x from the third on), and an engine at
    batch 16, just back at k = 0, timed k = 1 against them at 1.7 times k = 0 where it ran 2.0 times."""
    policy = _seeded(AdaptivePolicy(1, probe_steps=4, probe_interval=1, probe_budget=1e9, probe_cost_smoothing=1.0),
                     lambda k, b: 1.0 + k)  # k = 0 in use, 4 rows; a probe sets its depth's cost
    policy.record_verifies([(1, 0)] * 4)  # (not a fresh policy, which would probe at once)
    policy._until_probe = 10**6
    for _ in range(3):
        assert policy.choose(4) == 0
    for _ in range(3):
        policy.record_step(0, 3, 0.75)  # the depth in use, at 3 rows: three quarters of its 4-row step
    policy._until_probe = 0
    assert [policy.choose(4) for _ in range(4)] == [1] * 4
    before = policy.cost(1, 4) / policy.cost(0, 4)
    policy.record_step(1, 3, 1.2)  # three steps of k = 0 at 3 rows: not yet a reference
    assert policy.cost(1, 4) / policy.cost(0, 4) == before
    policy._until_probe = 10**6
    for _ in range(3):
        assert policy.choose(4) == 0
    policy.record_step(0, 3, 0.75)  # the fourth
    policy._until_probe = 0
    assert [policy.choose(4) for _ in range(4)] == [1] * 4  # a probe; its last step is timed ...
    policy.record_step(1, 3, 1.5)  # ... at 3 rows, twice the depth in use's there: as estimated
    assert policy.cost(1, 4) / policy.cost(0, 4) == pytest.approx(2.0)
    policy._until_probe = 0
    assert [policy.choose(4) for _ in range(4)] == [1] * 4
    policy.record_step(1, 3, 1.2)  # 1.6 times: k = 1 is cheaper than estimated, at every size of the bucket
    assert policy.cost(1, 4) / policy.cost(0, 4) == pytest.approx(1.6)
    policy._until_probe = 0
    assert [policy.choose(4) for _ in range(4)] == [1] * 4
    before = policy.cost(1, 4)
    policy.record_step(1, 12, 0.5)  # 12 rows: the depth in use has not run them lately, not counted
    assert policy.cost(1, 16) == pytest.approx(2.0) and policy.cost(1, 4) == before
    policy._until_probe, policy._revise_wait = 10**6, 0
    policy.record_verifies([(1, 1)] * 400)  # the draft agrees: k = 1 from the next choice
    assert policy._reference
    assert policy.choose(4) == 1 and policy._current == 1
    assert policy._reference == {}  # the last depth's steps are no reference for probes of the new one's


def test_a_probe_s_step_counts_once_the_two_steps_before_ran_its_depth():
    # p = 0.5: k = 1 gives 1.5 tokens for 2.0 and k = 0 one for 1.0; a probe every 2 steps
    policy = _seeded(AdaptivePolicy(1, probe_steps=4, probe_interval=2, probe_budget=1e9, reference_steps=1),
                     lambda k, b: 1.0 + k)
    policy.record_verifies([(1, 1), (1, 0)])
    assert policy.choose(1) == 0
    policy.record_step(0, 1, 1.0)
    for _ in range(2):  # the probe's first two steps: after a k = 0 step, not timed
        assert policy.choose(1) == 1
        policy.record_step(1, 1, 50.0)
    assert policy.cost(1, 1) == 2.0
    assert policy.choose(1) == 1  # third step: timed, and counted with the fourth's at the probe's end
    policy.record_step(1, 1, 2.8)
    assert policy.cost(1, 1) == 2.0
    assert policy.choose(1) == 1  # fourth and last: the mean of the two timed steps counts (an open batch; as
    policy.record_step(1, 1, 2.5)  # one sample, probe_cost_smoothing of the way)
    assert policy.cost(1, 1) == pytest.approx(2.0 + 0.6 * (2.65 - 2.0))
    # a probe whose last step was not timed counts at the next choice
    policy._until_probe = 0
    assert [policy.choose(1) for _ in range(3)] == [1] * 3
    policy.record_step(1, 1, 2.0)  # its third step; the fourth is not timed
    assert policy.choose(1) == 1 and policy.cost(1, 1) == pytest.approx(2.39)
    policy.choose(1)
    assert policy.cost(1, 1) == pytest.approx(2.39 + 0.6 * (2.0 - 2.39))
    with pytest.raises(ValueError, match="probe_steps=2 must be >= cold_steps"):
        AdaptivePolicy(1, probe_steps=2)
    with pytest.raises(ValueError, match="probe_steps=1 must be >= cold_steps"):
        AdaptivePolicy(1, probe_steps=1, cold_steps=1)


def test_a_probe_whose_timed_steps_fall_in_two_buckets_counts_in_each():
    policy = _seeded(AdaptivePolicy(1, probe_steps=4, probe_interval=10**6, probe_budget=1e9, reference_steps=1,
                                    probe_cost_smoothing=1.0), lambda k, b: 1.0 + k)
    policy.record_verifies([(1, 0)] * 4)  # k = 0 in use
    policy._until_probe = 0
    assert [policy.choose(4) for _ in range(3)] == [1] * 3
    policy.record_step(1, 4, 1.5)  # its third step, at 4 rows
    assert policy.choose(16) == 1
    policy.record_step(1, 16, 2.5)  # its fourth, at 16
    assert policy.cost(1, 4) == pytest.approx(1.5) and policy.cost(1, 16) == pytest.approx(2.5)


def test_a_fresh_policy_tries_the_deepest_k_before_settling_on_the_prior_s_choice():
    """With no verify seen, the prior (p = 0.5) values speculation at little and k = 0 would learn nothing
    until the first probe, up to 160 steps in; a fresh policy probes the deepest k at once, and stays
    there when its drafts agree."""
    policy = _seeded(AdaptivePolicy(3, probe_steps=4, seed=2), lambda k, b: 1.0 + 0.4 * k)
    assert policy.scores(1)[0] > policy.scores(1)[3]  # on the prior alone, k = 0 looks best
    chosen = []
    for _ in range(20):
        k = policy.choose(1)
        chosen.append(k)
        if k:
            policy.record_verify(k, k)  # every draft agrees (the first step of the probe's too)
        policy.record_step(k, 1, 1.0 + 0.4 * k)
        policy.end_step()
    assert chosen[:2] == [3, 3] and chosen[2:] == [3] * 18
    # the probe's own steps, the engine's first and coldest, are not timed: the step after them is
    fresh = _seeded(AdaptivePolicy(3, probe_steps=4, seed=2), lambda k, b: 1.0 + 0.4 * k)
    for step in range(5):
        k = fresh.choose(1)
        fresh.record_verify(k, k)
        fresh.record_step(k, 1, 5.0)  # far off the start-up's 2.2 (an outlier moves it as 1.5 times off)
        fresh.end_step()
        assert k == 3 and (fresh.cost(3, 1) == pytest.approx(2.2)) == (step < 4)
    # where a prompt's first drafts wait for its first decode step (which verifies filler), one step more
    deferred = _seeded(AdaptivePolicy(3, probe_steps=4, seed=2), lambda k, b: 1.0 + 0.4 * k)
    deferred.first_drafts_deferred = True
    for step in range(6):
        k = deferred.choose(1)
        deferred.record_verify(k, k)
        deferred.record_step(k, 1, 5.0)
        deferred.end_step()
        assert k == 3 and (deferred.cost(3, 1) == pytest.approx(2.2)) == (step < 5)
    # once drafts have been verified, a policy at k = 0 waits for its probes, however long ago that was
    settled = _seeded(AdaptivePolicy(1, probe_steps=4, probe_interval=10**6), lambda k, b: 1.0 + k)
    settled.record_verifies([(1, 0)] * 4)
    held = []
    for _ in range(3000):  # the long-run counts (decay 0.995) fall below one verify after ~280 steps
        held.append(settled.choose(1))
        settled.record_step(held[-1], 1, 1.0 + held[-1])
        settled.end_step()
    assert held == [0] * 3000


def test_an_open_batch_s_choice_is_revised_every_few_steps_and_at_once_in_another_bucket():
    """The scores cost 7.5 us a step at batch 1 (a graph-mode step there: 0.76 ms), so an open batch's
    choice is revised every revise_interval steps; a batch in another bucket, or the end of a probe,
    revises it at once."""
    def cost(k, b):
        return 1.0 + (0.1 if b == 1 else 1.0) * k

    policy = _seeded(AdaptivePolicy(1, prior_weight=1e-9, probe_interval=10**6, revise_interval=4), cost)
    policy.record_verifies([(1, 1)] * 20)  # p = 1: k = 1 wins at batch 1 (2 / 1.1), loses at 16 (2 / 2.0)
    assert policy.choose(1) == 1
    policy.record_verifies([(1, 0)] * 2000)  # the draft turns bad: k = 0 wins everywhere ...
    assert [policy.choose(1) for _ in range(4)] == [1, 1, 1, 0]  # ... from the next revision
    policy.record_verifies([(1, 1)] * 20000)
    assert policy.choose(1) == 0 and policy.choose(16) == 0  # another bucket: revised at once (k = 0 there)
    assert [policy.choose(16) for _ in range(3)] == [0, 0, 0]
    assert policy.choose(1) == 1  # back in bucket 1: revised at once
    with pytest.raises(ValueError, match="revise_interval"):
        AdaptivePolicy(1, revise_interval=0)


def test_fixed_policy_and_settings():
    fixed = make_policy(2, adaptive=False)
    assert isinstance(fixed, FixedPolicy) and [fixed.choose(b) for b in (1, 32)] == [2, 2]
    assert fixed.describe() == {"speculative_policy": "fixed", "num_speculative_tokens": 2}
    adaptive = make_policy(3, adaptive=True)
    assert adaptive.describe() == {"speculative_policy": "adaptive", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AdaptivePolicy(0)
    with pytest.raises(ValueError, match="decay"):
        AdaptivePolicy(2, decay=0)


def test_a_machine_that_slows_down_does_not_make_the_depth_in_use_look_dear():
    unit = {0: 1.0, 1: 1.05, 2: 1.5}  # p = 0.6: E = 1, 1.6, 1.96 tokens -> k = 1 gives the most per second
    policy = _seeded(AdaptivePolicy(2, prior_weight=1e-9, probe_interval=10**6), lambda k, b: unit[k])
    for _ in range(30):
        policy.record_verify(2, 1)
        policy.record_verify(2, 2)
        policy.record_verify(2, 0)
        policy.record_verify(2, 1)
        policy.record_verify(2, 2)
    chosen = []
    for step in range(200):  # from step 20 on, everything takes 2.5x as long; only k = 1 keeps running
        k = policy.choose(4)
        policy.record_step(k, 4, unit[k] * (2.5 if step >= 20 else 1.0))
        chosen.append(k)
    assert chosen[10:] == [1] * 190
    assert policy.cost(0, 4) == pytest.approx(2.5, rel=0.15)  # the load moved every k's estimate


def test_probes_correct_a_start_up_estimate_of_a_depth_not_in_use():
    """The start-up's dummy steps said a k = 1 step costs 2.0, where real ones cost 1.6 (k = 0: 1.0 both).
    With p = 0.8 (E = 1.8 tokens) k = 1 looks worse (0.9 tokens a unit of time against 1.0) and is
    better (1.125). The policy starts at k = 0, whose steps set the load; a probe of k = 1 moves k = 1's
    own cost, not the load, so three probes (16 steps apart, the second step of each timed) move it to
    k = 1. (When probes moved the load, which the next k = 0 steps moved back, it took about 100
    steps.)"""
    seeded = {0: 1.0, 1: 2.0}
    real = {0: 1.0, 1: 1.6}
    policy = AdaptivePolicy(1, probe_steps=4, prior_weight=1e-9, probe_interval=16, probe_budget=1e9)
    for _ in range(5):  # as the engine's warm-up: five dummy steps at each depth
        _seeded(policy, lambda k, b: seeded[k])
    for _ in range(10):
        for accepted in (1, 1, 1, 1, 0):
            policy.record_verify(1, accepted)
    chosen = []
    for _ in range(400):
        k = policy.choose(4)
        policy.record_step(k, 4, real[k])
        chosen.append(k)
    assert chosen[:10] == [0] * 10
    settled = next(i for i in range(len(chosen)) if chosen[i:i + 50].count(1) >= 45)
    assert settled <= 60, chosen[:settled + 5]
    assert chosen[-200:].count(1) >= 200 - 3 * (200 // 32 + 1)  # k = 0's probes: 3 steps every 32
    assert policy.cost(1, 4) / policy.cost(0, 4) == pytest.approx(1.6, rel=0.03)


def test_a_depth_known_only_from_the_start_up_is_probed_at_once_and_its_first_timed_step_replaces_that():
    """The start-up's dummy steps (48 cached tokens) put k = 1 and k = 2 at 1.59 and 2.19 times k = 1's cost at
    concurrency 32, where served steps ran 1.36 and 1.75 times; probes came every few hundred steps, each
    moving an estimate by 30%, and the policy held k = 1 where k = 2 and 3 ran 3-5% faster. A depth whose
    cost in a bucket is the start-up's alone is probed as soon as the depth in use has run the batch size
    (a probe is set against those steps), and its first timed step replaces the start-up's estimate."""
    seeded = {0: 1.0, 1: 2.0, 2: 3.0}
    real = {0: 1.0, 1: 1.5, 2: 2.0}
    policy = AdaptivePolicy(2, probe_steps=4, prior_weight=1e-9, probe_interval=10**6)
    for k in range(3):
        policy.seed_step_cost(k, 32, [seeded[k]] * 3)
    policy.record_verifies([(2, 1)] * 40 + [(2, 2)] * 40)  # p = [1, 0.5]: E = 1, 2, 2.5 tokens
    assert policy.scores(32).index(max(policy.scores(32))) == 0  # on the start-up's costs, k = 0
    chosen = []
    for _ in range(40):
        k = policy.choose(30)
        policy.record_step(k, 30, real[k])
        chosen.append(k)
    # k = 0 runs until its next revision (every 4 steps), having timed 30 rows, then k = 1 and k = 2 are
    # probed once each, and the policy moves to k = 1 (2 tokens for 1.5)
    assert chosen[:4] == [0] * 4 and chosen[4:8] == [1] * 4 and chosen[8:12] == [2] * 4, chosen
    assert policy.cost(1, 30) / policy.cost(0, 30) == pytest.approx(1.5)
    assert policy.cost(2, 30) / policy.cost(0, 30) == pytest.approx(2.0)
    assert set(chosen[12:]) == {1}
    # a probe whose step is not timed (the batch size moved) is tried again, up to early_probes times in all
    again = AdaptivePolicy(1, probe_steps=4, prior_weight=1e-9, probe_interval=10**6)
    for k in range(2):
        again.seed_step_cost(k, 32, [seeded[k]] * 3)
    again.record_verifies([(1, 1)] * 3 + [(1, 0)])  # E[1] = 1.75: 0.875 of k = 0's score, within reach
    chosen = []
    for i in range(40):
        k = again.choose(30)
        again.record_step(k, 30 if k == 0 else 31, real[k])  # a probe's rows never match k = 0's
        chosen.append(k)
    assert chosen.count(1) == 4 * again.early_probes and again.cost(1, 30) == pytest.approx(2.0)
    # In a closed batch, a depth the start-up puts more than early_reach below the depth in use waits for
    # the paced probes (closed batches of 32, k = 2 and 3 at 0.78 and 0.67 of k = 0: their early probes cost
    # the first batches 8-15%). An open batch (a server) probes it all the same: served at concurrency 32,
    # the start-up put k = 2 at 2.5 times k = 1's step where it ran about 1.5 times, its score at 0.55 of
    # k = 1's, and with the paced probes 1000+ steps apart the policy held k = 1 for the whole level,
    # where k = 3 ran 6% faster. There a probe's step counts up to outlier_ratio squared off the start-up's
    # estimate: k = 1 put at twice its cost is set right by the one probe.
    def far_policy():
        far = AdaptivePolicy(1, probe_steps=4, prior_weight=1e-9, probe_interval=10**6)
        far.seed_step_cost(0, 32, [1.0] * 3)
        far.seed_step_cost(1, 32, [3.0] * 3)  # (real: 1.5)
        far.record_verifies([(1, 1)] * 3 + [(1, 0)] * 2)  # E[1] = 1.6: 0.53 of k = 0's score ...
        far.record_verifies([(1, 0)])  # ... and now 1.5, 0.5
        return far

    closed = far_policy()
    chosen = []
    for i in range(40):
        k = closed.choose(30, [(60, [0], [0])] * 30)
        closed.record_step(k, 30, real[k])
        chosen.append(k)
    assert chosen == [0] * 40 and not closed._costs[(1, 32)].live
    served = far_policy()
    chosen = []
    for i in range(40):
        k = served.choose(30)
        served.record_step(k, 30, real[k])
        chosen.append(k)
    assert chosen[:8] == [0] * 4 + [1] * 4 and set(chosen[8:]) == {0}, chosen  # (k = 1 now ties: 1.5 for 1.5)
    assert served.cost(1, 30) / served.cost(0, 30) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="early_reach=1.5"):
        AdaptivePolicy(1, early_reach=1.5)
    with pytest.raises(ValueError, match="early_probes=-1"):
        AdaptivePolicy(1, probe_steps=4, early_probes=-1)
    with pytest.raises(ValueError, match="reference_steps=0"):
        AdaptivePolicy(1, probe_steps=4, reference_steps=0)


def test_a_sequence_s_own_verifies_move_its_expected_tokens_from_the_policy_s():
    policy = AdaptivePolicy(2, prior_weight=1e-9, sequence_prior_weight=4.0)
    for _ in range(20):
        policy.record_verify(2, 2)
        policy.record_verify(2, 1)  # p = [1, 0.5]
    assert policy.sequence_expected_tokens([], []) == pytest.approx([1.0, 2.0, 2.5])  # no evidence: the policy's
    # tried draft 1 twelve times, never accepted: (0 + 4 * 1) / (12 + 4) = 0.25 at position 1
    assert policy.sequence_expected_tokens([12, 0], [0, 0]) == pytest.approx([1.0, 1.25, 1.25 + 0.25 * 0.5])
    with pytest.raises(ValueError, match="sequence_prior_weight"):
        AdaptivePolicy(2, sequence_prior_weight=0)


def _closed_batch_policy(**options) -> AdaptivePolicy:
    """k = 1 pays per step at batch 32 (2 tokens for 1.6x the cost: 1.25x), and a few sequences cost
    nearly as much as a full batch."""
    def cost(k, b):
        return {1: 0.7, 2: 0.72, 4: 0.75, 8: 0.8, 16: 0.9, 32: 1.0}[b] * (1.0 + 0.6 * k)

    policy = AdaptivePolicy(1, prior_weight=1e-9, **{"probe_interval": 10**6, **options})
    for k in (0, 1):
        for b in (1, 2, 4, 8, 16, 32):
            policy.record_step(k, b, cost(k, b))
    for _ in range(50):
        policy.record_verify(1, 1)  # p = 1 on average over the batch
    return policy


def test_a_closed_batch_counts_the_steps_that_verify_filler_at_one_token():
    """A sequence whose drafts are filler (after a step at k = 0, or a greedy prompt whose first
    drafts wait for its first one-call step) gains one token in its next step whatever k: the drain
    counts that step apart (bench preset, batch 4: without it the model put k = 3's four finishes at
    16.9-19.7 steps where fixed k = 3's ran 17.1-22.9, one of them the filler's)."""
    policy = _closed_batch_policy(drain_interval=1, drain_lead_hold=0)
    ready = ([20], [20])  # draft 1 always accepted: E[1] = 2
    # 3 tokens left each: k = 0 takes 3 steps; k = 1 with real drafts 1.5 steps at 1.6x the cost (2.4),
    # with filler first 1 + 2 / 2 = 2 steps (3.2)
    at_k0, at_k1 = policy.drain_scores([(3, *ready, 0, 0)] * 32)
    assert at_k1 > at_k0
    after_k0 = [(3, *ready, 0, 1)] * 32
    filler_k0, filler_k1 = policy.drain_scores(after_k0)
    assert filler_k0 == pytest.approx(at_k0) and filler_k1 < filler_k0
    assert filler_k1 == pytest.approx(at_k1 * 1.5 / 2, rel=0.02)
    assert policy.drain_scores([(3, *ready)] * 32) == pytest.approx([at_k0, at_k1])  # (no 5th field: none)
    assert policy.choose(32, after_k0) == 0
    # a sequence with one token left and filler: one step at any k
    assert policy.drain_scores([(1, *ready, 0, 1)] * 32)[1] == pytest.approx(32 / policy.step_costs(32)[1])


def test_a_closed_batch_with_slow_sequences_is_finished_sooner_without_drafts():
    policy = _closed_batch_policy(drain_interval=1, drain_lead_hold=0)
    assert policy.choose(32) == 1  # per step, k = 1 gives the most tokens per second
    fast, slow = ([20], [20]), ([20], [0])  # draft 1 tried 20 times: always / never accepted
    draining = [(60, *fast)] * 28 + [(60, *slow)] * 4
    # k = 1: the fast ones finish in ~31 steps of a full batch, the slow ones need ~50, the last ~19 at
    # 4 sequences; k = 0: 60 steps of a full batch, each 1/1.6 of the cost
    at_k0, at_k1 = policy.drain_scores(draining)
    assert at_k0 > at_k1
    assert policy.choose(32, draining) == 0
    # every sequence alike: a closed batch gains what a step gains
    alike = [(60, *fast)] * 32
    at_k0, at_k1 = policy.drain_scores(alike)
    assert at_k1 / at_k0 == pytest.approx(policy.scores(32)[1] / policy.scores(32)[0], rel=0.02)
    assert policy.choose(32, alike) == 1
    # one sequence: the per-step choice, whatever its own record says
    assert policy.choose(1, [(60, *slow)]) == policy.choose(1)


def test_a_closed_batch_s_choice_is_revised_every_drain_interval_steps():
    policy = _closed_batch_policy(drain_interval=4, drain_lead_hold=0)
    fast, slow = (60, [20], [20]), (60, [20], [0])
    assert policy.choose(32) == 1
    assert [policy.choose(32, [slow] * 4 + [fast] * 28) for _ in range(2)] == [0, 0]  # revised at the first
    # every sequence fast now: k = 1 pays again, but the choice holds for the rest of the 4 steps
    assert [policy.choose(32, [fast] * 32) for _ in range(5)] == [0, 0, 1, 1, 1]
    # the engine hands a function: the sequences' records are read only on the steps that revise
    built = []

    def draining():
        built.append(1)
        return [slow] * 32
    assert [policy.choose(32, draining) for _ in range(8)] == [1, 0, 0, 0, 0, 0, 0, 0]
    assert len(built) == 2


def test_a_closed_batch_s_estimate_takes_a_small_share_of_the_steps_time():
    """Steps of 10 us (far below the estimate's own cost): the choice is revised every 32 steps, not
    every 4; steps of a second leave it at drain_interval."""
    def revisions(scale):
        policy = AdaptivePolicy(1, prior_weight=1e-9, probe_interval=10**6, drain_interval=4, drain_lead_hold=0)
        for k in (0, 1):
            for b in (1, 2, 4):
                policy.record_step(k, b, scale * (1.0 + 0.6 * k))
        for _ in range(50):
            policy.record_verify(1, 1)
        built = []

        def draining():
            built.append(1)
            return [(60, [20], [20])] * 4
        for _ in range(64):
            policy.choose(4, draining)
        return len(built)

    assert revisions(1.0) == 16
    assert revisions(1e-5) == 2
    with pytest.raises(ValueError, match="drain_budget"):
        AdaptivePolicy(1, drain_budget=0)


def test_a_closed_batch_s_choice_stands_longer_the_wider_its_lead_and_is_revised_when_its_bucket_shrinks():
    """Closed batches of 32 where k = 0 led the next depth by 8-20%, revised every 4-6 steps (drain_budget):
    the estimates took ~2% of the steps' time to confirm k = 0. A choice stands drain_lead_hold times longer
    for every switch margin its lead spans (up to 32 steps), and is made anew when the batch falls to a
    smaller bucket (its tail, where the depths' costs differ most)."""
    def revisions(sizes, **options):
        policy = _closed_batch_policy(drain_interval=4, **options)
        built = []

        def draining():
            built.append(policy._last_batch)
            return [(60, [20], [0])] * policy._last_batch  # drafts never agree: k = 0 leads k = 1 by 60%

        for b in sizes:
            assert policy.choose(b, draining) == 0
        return built

    assert revisions([32] * 64) == [32, 32]  # at the first step and after 32
    assert len(revisions([32] * 64, drain_lead_hold=0)) == 16  # every drain_interval steps
    # 20 and 9 share the buckets of 32 and 16
    assert revisions([32] * 10 + [20] * 5 + [16] * 5 + [9] * 5 + [8] * 5) == [32, 16, 8]
    policy = AdaptivePolicy(2)
    assert policy._drain_lead([1.0, 1.06, None]) == pytest.approx(2.0)  # 6% ahead: two switch margins
    assert policy._drain_lead([1.0, 1.01, 0.5]) == 1.0 and policy._drain_lead([1.0, None, None]) == 1.0
    with pytest.raises(ValueError, match="drain_lead_hold"):
        AdaptivePolicy(1, drain_lead_hold=-1)


def test_a_batch_s_slow_tail_does_not_set_what_the_next_batch_s_sequences_are_expected_to_accept():
    policy = AdaptivePolicy(1, verify_decay=0.0, prior_weight=1e-9)  # (steps of 1 verify: each decays by 0.9)
    for _ in range(100):  # a batch of sequences whose drafts agree
        for _ in range(8):
            policy.record_verify(1, 1)
        policy.end_step()
    for _ in range(40):  # its last sequence, alone, whose drafts never agree
        policy.record_verify(1, 0)
        policy.end_step()
    assert policy.acceptance()[0] < 0.2  # the recent estimate: that sequence's
    assert policy.long_run_acceptance()[0] > 0.9
    assert policy.sequence_expected_tokens([], [])[1] > 1.9  # a fresh sequence starts from the long run
    with pytest.raises(ValueError, match="long_decay"):
        AdaptivePolicy(2, long_decay=1.5)


def test_a_closed_batch_of_new_sequences_drains_with_the_spread_its_predecessors_showed():
    """Sequences that have verified nothing all look alike, yet prompts differ: the finished sequences'
    spread (`record_finished`) gives the new ones a tail, which k = 0 does not have."""
    policy = _closed_batch_policy(drain_interval=1)
    p = policy.long_run_acceptance()[0]
    new = [(60, [], [])] * 32
    alike = policy.drain_scores(new)
    assert alike[1] > alike[0]  # without a spread: every sequence at p, k = 1 wins as it does per step
    for i in range(40):  # finished sequences: a quarter of them never accepted a draft
        policy.record_finished([20], [0] if i % 4 == 0 else [20])
    spread = policy.drain_scores(new)
    assert spread[0] == alike[0]  # at k = 0 the batch still finishes together
    assert spread[1] < alike[1] and spread[1] < spread[0]  # at k = 1 its slow quarter drains alone
    assert policy.choose(32, new) == 0
    # a running sequence's own verifies outweigh the spread: all known to be fast, no tail
    known = [(60, [200], [200])] * 32
    assert policy.drain_scores(known)[1] > policy.drain_scores(known)[0]
    assert policy.long_run_acceptance()[0] == p  # recording a finish moves no estimate
    policy.record_finished([], [])  # a sequence that verified nothing says nothing
    assert len(policy._spread) == 40
    with pytest.raises(ValueError, match="spread_window"):
        AdaptivePolicy(1, spread_window=-1)


def test_the_drain_draws_from_the_window_s_own_ratios_as_finished_sequences_come_and_go():
    """A drain draws finished sequences from the window, kept slowest first (at the deepest k) as
    sequences finish and the oldest leave it: always the window's own ratios."""
    policy = AdaptivePolicy(3, spread_window=16)
    rng = random.Random(5)
    fresh = [(30, [], [])] * 4
    for i in range(40):
        tried = [rng.randint(1, 30) for _ in range(3)]
        policy.record_finished(tried, [rng.randint(0, t) for t in tried])
        assert len(policy._spread) == min(i + 1, 16)
        policy._spread_tokens(fresh, policy.long_run_acceptance())
        if i >= 7:  # (a spread from 8 finished sequences on)
            rows = sorted(policy._spread, key=lambda r: r[-1])
            assert np.array_equal(policy._spread_array, np.array(rows).T)
    policy.record_finished([], [])  # nothing verified: the window does not move
    assert policy._spread_array is not None and policy._spread_array.shape == (4, 16)


def test_a_rare_slow_prompt_gives_a_batch_its_tail_though_no_quantile_shows_it():
    """One finished sequence in eight never had a draft accepted: four fresh sequences include one
    such about 41% of the time (1 - (7/8)^4), and that one alone drains the batch at k = 1. The
    quantile the slowest of four was given once, (0 + 1/2) / 4 = 1/8, falls on a fast one."""
    def scores(slow_share: int) -> list:
        policy = _closed_batch_policy(drain_interval=1)
        for i in range(64):
            policy.record_finished([20], [0] if i % 8 < slow_share else [20])
        return policy.drain_scores([(40, [], [])] * 4)

    fast, rare = scores(0), scores(1)
    assert rare[0] == fast[0]  # k = 0: no tail either way
    assert fast[1] > fast[0]  # every prompt fast: k = 1 wins
    assert rare[1] < fast[1] * 0.9 and rare[1] < rare[0]  # the rare slow prompt's tail: k = 0 wins


def test_sequences_alike_still_finish_apart_at_k_above_0():
    """Four sequences with the same acceptance: at k = 1 the steps each needs vary (a step gains 1 or
    2 tokens), so the batch ends on a tail of steps with fewer sequences, which the drain charges;
    at k = 0 they finish together."""
    def cost(k, b):
        return {1: 0.9, 2: 0.95, 4: 1.0}[b] * (1.0 + 0.55 * k)

    def policy_with(samples_spread: bool) -> AdaptivePolicy:
        policy = AdaptivePolicy(1, prior_weight=1e-9, probe_interval=10**6, drain_interval=1)
        for k in (0, 1):
            for b in (1, 2, 4):
                policy.record_step(k, b, cost(k, b))
        for i in range(100):
            policy.record_verify(1, int(i % 5 < 3))  # p = 0.6: E[1] = 1.6 tokens a step for 1.55x the cost
        if not samples_spread:
            policy._drain_noise[4] = (np.zeros((1, 4)), np.zeros((1, 4)))
        return policy

    alike = [(64, [], [])] * 4
    without = policy_with(False).drain_scores(alike)
    assert without[1] > without[0]  # 40 steps at 1.55 against 64 at 1: k = 1 would win by 3%
    policy = policy_with(True)
    spread = policy.drain_scores(alike)
    assert spread[0] == pytest.approx(without[0])  # k = 0: one token a step, no spread
    assert spread[1] < spread[0]  # the last of four finishes ~2 steps late, the tail at nearly full cost
    assert policy.choose(4, alike) == 0
    assert policy.drain_scores(alike) == spread  # the same draws every time
    with pytest.raises(ValueError, match="drain_samples"):
        AdaptivePolicy(1, drain_samples=0)


def test_probes_that_change_nothing_come_less_often_until_something_changes():
    """Costs as estimated and acceptance steady: each probe confirms what the policy knew, so the gap
    doubles up to probe_backoff times the interval; a change of depth sets it back."""
    def cost(k, b):
        return 1.0 + 0.6 * k

    policy = _seeded(AdaptivePolicy(1, probe_steps=4, prior_weight=1e-9, probe_interval=16, seed=2), cost)
    chosen, scales = [], []
    for step in range(600):
        k = policy.choose(4)
        policy.record_step(k, 4, cost(k, 4))
        if k:
            policy.record_verify(1, int(step < 400))  # the draft stops agreeing at step 400
        policy.end_step()
        chosen.append(k)
        scales.append(policy._probe_scale)
    assert chosen[300:400].count(1) >= 95 and scales[399] == 4  # probes came every ~64 steps
    switch = next(i for i in range(400, 600) if chosen[i] == 0 and chosen[i + 1:i + 10] == [0] * 9)
    assert scales[switch + 1] == 1  # fallen to k = 0: probes every ~16 steps again, then backing off
    assert chosen[-100:].count(0) >= 85
    with pytest.raises(ValueError, match="probe_backoff"):
        AdaptivePolicy(1, probe_steps=4, probe_backoff=0)


def test_a_probe_whose_depth_comes_close_keeps_the_probes_coming_and_noisy_timings_do_not():
    """The gap between probes grows while probes change nothing. What counts is the choice: a probed depth
    that scored within probe_close (10%) of the depth in use keeps the gap as it is; timings noisier
    than 3% (batch 4) do not, where a draft that never agrees leaves no depth near k = 0."""
    rng = random.Random(1)

    def run(accept):
        policy = _seeded(AdaptivePolicy(1, prior_weight=1e-9, probe_interval=16, seed=2, probe_budget=1e9),
                         lambda k, b: 1.0 + 1.1 * k)
        scales = []
        for _ in range(600):
            k = policy.choose(4)
            policy.record_step(k, 4, (1.0 + 1.1 * k) * rng.uniform(0.85, 1.15))  # +-15% noise
            if k:
                policy.record_verifies([(1, accept)] * 4)
            policy.end_step()
            scales.append(policy._probe_scale)
        return scales

    never = run(0)[300:]  # a draft that never agrees: k = 1 at 1 / 2.1 of k = 0
    assert never.count(4) > 200  # probes every ~64 steps
    close = run(1)[300:]  # every draft agrees: k = 1 at 2 / 2.1 = 0.95 of k = 0, close each time
    assert close.count(1) > 200 and max(close) <= 2  # (+-15% noise puts it past probe_close now and then)
    with pytest.raises(ValueError, match="probe_close"):
        AdaptivePolicy(1, probe_close=1.0)


def test_a_policy_fallen_to_k_0_probes_the_depth_it_left_soon_whatever_that_costs():
    """A request's first drafts agree less (bench preset, closed batches of 32 at k = 3: 1.5-1.8 of 3 drafts
    accepted in the first three steps, 2.5-2.9 later), and a server whose 32 requests all start together
    fell to k = 0 on them. There it learns nothing of the drafts, the dip's estimate stands (hold_weight),
    and a probe of k = 3, three steps at 3 times k = 0's cost, waited ~300 steps for probe_budget: the
    level ran at k = 0 where k = 3 was 1.2 times faster. The depth left is probed recheck_steps later."""
    unit = {0: 1.0, 1: 1.8, 2: 2.4, 3: 3.0}
    policy = _seeded(AdaptivePolicy(3, prior_weight=1e-9, seed=2), lambda k, b: unit[k])
    chosen = []
    for step in range(300):
        k = policy.choose(32)
        chosen.append(k)
        if k:
            dip = 100 <= step < 110  # draft 1 accepted 1 time in 4, else 15 in 16
            policy.record_verifies([(k, 0)] * (24 if dip else 2) + [(k, k)] * (8 if dip else 30))
        policy.record_step(k, 32, unit[k])
        policy.end_step()
        if step == 115:
            assert policy._current == 0 and policy._probe_wait(3, 32) > 100  # (what the budget would wait)
    assert chosen[50:100] == [3] * 50 and 0 in chosen[100:115]
    back = next(i for i in range(115, 300) if chosen[i:i + 20] == [3] * 20)
    assert back <= 115 + policy.recheck_steps, chosen[100:back + 1]
    assert chosen[back:].count(3) > len(chosen[back:]) - 10
    with pytest.raises(ValueError, match="recheck_steps"):
        AdaptivePolicy(1, recheck_steps=0)


def _steps(policy: AdaptivePolicy, steps: int, batch, cost, verifies) -> list[int]:
    """Runs `steps` steps: step i at batch size batch(i), each at the k the policy chooses, verifying
    verifies(k, b) and timed cost(k, b); returns the chosen k's."""
    chosen = []
    for i in range(steps):
        b = batch(i)
        k = policy.choose(b)
        chosen.append(k)
        if k:
            policy.record_verifies(verifies(k, b))
        policy.record_step(k, b, cost(k, b))
        policy.end_step()
    return chosen


def test_a_fall_to_k_0_at_a_change_of_batch_size_is_rechecked_in_an_open_batch_only():
    """The engine benchmark's closed batches of 32 end with one sequence at k = 3, and the next batch's first
    (open) step falls to k = 0 at 32: no dip of the drafts, only a batch where k = 3 costs 4.4 times k = 0.
    Rechecked, k = 3 was probed there in every batch (~10% of its time): a recheck due in a closed batch is
    dropped. Served, a level's first steps fell to k = 0 as the batch grew, on the last level's tail's
    acceptance, and held it for ~120 steps until a paced probe: an open batch is rechecked."""
    unit = {1: {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, 16: {0: 1.0, 1: 2.2, 2: 3.3, 3: 4.4}}

    def run(closed_after_first_step):
        policy = _seeded(AdaptivePolicy(3, prior_weight=1e-9, seed=2), lambda k, b: unit.get(b, unit[16])[k])
        policy.record_verifies([(3, 3)] * 30 + [(3, 0)] * 2)
        chosen = []
        for i in range(120):
            b = 1 if i < 40 else 16
            draining = [(60, [10], [10])] * b if closed_after_first_step and i > 40 else None
            k = policy.choose(b, draining)
            chosen.append(k)
            if k:
                policy.record_verifies([(k, k)] * (b - 1) + [(k, 0)])
            policy.record_step(k, b, unit[b][k])
            policy.end_step()
        return chosen

    closed = run(True)
    assert closed[20:40] == [3] * 20 and closed[40] == 0
    assert closed[41:120] == [0] * 79  # (the budget's wait at batch 16: 3 x 3.4 / 0.02 steps)
    served = run(False)
    assert served[:41] == closed[:41]
    recheck = served.index(3, 41)  # the depth it left, recheck_steps later, not after the budget's wait
    assert 41 + AdaptivePolicy.recheck_steps - 2 <= recheck <= 41 + AdaptivePolicy.recheck_steps + 1
    assert served[recheck:recheck + 6] == [3] * 6 and served[recheck + 6:] == [0] * (120 - recheck - 6)


def test_a_dear_probe_waits_until_the_steps_since_the_last_one_pay_for_it():
    """Closed batches of 16 on the bench preset: a k = 1 step cost twice a k = 0 step, and a probe every
    ~128 steps (its three steps, the fill, the cold steps after) cost the policy held at k = 0 9% of
    its speed. A probe whose steps cost more than the depth in use's waits until that extra is at most
    probe_budget (2%) of the steps since the last probe; a probe of a cheaper depth does not wait."""
    def run(k_cost, accept, budget=0.02, steps=3000):
        policy = _seeded(AdaptivePolicy(1, probe_steps=4, prior_weight=1e-9, probe_interval=16, seed=2, probe_budget=budget),
                         lambda k, b: 1.0 + (k_cost - 1.0) * k)
        chosen = []
        for _ in range(steps):
            k = policy.choose(16)
            chosen.append(k)
            if k:
                policy.record_verifies([(1, accept)] * 16)
            policy.record_step(k, 16, 1.0 + (k_cost - 1.0) * k)
            policy.end_step()
        return chosen

    def starts(chosen, k):
        return [i for i in range(1, len(chosen)) if chosen[i] == k and chosen[i - 1] != k]

    held = run(2.0, 0)[100:]  # k = 0 in use; a probe's 3 steps at k = 1 cost 3 more: it waits 150 steps
    gaps = [b - a for a, b in zip(starts(held, 1), starts(held, 1)[1:])]
    assert len(gaps) > 10 and min(gaps) >= 150
    free = run(2.0, 0, budget=1e9)[100:]  # (the interval alone: 16 steps, doubling up to 64)
    assert max(b - a for a, b in zip(starts(free, 1), starts(free, 1)[1:])) <= 85
    cheap = run(1.3, 1)[100:]  # every draft agrees: k = 1 in use (2 tokens for 1.3), probes of k = 0 cost less
    gaps = [b - a for a, b in zip(starts(cheap, 0), starts(cheap, 0)[1:])]
    assert cheap.count(1) > 2800 and gaps and max(gaps) <= 2 * 85  # (every second probe time)
    with pytest.raises(ValueError, match="probe_budget"):
        AdaptivePolicy(1, probe_steps=4, probe_budget=0)


def test_a_probe_s_wait_is_counted_again_at_the_batch_size_then():
    """A dear probe's wait, counted at a batch where a k = 1 step costs 2.2 times k = 0's (4 x 1.2 / 0.02: 240
    steps), held the probes of the batch of 4 after it, where k = 1 costs 1.3 times k = 0 (60 steps). The wait
    is counted again every quarter interval, at the batch size then."""
    def cost(k, b):
        return 1.0 + ((2.2 if b > 4 else 1.3) - 1.0) * k

    policy = _seeded(AdaptivePolicy(1, probe_steps=4, prior_weight=1e-9, probe_interval=16, seed=2), cost)
    chosen = _steps(policy, 1700, lambda i: 16 if i < 1300 else 4, cost, lambda k, b: [(1, 0)] * b)
    starts = [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]
    gaps = [b - a for a, b in zip(starts[1:], starts[2:]) if b < 1300]
    assert len(gaps) >= 3 and min(gaps) >= 240
    assert min(i for i in starts if i >= 1300) <= 1300 + 60 + 16 / 4


def test_the_draft_s_pass_over_the_prompts_to_come_is_charged_to_speculating():
    """Bench preset, batch 4: a k = 1 step gains 1.9 tokens for 1.6 of a k = 0 step's cost, a win of
    19% per step, but at k > 0 every prompt is passed over by the draft too (41 us a position at batch
    1, 12-17 at batch 4, against a decode step of 0.6-1 ms). With as many prompt positions as output
    tokens and 60 us a position, k = 1 costs 1.6 + 4 x 1.9 x 0.06 = 2.06 for 1.9 tokens: k = 0 wins."""
    policy = _seeded(AdaptivePolicy(1, prior_weight=1e-9, probe_interval=10**6, revise_interval=1),
                     lambda k, b: 1.0 + 0.6 * k)
    for _ in range(50):
        policy.record_verifies([(1, 1)] * 4 + [(1, 0)])
    policy.record_verifies([(1, 1)] * 8)  # p = 0.9 (to 2 digits)
    assert policy.choose(4) == 1
    policy.record_draft_pass(256, 256 * 0.06)  # four 64-token prompts
    policy.record_draft_pass(4, 0.03)  # a small fill, mostly fixed costs, counts for its 4 positions
    assert policy.draft_pass_seconds()[0] == pytest.approx((256 * 0.06 * 0.8 + 0.03) / (256 * 0.8 + 4))
    assert policy.choose(4) == 1  # no request finished yet: no prompt to come is known
    for _ in range(10):
        policy.record_request(64, 64)
    position, per_token = policy.draft_pass_seconds()
    assert per_token == pytest.approx(1.0)
    e = policy.expected_tokens(1)
    assert policy.scores(4)[1] == pytest.approx(e / (1.6 + 4 * e * position))
    assert policy.scores(4)[0] == pytest.approx(1.0)
    assert policy.choose(4) == 0
    assert policy.choose(1) == 1  # at batch 1 the pass is shared by fewer tokens' steps: 1.9 / 1.71


def test_a_request_s_first_decode_step_verifying_filler_is_charged_where_first_drafts_wait():
    """Graph mode defers a prompt's first drafts to its first decode step, which gains one token: a
    request of m decode tokens takes 1 + (m - 1) / E steps, E / (1 + (E - 1) / m) tokens a step."""
    policy = _seeded(AdaptivePolicy(2, prior_weight=1e-9, probe_interval=10**6, revise_interval=1),
                     lambda k, b: 1.0 + 0.2 * k)
    for _ in range(40):
        policy.record_verifies([(2, 2)] * 3 + [(2, 0)])
    for _ in range(20):
        policy.record_request(16, 5)  # 4 decode tokens a request
    plain = policy.scores(1)
    e = policy.expected_tokens_by_depth()  # 1, 1.75, 2.5
    assert plain == pytest.approx([e[k] / (1.0 + 0.2 * k) for k in range(3)])
    assert policy.choose(1) == 2
    policy.first_drafts_deferred = True
    deferred = policy.scores(1)
    assert deferred == pytest.approx([e[k] / (1.0 + (e[k] - 1.0) / 4) / (1.0 + 0.2 * k) for k in range(3)])
    assert deferred[0] == plain[0] and deferred[2] < plain[2]
    assert policy.choose(1) == 2  # 2.5 / 1.375 = 1.82 tokens a step still, for 1.4 of k = 0's cost
    for _ in range(400):
        policy.record_request(16, 2)  # one decode step a request, and it verifies filler: no gain
    assert policy.scores(1) == pytest.approx([1.0 / (1.0 + 0.2 * k) for k in range(3)], rel=1e-3)
    assert policy.choose(1) == 0


def test_a_closed_batch_charges_the_positions_the_draft_has_not_passed_over_to_k_above_0():
    policy = _closed_batch_policy(drain_interval=1, drain_lead_hold=0)
    policy.record_draft_pass(1000, 1000 * 0.01)  # k = 1: ~50 s of steps and 20 s of passes, k = 0: 60 s
    seen = [(60, [20], [20], 0)] * 32
    unseen = [(60, [20], [20], 64)] * 32  # prompts to prefill, or keys left out at k = 0
    at_k0, at_k1 = policy.drain_scores(seen)
    assert policy.drain_scores([d[:3] for d in seen]) == [at_k0, at_k1]
    charged = policy.drain_scores(unseen)
    assert charged[0] == at_k0
    assert 60 * 32 / charged[1] == pytest.approx(60 * 32 / at_k1 + 32 * 64 * 0.01)
    assert policy.choose(32, seen) == 1 and policy.choose(32, unseen) == 0


def test_one_step_far_off_its_estimate_moves_it_as_one_1_5_times_off():
    policy = _seeded(AdaptivePolicy(1, probe_interval=10**6, reference_steps=1),
                     lambda k, b: 1.0 + k)  # one sample each
    policy._recent_k.extend([0, 0, 0])
    policy.record_step(0, 4, 10.0)  # a pause of the process: counted as 1.5
    load = 1.0 + 0.3 * (1.5 - 1.0)
    assert policy.cost(0, 4) == pytest.approx(load * (1.0 + 0.5 * (1.5 / load - 1.0)))  # unzipped: 6.85
    policy._recent_k.extend([1, 1, 1])
    policy.record_step(1, 4, 0.01)  # a probe's step, far too fast: counted as 2.0 x load / 1.5
    assert policy._costs[(1, 4)].seconds == pytest.approx(2.0 + 0.6 * (2.0 / 1.5 - 2.0))


def test_the_start_up_seeds_each_cost_with_the_median_of_its_timings():
    policy = AdaptivePolicy(2)
    policy.seed_step_cost(0, 3, [1.0, 1.1, 0.9, 1.0, 5.0])  # one slow step of five
    assert policy.cost(0, 4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seed_step_cost: k=3"):
        policy.seed_step_cost(3, 4, [1.0])
    with pytest.raises(ValueError, match="all > 0"):
        policy.seed_step_cost(1, 4, [])


def test_sequences_admitted_to_a_closed_batch_make_its_choice_anew():
    """The last batch's tail chose for its last sequences; the next batch, admitted in one step, must not
    run at that depth until the next revision (it prefilled at k = 3, paying the draft's pass over
    its prompts, where k = 0 was its depth)."""
    policy = _closed_batch_policy(drain_interval=8)
    fast, slow = (60, [20], [20]), (60, [20], [0])
    assert policy.choose(2, [fast] * 2) == 1  # a fast tail: k = 1, held for 8 steps...
    assert policy.choose(32, [slow] * 32) == 0  # ... unless sequences join: made anew at once
    assert policy.choose(32, [fast] * 32) == 0  # and then held until its next revision


def test_a_closed_batch_s_choice_is_revised_at_once_when_a_probe_ends():
    """A probe's steps are evidence (its timed step, its verifies): the closed batch's next step weighs
    them, as an open batch's does. Left to the drain's wait (up to 32 steps), a probe of k = 0 that ended
    18 steps into a closed batch of 32 at k = 2 was weighed 9 steps later."""
    policy = _closed_batch_policy(drain_interval=4, probe_interval=40, settle_steps=0)
    built = []

    def draining():
        built.append(step)
        return [(60, [20], [20])] * 32  # k = 1 leads k = 0 by far: the choice stands 32 steps

    chosen = []
    for step in range(200):
        chosen.append(policy.choose(32, draining))
    ends = [i for i in range(1, len(chosen)) if chosen[i - 1] == 0 and chosen[i] == 1 and i > policy.probe_steps]
    assert ends, chosen  # probes of k = 0 from k = 1, and the step after each one's last revises
    assert all(i in built for i in ends), (ends, built)
    assert all(chosen[i - policy.probe_steps:i] == [0] * policy.probe_steps for i in ends)


def test_a_closed_batch_s_first_steps_after_sequences_join_are_not_timed():
    """After a closed batch's prompts are prefilled its first decode steps run cold (bench preset, batch 32,
    k = 0: 5.7 ms, then 4.6 at the fourth, 4.0-4.5 from the seventh on), and the first batch's probes, set
    against them, put k = 3 at 3.6 times k = 0's step where it ran 4.5 times. The settle_steps steps from the
    one at which sequences join are not timed, and no probe starts in them."""
    policy = _closed_batch_policy(drain_interval=8, probe_interval=4, settle_steps=8)
    fast = (60, [20], [20])
    policy.choose(2, [fast] * 2)
    policy.record_step(1, 2, 0.72 * 1.6)
    before = policy.cost(1, 32), policy.cost(0, 32)
    chosen = []
    for _ in range(8):  # a new batch of 32 joins: its first 8 steps run 3 times slower, at the depth in use
        chosen.append(policy.choose(32, [fast] * 32))
        policy.record_step(chosen[-1], 32, 3.0 * (1.0 + 0.6 * chosen[-1]))
        policy.end_step()
    assert chosen == [chosen[0]] * 8  # no probe
    assert (policy.cost(1, 32), policy.cost(0, 32)) == before
    k = policy.choose(32, [fast] * 32)
    policy.record_step(k, 32, 3.0 * (1.0 + 0.6 * k))
    assert policy.cost(k, 32) > before[k]  # the ninth is timed
    with pytest.raises(ValueError, match="settle_steps"):
        AdaptivePolicy(1, settle_steps=-1)


def test_the_host_s_time_around_each_step_is_part_of_its_cost():
    """A step's host time (scheduling, outputs, a server's delivery) comes once a step whatever its
    tokens: k = 1 loses on its model time alone (1.85 tokens for 2.0 against 1.0) and wins once each
    step also pays 1.0 on the host."""
    policy = AdaptivePolicy(1, prior_weight=1e-9, probe_interval=10**6, revise_interval=1)
    policy.seed_step_cost(0, 1, [1.0])
    policy.seed_step_cost(1, 1, [2.0])
    policy.record_verifies([(1, 1)] * 17 + [(1, 0)] * 3)
    assert policy.overhead(0, 1) == 0.0 and policy.choose(1) == 0
    policy.record_overhead(0, 1, 1.0)
    assert policy.cost(0, 1) == pytest.approx(2.0)
    assert policy.cost(1, 1) == pytest.approx(3.0)  # one estimate a bucket, for every depth
    assert policy.cost(0, 16) == pytest.approx(2.0)  # the nearest bucket's stands in for batch 16's
    assert policy.choose(1) == 1
    policy.record_overhead(1, 1, 0.8)  # the depth in use keeps it up for every depth
    assert policy.overhead(0, 1) == policy.overhead(1, 1) == pytest.approx(1.0 + 0.1 * (0.8 - 1.0))
    policy.record_overhead(1, 1, 10.0)  # a pause between two steps: counted as 1.5 x the estimate
    assert policy.overhead(0, 1) == pytest.approx(0.98 + 0.1 * (1.5 * 0.98 - 0.98))
    policy.record_overhead(0, 1, -1.0)  # no such interval: ignored
    assert policy.overhead(0, 1) == pytest.approx(1.029)
    policy.record_overhead(1, 16, 0.1)
    assert policy.overhead(0, 16) == 0.1 and policy.overhead(0, 1) == pytest.approx(1.029)


def test_choose_s_shortcut_between_revisions_picks_what_the_full_choice_would():
    """Most of an open batch's steps neither revise nor probe, and `choose` takes a shortcut through them
    (the policy's time between two model steps); a policy made to take the full path every step chooses
    the same depths, through probes, switches, changes of batch size and a draft that turns bad."""

    class Full(AdaptivePolicy):
        def choose(self, batch_size, draining=None):
            self._steady_size = -1  # (never a batch size: no shortcut)
            return super().choose(batch_size, draining)

    def run(policy):
        rng = random.Random(3)
        for k in range(policy.max_k + 1):
            for b in (1, 2, 4, 8):
                policy.seed_step_cost(k, b, [1.0 + 0.2 * k * b])
        chosen, batch, shortcuts = [], 1, 0
        for step in range(3000):
            if rng.random() < 0.02:
                batch = rng.choice([1, 2, 3, 4, 7])
            good = (step // 700) % 2 == 0
            shortcuts += batch == policy._steady_size and policy._revise_wait > 0 and not policy._probe_left
            # (a closed batch of one sequence is chosen for as an open one)
            k = policy.choose(batch, (lambda: []) if batch == 1 and step % 3 == 0 else None)
            chosen.append(k)
            if k:
                accepted = [sum(rng.random() < (0.9 if good else 0.1) for _ in range(k)) for _ in range(batch)]
                policy.record_verifies([(k, a) for a in accepted])
            policy.record_step(k, batch, (1.0 + 0.2 * k * batch) * rng.uniform(0.9, 1.2))
            policy.record_overhead(k, batch, 0.1 * rng.uniform(0.8, 1.2))
            policy.end_step()
        return chosen, shortcuts

    fast, shortcuts = run(AdaptivePolicy(3, seed=1))
    full, _ = run(Full(3, seed=1))
    assert fast == full
    assert shortcuts > 1000 and len(set(fast)) == 4  # (it was taken, and every depth ran)


def test_choose_s_shortcut_through_a_closed_batch_picks_what_the_full_choice_would():
    """A closed batch's steps between the drain's revisions take the shortcut too: batches of 2 to 32
    that drain to their last sequence, a draft that turns bad and back, probes and falls to smaller
    buckets, chosen the same as by a policy made to take the full path every step. (drain_budget is
    set out of the way: the wait it sets follows how long the drain's estimate took.)"""

    class Full(AdaptivePolicy):
        def _steady(self, batch_size, draining):
            return False

    def run(policy):
        rng = random.Random(4)
        for k in range(policy.max_k + 1):
            for b in (1, 2, 4, 8, 16, 32):
                policy.seed_step_cost(k, b, [1.0 + 0.1 * k * b])
        chosen, shortcuts, step = [], 0, 0
        for _ in range(60):
            left = [rng.randint(10, 60) for _ in range(rng.choice([2, 3, 4, 8, 16, 32]))]
            tried, hits = [[0] * 3 for _ in left], [[0] * 3 for _ in left]
            while any(r > 0 for r in left):
                running = [i for i, r in enumerate(left) if r > 0]
                good = (step // 500) % 2 == 0
                step += 1
                shortcuts += (policy._probe_closed and policy._drain_wait > 0 and not policy._probe_left
                              and len(running) <= policy._last_batch and 2 * len(running) > policy._drain_bucket)
                k = policy.choose(len(running), lambda: [(left[i], tried[i], hits[i]) for i in running])
                chosen.append(k)
                accepted = [sum(rng.random() < (0.9 if good else 0.1) for _ in range(k)) for _ in running]
                if k:
                    policy.record_verifies([(k, a) for a in accepted])
                for i, a in zip(running, accepted):
                    left[i] -= 1 + a
                    for j in range(min(a + 1, k)):
                        tried[i][j] += 1
                    for j in range(a):
                        hits[i][j] += 1
                    if left[i] <= 0:
                        policy.record_finished(tried[i], hits[i])
                policy.record_step(k, len(running), (1.0 + 0.1 * k * len(running)) * rng.uniform(0.9, 1.2))
                policy.record_overhead(k, len(running), 0.1 * rng.uniform(0.8, 1.2))
                policy.end_step()
        return chosen, shortcuts

    fast, shortcuts = run(AdaptivePolicy(3, seed=2, drain_budget=1e9))
    full, _ = run(Full(3, seed=2, drain_budget=1e9))
    assert fast == full
    assert shortcuts > len(fast) // 2 and len(set(fast)) == 4  # (it was taken, and every depth ran)


def test_a_step_that_only_prefills_ends_the_probe_under_way():
    """A probe that a batch's tail began would run on into the next batch: its prompts prefilled at the
    probed depth (the draft's pass over them) and its first, cold steps. The engine tells the policy
    before a step that only prefills, and the depth in use takes it."""
    policy = _seeded(AdaptivePolicy(3, probe_interval=10**6), lambda k, b: 1.0 + 0.5 * k)
    policy.record_verifies([(1, 0)] * 8)  # the draft misses: k = 0
    assert [policy.choose(4) for _ in range(8)] == [0] * 8
    policy._start_probe(2)  # (as a probe time would)
    assert [policy.choose(4) for _ in range(3)] == [2] * 3  # the probe goes on ...
    policy.prompts_only()
    assert policy.choose(4) == 0 and policy._probe_left == 0  # ... until a step only prefills
    assert policy.choose(4) == 0


def test_the_trace_records_each_revision_probe_and_probe_result_and_a_bad_path_names_the_variable(
        tmp_path, monkeypatch):
    import io
    import json

    trace = io.StringIO()
    run_policy(_seeded(AdaptivePolicy(3, trace=trace, probe_interval=16), lambda k, b: 1.0 + 0.15 * k),
               lambda step: 0.0 if step >= 100 else 0.9, 300)
    records = [json.loads(line) for line in trace.getvalue().splitlines()]
    events = {r["event"] for r in records}
    assert events == {"choice", "probe", "probe_result"}
    choices = [r for r in records if r["event"] == "choice"]
    assert choices[0]["k"] == 3 and choices[-1]["k"] == 0  # it fell back once the draft went bad
    assert all(len(r["scores"]) == len(r["costs"]) == 4 and len(r["acceptance"]) == 3 for r in choices)
    results = [r for r in records if r["event"] == "probe_result"]
    assert results and all(r["k"] != r["current"] and r["after"] > 0 for r in results)
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    assert AdaptivePolicy(3).trace is None  # (make_policy without the variable: no trace, no file)

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MTP_SPEC_POLICY_TRACE", str(path))
    policy = make_policy(3, True)
    run_policy(policy, lambda step: 0.9, 50)
    assert json.loads(path.read_text().splitlines()[0])["event"] in ("choice", "probe")
    assert make_policy(3, False).describe()["speculative_policy"] == "fixed"  # (fixed k: no trace)
    monkeypatch.setenv("MTP_SPEC_POLICY_TRACE", str(tmp_path / "missing" / "trace.jsonl"))
    with pytest.raises(ValueError, match=r"MTP_SPEC_POLICY_TRACE.*missing"):
        make_policy(3, True)


def test_a_probe_up_from_k_0_waits_for_the_draft_s_fill_of_the_keys_left_out_too():
    """The first step at k > 0 after steps at k = 0 fills the draft keys they left out (every running
    sequence's prompt and tokens since, at batch 1 on the bench preset ~190 positions at ~41 us): with a
    draft gone bad, an engine held at k = 0 paid that with every probe and ran 0.77-0.87 of fixed k = 0.
    The fill counts in the probe's wait as the probe's own extra steps do."""
    def policy_at_k0(unseen):
        policy = _seeded(AdaptivePolicy(3, prior_weight=1e-9, probe_interval=10**6), lambda k, b: 1.0 + k)
        policy.record_verifies([(3, 0)] * 40)  # a draft that never agrees: k = 0
        policy.record_draft_pass(100, 0.5)  # 5 ms a position
        if unseen is not None:
            policy.unseen_positions = lambda: unseen
        assert [policy.choose(1) for _ in range(5)] == [0] * 5
        return policy

    # k = 3 costs 4 where k = 0 costs 1: 6 steps x 3 extra / (0.02 x 1) = 900 steps; a fill of 200
    # positions at 5 ms is 1 more unit: 950
    assert policy_at_k0(None)._probe_wait(3, 1) == policy_at_k0(0)._probe_wait(3, 1) == 900 - 5
    assert policy_at_k0(200)._probe_wait(3, 1) == 950 - 5
    assert policy_at_k0(200)._probe_wait(0, 1) == 0  # (a probe down fills nothing and waits for nothing)
