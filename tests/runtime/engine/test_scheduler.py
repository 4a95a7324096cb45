"""Scheduler: budgets, chunked prefill, preemption, prefix cache, no leaks, no deadlock.

A fake model stands in for the network: the "correct" next token is a pure
function of the tokens so far, so every finished request must match a plain
reference generation whatever the scheduler did. A fake paged cache checks
that every cached entry a step relies on was written for exactly those
tokens (main entry: the token at that position and its prefix; draft entry:
also the next token).
"""

import random

import pytest

from mtp_runtime.engine.scheduler import Scheduler
from mtp_runtime.engine.sequence import Sequence
from mtp_runtime.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


def next_token(tokens):
    return (tokens[-1] * 7 + len(tokens) * 3 + (tokens[-2] if len(tokens) > 1 else 0)) % (VOCAB - 1) + 1


def reference(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    """Writes fake KV entries into slots and checks reads, like the real cache would be used."""

    def __init__(self, scheduler, k, accept_prob, rng):
        self.s, self.k, self.accept_prob, self.rng = scheduler, k, accept_prob, rng
        self.main = {}  # slot -> tuple(prefix tokens through the position)
        self.draft = {}  # slot -> tuple(prefix tokens through position + 1)

    def slot(self, seq, pos):
        bs = self.s.block_manager.block_size
        assert pos < len(seq.block_table) * bs, f"{seq!r}: position {pos} has no reserved slot"
        return seq.block_table[pos // bs] * bs + pos % bs

    def step(self, batch):
        bm = self.s.block_manager
        new_tokens, accepted = [], []
        for seq, chunk, drafts, samples in zip(batch.seqs, batch.num_chunk_tokens,
                                               batch.num_draft_tokens, batch.samples):
            start = seq.num_cached_tokens
            toks = seq.token_ids
            for pos in range(start):  # everything cached must be exactly these tokens
                assert self.main[self.slot(seq, pos)] == tuple(toks[:pos + 1])
                if self.k:
                    assert self.draft[self.slot(seq, pos)] == tuple(toks[:pos + 2]), (seq, pos)
            inputs = toks[start:start + chunk] + seq.draft_token_ids[:drafts]
            # Every slot written this step belongs to this sequence alone.
            last = start + chunk + drafts + (self.k - 1 if samples and self.k else 0)
            for j in range(start // bm.block_size, len(seq.block_table)):
                if j * bm.block_size < last:
                    assert bm.blocks[seq.block_table[j]].ref_count == 1
            ctx = toks[:start]
            for i, tok in enumerate(inputs):
                ctx = ctx + [tok]
                self.main[self.slot(seq, start + i)] = tuple(ctx)
            self.slot(seq, last - 1)
            if not samples:
                new_tokens.append([])
                accepted.append(0)
                for pos in range(start, start + chunk):
                    self.draft[self.slot(seq, pos)] = tuple(toks[:pos + 2])
                continue
            base = toks[:start + chunk]
            out = []
            a = 0
            for d in seq.draft_token_ids[:drafts]:
                if d != next_token(base + out):
                    break
                out.append(d)
                a += 1
            out.append(next_token(base + out))
            full = base + out
            for pos in range(start, start + chunk + a):
                self.draft[self.slot(seq, pos)] = tuple(full[:pos + 2])
            # Next drafts: right with probability accept_prob, else a wrong token.
            seq.draft_token_ids = []
            ctx = list(full)
            for _ in range(self.k):
                t = next_token(ctx)
                if self.rng.random() > self.accept_prob:
                    t = t % (VOCAB - 1) + 1 if t != VOCAB - 1 else 1
                seq.draft_token_ids.append(t)
                ctx.append(t)
            new_tokens.append(out)
            accepted.append(a)
        return new_tokens, accepted


def make_scheduler(**kw):
    args = dict(num_blocks=64, block_size=4, max_seqs_per_batch=8, max_tokens_per_batch=32,
                max_model_len=256, num_speculative_tokens=0, enable_prefix_cache=False,
                enable_chunked_prefill=True, eos_token_ids=(EOS,))
    args.update(kw)
    return Scheduler(**args)


def make_seq(rid, prompt, max_tokens):
    return Sequence(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_model_len=256)


def run_to_end(s, runner, seqs_by_step, abort_at=None, max_steps=5000):
    abort_at = abort_at or {}
    all_seqs, step = [], 0
    while step < max_steps:
        for seq in seqs_by_step.get(step, []):
            s.add(seq)
            all_seqs.append(seq)
        for seq in abort_at.get(step, []):
            s.abort(seq)
        if not s.has_unfinished() and step > max(seqs_by_step, default=0):
            break
        batch = s.schedule()
        assert batch.num_tokens <= s.max_tokens and len(batch) <= s.max_seqs
        if len(batch):
            tokens, accepted = runner.step(batch)
            s.update(batch, tokens, accepted, now=float(step))
        else:
            assert not s.running, "running sequences but nothing scheduled"
            assert not s.waiting or step in seqs_by_step, "waiting requests but nothing scheduled: deadlock"
        step += 1
    assert step < max_steps, "did not finish: livelock"
    return all_seqs


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
def test_random_mix_is_lossless_and_frees_every_block(k, chunked, prefix):
    rng = random.Random(1000 * k + 10 * chunked + prefix)
    block_size = 4
    s = make_scheduler(num_blocks=14, block_size=block_size, num_speculative_tokens=k,
                       enable_prefix_cache=prefix, enable_chunked_prefill=chunked,
                       max_tokens_per_batch=24, max_seqs_per_batch=5)
    runner = FakeRunner(s, k, accept_prob=0.7, rng=rng)
    shared = [rng.randrange(1, VOCAB) for _ in range(9)]
    arrivals, aborts, expected = {}, {}, {}
    for n in range(24):
        prompt = (shared[:rng.choice([0, 4, 8, 9])] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))])
        seq = make_seq(f"r{n}", prompt, rng.randrange(1, 20))
        arrivals.setdefault(rng.randrange(0, 60), []).append(seq)
        expected[seq.request_id] = reference(prompt, seq.max_output_tokens)
        if rng.random() < 0.2:
            aborts.setdefault(rng.randrange(0, 80), []).append(seq)
    seqs = run_to_end(s, runner, arrivals, aborts)
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert s.num_preemptions > 0, "the tiny cache should force preemption"
    assert (bm.num_hit_tokens > 0) == prefix
    for seq in seqs:
        assert seq.is_finished
        if seq.finish_reason == "abort":
            continue
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == expected[seq.request_id]
        assert seq.accepted_tokens <= seq.draft_tokens
    if k:
        assert sum(seq.verify_steps for seq in seqs) > 0


