"""Adaptive depth's steps at k = 0 write no draft keys: every step keeps the main hidden state of each
position instead, and the next step that drafts writes the keys they left out in one pass
(ModelRunner._fill_draft_keys). The keys that pass writes are the ones a fixed-k engine writes as it
goes, so the drafts after a stretch at k = 0 attend to the same context."""

import pytest
import torch

from mtp_runtime.engine.config import EngineConfig
from mtp_runtime.engine.llm_engine import LLMEngine
from mtp_runtime.engine.spec_policy import AdaptivePolicy
from mtp_runtime.layers.attention import gather_cache

ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe")
SETTINGS = dict(max_model_len=96, block_size=4, max_seqs_per_batch=8, max_tokens_per_batch=64, enable_graph=False)
PROMPT = [5 + (i * 37) % 400 for i in range(13)]


class Scripted(AdaptivePolicy):
    """The adaptive policy, its evidence kept as usual, but each step's k comes from a list (then its
    last)."""

    def __init__(self, ks: list[int]):
        super().__init__(max(ks))
        self.ks, self.chosen = list(ks), []

    def choose(self, batch_size: int, draining=None) -> int:
        self.chosen.append(self.ks[min(len(self.chosen), len(self.ks) - 1)])
        return self.chosen[-1]


class Recorder:
    """Wraps runner.execute: after each step, a copy of the draft cache and each sequence's block table."""

    def __init__(self, engine):
        self.runner = engine.runner
        self._execute = engine.runner.execute
        engine.runner.execute = self
        self.steps = []  # (k, {request id: (block table, draft_keys_from)}, draft cache before, after)
        self.tables = {}

    def __call__(self, batch):
        before = self.cache().clone()
        out = self._execute(batch)
        for seq in batch.seqs:
            self.tables[seq.request_id] = list(seq.block_table)
        self.steps.append((batch.num_speculative_tokens,
                           {s.request_id: s.draft_keys_from for s in batch.seqs}, before, self.cache().clone()))
        return out

    def cache(self) -> torch.Tensor:
        name = next(iter(self.runner.draft_caches[0]))
        return self.runner.draft_caches[0][name]

    def keys(self, request_id: str, end: int) -> torch.Tensor:
        """The draft's keys at positions 0..end-1 of a request, from its last block table."""
        slots = self.runner._tensor(self.runner._slots(self.tables[request_id], 0, end))
        return gather_cache(self.cache(), slots)


def run(engine, requests):
    """requests: [(id, prompt, max_tokens)], each added once the one before finished."""
    outputs = {}
    for rid, prompt, max_tokens in requests:
        engine.add_request(rid, prompt, params(max_tokens))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[rid] = out.token_ids
    return outputs


def params(max_tokens):
    from mtp_runtime.sampling_params import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_keys_left_out_at_k0_are_written_by_the_next_drafting_step_as_a_fixed_k_engine_writes_them(
        tiny_models, arch):
    adaptive = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, speculative_adaptive=True,
                                      **SETTINGS), policy=Scripted([0] * 6 + [2]))
    fixed = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, **SETTINGS))
    seen, want = Recorder(adaptive), Recorder(fixed)
    runner = adaptive.runner
    assert runner.hidden_caches and fixed.runner.hidden_caches == []
    assert run(adaptive, [("r", PROMPT, 20)]) == run(fixed, [("r", PROMPT, 20)])

    # the six steps at k = 0 (the prompt's, then five decodes) left the draft cache as it was
    at_zero = [step for step in seen.steps if step[0] == 0]
    assert len(at_zero) == 6
    for _, gap, before, after in at_zero:
        assert torch.equal(before, after)
        assert gap == {"r": 0}  # the gap starts at the prompt's first position
    # the first step at k = 2 wrote the prompt's 13 keys and the five decodes'
    assert runner.draft_keys_filled == len(PROMPT) + 5
    # the fill is the draft's only pass outside decode steps here: the policy charges it to speculating
    assert adaptive.policy._pass_positions == len(PROMPT) + 5 and adaptive.policy.draft_pass_seconds()[0] > 0
    assert seen.steps[6][1] == {"r": None}
    # and every key the draft holds for the request is the fixed-k engine's (positions 0..L-2 are final)
    final = len(PROMPT) + 20 - 1
    torch.testing.assert_close(seen.keys("r", final), want.keys("r", final), atol=1e-5, rtol=1e-5)


