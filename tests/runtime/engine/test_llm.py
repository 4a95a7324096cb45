"""The LLM offline API and the LLMEngine request interface: outputs, stops, aborts, seeds, threads."""

import gc
import threading

import pytest

from mtp_runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm_v3(tiny_models):
    from mtp_runtime import LLM

    return LLM(tiny_models["deepseek_v3"], num_speculative_tokens=2, max_model_len=96, block_size=4)


def test_import_mtp_runtime_stays_torch_free():
    import subprocess
    import sys

    code = "import sys, mtp_runtime; assert 'torch' not in sys.modules; from mtp_runtime import SamplingParams"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generate_returns_one_finished_output_per_prompt_in_order(llm_v3):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm_v3.generate(["def main():", [5, 6, 7, 8], "import os"], params)
    assert [o.finished for o in outs] == [True] * 3
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    assert outs[0].prompt_token_ids == llm_v3.tokenizer.encode("def main():").ids
    assert outs[0].text == llm_v3.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)
    for o in outs:
        assert o.finish_reason == "length"
        assert o.draft_tokens == 2 * o.verify_steps and 0 <= o.accepted_tokens <= o.draft_tokens
        assert len(o.accepted_per_position) == 2 and sum(o.accepted_per_position) == o.accepted_tokens
        assert o.ttft_s > 0 and o.tpot_s > 0


def test_per_prompt_params_and_their_validation(llm_v3):
    outs = llm_v3.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm_v3.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match="unknown engine option"):
        from mtp_runtime import LLM

        LLM("unused", max_batch=4)