def test_prefix_cache_hits_skip_cached_blocks():
    s = make_scheduler(enable_prefix_cache=True, num_speculative_tokens=0)
    runner = FakeRunner(s, 0, 1.0, random.Random(0))
    prompt = list(range(1, 14))
    a = make_seq("a", prompt, 2)
    run_to_end(s, runner, {0: [a]})
    b = make_seq("b", prompt, 2)
    s.add(b)
    batch = s.schedule()
    assert b.num_cached_tokens == 12 and batch.num_chunk_tokens == [1]
    runner.step(batch)


def test_budget_and_seq_limits_with_chunked_prefill():
    s = make_scheduler(max_tokens_per_batch=8, max_seqs_per_batch=2)
    seqs = [make_seq(f"r{i}", list(range(1, 12)), 3) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    batch = s.schedule()
    assert batch.seqs == [seqs[0]] and batch.num_chunk_tokens == [8] and batch.samples == [False]
    s.update(batch, [[]], [0], now=0.0)
    batch = s.schedule()
    assert batch.seqs == seqs[:2] and batch.num_chunk_tokens == [3, 5] and batch.samples == [True, False]


def test_no_chunking_waits_for_budget():
    s = make_scheduler(max_tokens_per_batch=12, enable_chunked_prefill=False)
    s.add(make_seq("a", list(range(1, 9)), 3))
    s.add(make_seq("b", list(range(1, 9)), 3))
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["a"] and batch.num_chunk_tokens == [8]


def test_bad_requests_are_rejected_with_reasons():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(make_seq("big", list(range(1, 10)), 40))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(Sequence("long", list(range(1, 80)), SamplingParams(max_tokens=1), max_model_len=64))
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        make_scheduler(max_tokens_per_batch=2, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        make_seq("empty", [], 1)


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make_scheduler()
    seq = Sequence("a", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=[42]), max_model_len=256)
    s.add(seq)
    batch = s.schedule()
    finished = s.update(batch, [[7]], [0], now=1.0)
    assert finished == []
    batch = s.schedule()
    finished = s.update(batch, [[42, 9]], [0], now=2.0)  # tokens after the stop token are dropped
    assert finished == [seq] and seq.finish_reason == "stop" and seq.output_token_ids == [7, 42]
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