def test_a_prefix_hit_fills_the_shared_blocks_keys_a_step_at_k0_left_out(tiny_models):
    """The first request runs at k = 0 throughout, so the blocks a second one shares with it hold no
    draft keys; the second one's first drafting step writes them from position 0."""
    arch = "deepseek_v3"
    adaptive = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, speculative_adaptive=True,
                                      **SETTINGS), policy=Scripted([0] * 7 + [2]))
    fixed = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, **SETTINGS))
    seen, want = Recorder(adaptive), Recorder(fixed)
    first, second = ("r", PROMPT, 6), ("s", PROMPT + [9, 10, 11], 10)
    got = run(adaptive, [first, second])
    assert got == run(fixed, [first, second])
    assert adaptive.scheduler.block_manager.num_hit_tokens >= 12
    assert [step[0] for step in seen.steps][:7] == [0] * 7  # r's prompt and five decodes, s's prompt
    assert seen.steps[6][1] == {"s": 0}
    final = len(second[1]) + second[2] - 1
    torch.testing.assert_close(seen.keys("s", final), want.keys("s", final), atol=1e-5, rtol=1e-5)


def test_a_preempted_sequence_forgets_its_gap(tiny_models):
    from mtp_runtime.engine.sequence import Sequence
    seq = Sequence("r", PROMPT, params(4), 96)
    seq.draft_keys_from = 5
    seq.reset_for_recompute()
    assert seq.draft_keys_from is None


def test_a_prefix_hit_on_blocks_whose_draft_keys_were_all_written_fills_none(tiny_models):
    """Blocks published from steps that drafted hold their draft keys: the request that shares them
    drafts on them as they are (a fill of the whole hit was ~4% of a served request's time)."""
    arch = "deepseek_v3"
    adaptive = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, speculative_adaptive=True,
                                      **SETTINGS), policy=Scripted([2]))
    fixed = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, **SETTINGS))
    seen, want = Recorder(adaptive), Recorder(fixed)
    first, second = ("r", PROMPT, 6), ("s", PROMPT + [9, 10, 11], 10)
    assert run(adaptive, [first, second]) == run(fixed, [first, second])
    assert adaptive.scheduler.block_manager.num_hit_tokens >= 12
    assert adaptive.runner.draft_keys_filled == 0
    final = len(second[1]) + second[2] - 1
    torch.testing.assert_close(seen.keys("s", final), want.keys("s", final), atol=1e-5, rtol=1e-5)


def test_a_prefix_hit_fills_from_the_first_block_a_step_at_k0_left_keys_out_of(tiny_models):
    """The prompt's step drafts (its 13 positions' keys written), the decode steps after it run at k = 0
    from position 13: blocks 0-2 hold their keys, block 3 (positions 12-15) does not. A request that
    shares all four fills from position 12 alone."""
    arch = "deepseek_v3"
    adaptive = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, speculative_adaptive=True,
                                      **SETTINGS), policy=Scripted([2] + [0] * 5 + [2]))
    fixed = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, **SETTINGS))
    seen, want = Recorder(adaptive), Recorder(fixed)
    out = run(adaptive, [("r", PROMPT, 6)])
    assert out == run(fixed, [("r", PROMPT, 6)])
    manager = adaptive.scheduler.block_manager
    published = [manager.blocks[b] for b in seen.tables["r"][:4]]
    assert [b.hash != -1 for b in published] == [True] * 4
    assert [b.draft_keys for b in published] == [True, True, True, False]
    filled = adaptive.runner.draft_keys_filled
    second = ("s", PROMPT + out["r"][:5] + [9], 8)  # its first 17 tokens are r's: 4 blocks hit
    assert run(adaptive, [second]) == run(fixed, [second])
    assert manager.num_hit_tokens == 16
    # s's prompt step (at k = 2, the script's last) filled positions 12..15 first, and nothing before them
    assert seen.steps[6][0] == 2 and adaptive.runner.draft_keys_filled - filled == 4
    final = len(second[1]) + second[2] - 1
    torch.testing.assert_close(seen.keys("s", final), want.keys("s", final), atol=1e-5, rtol=1e-5)