def test_stop_token_ids_and_stop_strings(llm_v3):
    base = llm_v3.generate("class A:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = base.token_ids[3]
    out = llm_v3.generate("class A:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                     stop_token_ids=[stop_id]))[0]
    first = base.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]
    stop_text = base.text[len(base.text) // 2:][:3]
    if stop_text.strip():
        out = llm_v3.generate("class A:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                         stop=[stop_text]))[0]
        assert out.finish_reason == "stop"
        assert out.text == base.text[:base.text.index(stop_text)]


def test_eos_ends_a_request_unless_ignored(kit, tiny_models):
    engine = kit.make_engine(tiny_models["glm4_moe"], 1)
    eos = engine.scheduler.eos_token_ids
    assert eos == frozenset({1, 2, 5})
    probe = kit.run_requests(engine, {"p": ([9, 10, 11], kit.greedy(10))})["p"]
    engine.scheduler.eos_token_ids = frozenset({probe[2]})
    params = SamplingParams(temperature=0, max_tokens=10)
    out = kit.run_requests(engine, {"q": ([9, 10, 11], params)})["q"]
    assert out == probe[:probe.index(probe[2]) + 1]


def test_an_engine_keeps_what_start_up_left_alive_out_of_the_garbage_collector(kit, tiny_models):
    """gc.freeze() at the end of start-up: its objects skip the cyclic collector's passes."""
    gc.unfreeze()
    engine = kit.make_engine(tiny_models["deepseek_v3"], 1)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000
    out = kit.run_requests(engine, {"p": ([9, 10, 11], kit.greedy(4))})["p"]
    # Serving neither freezes again (the count would grow) nor unfreezes (it would drop to 0); a frozen
    # object that dies meanwhile (another test's leftover, freed by its last reference) takes 1 off.
    after = gc.get_freeze_count()
    assert len(out) == 4 and frozen - 1_000 < after <= frozen


def test_seeded_sampling_is_reproducible_and_batch_independent(kit, tiny_models):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=10, seed=11)
    for k in (0, 2):
        alone = kit.run_requests(kit.make_engine(tiny_models["deepseek_v3"], k), {"s": ([4, 5, 6], params)})
        crowd = {"s": ([4, 5, 6], params), **{f"o{i}": ([7 + i, 8], SamplingParams(temperature=1.0, max_tokens=8))
                                              for i in range(3)}}
        together = kit.run_requests(kit.make_engine(tiny_models["deepseek_v3"], k), crowd)
        assert together["s"] == alone["s"]
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=10, seed=12)
    again = kit.run_requests(kit.make_engine(tiny_models["deepseek_v3"], 2), {"s": ([4, 5, 6], other_seed)})
    assert again["s"] != alone["s"]


def test_abort_frees_blocks_and_reports_abort(kit, tiny_models):
    engine = kit.make_engine(tiny_models["deepseek_v3"], 2)
    engine.add_request("a", list(range(3, 40)), kit.greedy(30))
    engine.add_request("b", [3, 4, 5], kit.greedy(30))
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.abort_request("unknown")  # ignored
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bad_requests_raise_in_the_callers_thread(kit, tiny_models):
    engine = kit.make_engine(tiny_models["deepseek_v3"], 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [1, 99999], kit.greedy(4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("y", list(range(3, 200)), kit.greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("z", [], kit.greedy(4))
    engine.add_request("dup", [3, 4], kit.greedy(4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [3, 4], kit.greedy(4))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("w", [3, 4], {"temperature": 0})


def test_requests_added_from_other_threads_while_stepping(kit, tiny_models):
    engine = kit.make_engine(tiny_models["glm4_moe"], 1)
    expected = kit.run_requests(kit.make_engine(tiny_models["glm4_moe"], 0),
                                {f"t{i}": ([3 + i, 4, 5], kit.greedy(6)) for i in range(8)})
    threads = [threading.Thread(target=engine.add_request, args=(f"t{i}", [3 + i, 4, 5], kit.greedy(6)))
               for i in range(8)]
    outputs = {}
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert outputs == expected
    assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0


def test_generate_tells_adaptive_depth_when_its_batch_is_closed(tiny_models):
    """LLM.generate: once its last prompt is admitted (nothing waits, nothing will arrive), the policy
    gets every running sequence's tokens left and verifies; before that, and for requests fed to the
    engine directly (the server's way), it gets none."""
    from mtp_runtime import LLM

    llm = LLM(tiny_models["deepseek_v3"], num_speculative_tokens=2, speculative_adaptive=True, max_model_len=96,
              block_size=4, max_seqs_per_batch=2, enable_graph=False)
    engine, calls = llm.engine, []

    def recording(batch_size, draining=None):  # every step verifies one draft, so sequences have a record
        # (the engine hands a function that reads the running sequences' records when called)
        calls.append((len(engine.scheduler.waiting), draining and [(left, list(tried), list(hit), unseen, filler)
                                                                   for left, tried, hit, unseen, filler in draining()]))
        return 1
    engine.policy.choose = recording
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12], [13]], SamplingParams(temperature=0, max_tokens=10,
                                                                                ignore_eos=True))
    assert not engine.closed_batch
    assert all(d is None for waiting, d in calls if waiting)
    closed = [d for waiting, d in calls if not waiting]
    assert closed and all(d is not None and 1 <= len(d) <= 2 for d in closed)
    assert all(0 <= left <= 10 and len(tried) == len(hit) and all(h <= t for h, t in zip(hit, tried))
               for d in closed for left, tried, hit, *_ in d)
    assert any(sum(tried) > 0 for d in closed for _, tried, *_ in d)  # verifies so far are counted
    # every step drafts (k = 1): no key is left out, and a prompt (3 tokens at most) is drafted whole
    assert all(0 <= unseen <= 2 for d in closed for *_, unseen, _ in d)
    # eager: a prompt's first drafts come with it, and every step after drafts: no filler to verify
    assert all(filler == 0 for d in closed for *_, filler in d)
    assert [len(o.token_ids) for o in outs] == [10] * 4
    calls.clear()
    engine.add_request("direct", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert calls and all(d is None for _, d in calls)



def test_a_step_of_prompts_alone_asks_adaptive_depth_at_the_size_of_the_batch_to_come(tiny_models):
    """A step that only prefills decides whether the draft passes over its prompts, for the steps after it,
    whose batch holds every running and waiting sequence: the policy is asked at that size, not at the
    number of prompts (a closed batch of 32 whose first step prefilled 16 was asked at 16, where a drain
    seldom runs, and the draft passed over the prompts at k = 2 or 3 where k = 0 ran the batch)."""
    from mtp_runtime import LLM

    llm = LLM(tiny_models["deepseek_v3"], num_speculative_tokens=2, speculative_adaptive=True, max_model_len=96,
              block_size=4, max_seqs_per_batch=4, max_tokens_per_batch=8, enable_graph=False)
    engine, asked = llm.engine, []
    choose = engine.policy.choose
    engine.policy.choose = lambda size, draining=None: (asked.append(size), choose(size, draining))[1]
    schedule, prompts_alone = engine.scheduler.schedule, []

    def scheduling():  # whether each step's batch is two prompts, nothing decoding
        batch = schedule()
        prompts_alone.append(not any(batch.num_draft_tokens) and len(batch) == 2)
        return batch
    engine.scheduler.schedule = scheduling
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert prompts_alone[0] and asked[0] == 4  # two prompts prefilled (8 tokens), two waiting
    assert [len(o.token_ids) for o in outs] == [6] * 4


def test_an_adaptive_engine_times_the_host_s_time_between_decode_steps(tiny_models):
    """Each decode step's host time, from its start to the next step's less its model call, goes to the
    policy (a caller's work between steps included: a server's delivery); no interval is left open
    after a step that leaves nothing to do, so idle time before the next request is not counted."""
    import time

    from mtp_runtime import LLM

    llm = LLM(tiny_models["deepseek_v3"], num_speculative_tokens=2, speculative_adaptive=True, max_model_len=96,
              block_size=4, max_seqs_per_batch=2, enable_graph=False)
    engine, recorded = llm.engine, []
    record = engine.policy.record_overhead
    engine.policy.record_overhead = lambda k, b, seconds: (recorded.append((k, b, seconds)), record(k, b, seconds))
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
        time.sleep(0.02)  # the caller's work between two steps
    assert engine._open_step is None  # the last step left nothing to do
    assert len(recorded) >= 2 and all(0 <= k <= 2 and b == 1 for k, b, _ in recorded)
    assert all(seconds >= 0.02 for *_, seconds in recorded)
    assert len(recorded) < len(steps)  # not the prefill step's, nor the last one's
    assert engine.policy.overhead(recorded[-1][0], 1) >= 0.02
    time.sleep(0.05)  # idle
    recorded.clear()
    engine.add_request("again", [8, 9], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # a prefill after the idle wait: nothing recorded
    assert recorded == []

def test_the_positions_the_draft_has_not_passed_over_are_a_prompt_to_prefill_and_the_keys_left_out():
    """What a closed batch's policy charges a switch to k > 0 for (engine/spec_policy.py): the prompt
    still to prefill (but its last position, which is drafted from) and the keys that steps at k = 0
    left out."""
    from mtp_runtime.engine.llm_engine import LLMEngine
    from mtp_runtime.engine.sequence import Sequence

    seq = Sequence("r", list(range(10)), SamplingParams(max_tokens=8), 64)
    assert LLMEngine._unseen_positions(seq) == 9
    seq.num_cached_tokens = 6  # a chunk of the prompt is in; its keys were written as it went
    assert LLMEngine._unseen_positions(seq) == 3
    seq.num_cached_tokens = 10
    seq.token_ids.append(42)  # decoding at k > 0: every position seen
    assert LLMEngine._unseen_positions(seq) == 0
    seq.draft_keys_from = 10  # then steps at k = 0 made positions 10 .. 13 final
    seq.num_cached_tokens = 14
    seq.token_ids += [43, 44, 45, 46]
    assert LLMEngine._unseen_positions(seq) == 4


def test_a_sequence_counts_the_verifies_that_reached_each_draft():
    from mtp_runtime.engine.sequence import Sequence

    seq = Sequence("r", [1, 2], SamplingParams(), 64)
    seq.record_verify(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never judged
    seq.record_verify(2, 2)  # both accepted
    seq.record_verify(3, 0)
    assert seq.tried_per_position == [3, 2, 0]
    assert seq.accepted_per_position == [2, 1, 0]


def test_a_closed_batch_s_record_of_a_sequence_counts_its_steps_that_verify_filler():
    """A step that verifies filler gains one token whatever k (engine/spec_policy.py): the drain is told
    of the one to come where a sequence's drafts are filler (after a step at k = 0), or will be (a
    greedy prompt whose first drafts wait for its first one-call decode step); a prompt's own step
    makes its first token, so its tokens left are those of its decode steps."""
    from types import SimpleNamespace

    from mtp_runtime.engine.llm_engine import LLMEngine
    from mtp_runtime.engine.sequence import Sequence

    def record(seq, graph: bool):
        engine = SimpleNamespace(runner=SimpleNamespace(decode_steps={0: None, 2: None} if graph else {}),
                                 _unseen_positions=LLMEngine._unseen_positions)
        return LLMEngine._drain_record(engine, seq)

    seq = Sequence("r", list(range(10)), SamplingParams(temperature=0, max_tokens=8), 64)
    assert record(seq, graph=True) == (7, [], [], 9, 1)  # graph mode: its first drafts wait
    assert record(seq, graph=False)[0::4] == (7, 0)  # eager: they come with its prompt's step
    sampled = Sequence("s", list(range(10)), SamplingParams(temperature=0.8, max_tokens=8), 64)
    assert record(sampled, graph=True)[4] == 0  # (sampled prompts draft beside their prompt)
    seq.num_cached_tokens = 10
    seq.token_ids.append(42)  # decoding, its drafts filler (a step at k = 0)
    assert record(seq, graph=True)[0::4] == (7, 1)
    seq.num_real_drafts = 2  # real drafts from a step at k = 2
    assert record(seq, graph=True)[0::4] == (7, 0)
