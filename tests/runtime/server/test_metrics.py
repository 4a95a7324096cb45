"""Server metrics: exactly the documented names, moved by what RequestOutputs report."""

from mtp_runtime.bench.server_metrics import parse_spec_counters
from mtp_runtime.engine.llm_engine import RequestOutput
from mtp_runtime.engine.sequence import Sequence, SequenceStatus
from mtp_runtime.sampling_params import SamplingParams
from mtp_runtime.server.metrics import ServerMetrics


def verify_step(seq: Sequence, accepted: int, k: int = 2) -> RequestOutput:
    """What the engine does to a sequence in one verify step, reported as it reports it."""
    seq.record_verify(k, accepted)
    new = [7] * (accepted + 1)
    seq.token_ids += new
    seq.first_token_time = seq.first_token_time or seq.arrival_time + 0.01
    seq.last_token_time = seq.first_token_time + 0.002 * (seq.num_output_tokens - 1)
    return RequestOutput(seq, tokenizer=None, new_token_ids=new, text="")


def test_deltas_of_our_own_exposition():
    metrics = ServerMetrics(num_speculative_tokens=2)
    before = parse_spec_counters(metrics.render().decode())
    assert before.found and before.draft == 0 and before.per_position == {0: 0.0, 1: 0.0}
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=64), max_model_len=128)
    for accepted in (2, 1, 0, 2):
        metrics.observe_output(verify_step(seq, accepted))
    seq.status = SequenceStatus.FINISHED
    metrics.observe_output(RequestOutput(seq, tokenizer=None, new_token_ids=[], text=""))
    text = metrics.render().decode()
    delta = parse_spec_counters(text).minus(before)
    assert (delta.draft, delta.accepted, delta.steps) == (8, 5, 4)
    assert delta.acceptance_rate == 5 / 8
    assert delta.per_position_rate() == {0: 0.75, 1: 0.5}
    assert "mtp_generation_tokens_total 9.0" in text and "mtp_prompt_tokens_total 3.0" in text
    assert "mtp_time_to_first_token_seconds_count 1.0" in text
    assert "mtp_time_per_output_token_seconds_count 1.0" in text
    assert "_created" not in text  # only the documented names


def test_speculative_depth_histograms():
    from mtp_runtime.engine.llm_engine import StepRecord

    metrics = ServerMetrics(num_speculative_tokens=3, speculative_adaptive=True)
    text = metrics.render().decode()
    for k in range(4):  # every k's step-time series shows up from the first scrape
        assert f'mtp_spec_decode_step_seconds_count{{k="{k}"}} 0.0' in text
    for k, seconds in ((3, 0.004), (0, 0.002), (3, 0.005), (1, 0.003)):
        metrics.observe_step(StepRecord(k, seconds, batch_size=2))
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=64), max_model_len=128)
    for accepted in (2, 1):
        metrics.observe_output(verify_step(seq, accepted))
    seq.status = SequenceStatus.FINISHED
    metrics.observe_output(RequestOutput(seq, tokenizer=None, new_token_ids=[], text=""))
    text = metrics.render().decode()
    assert "mtp_spec_decode_num_speculative_tokens_count 4.0" in text
    assert "mtp_spec_decode_num_speculative_tokens_sum 7.0" in text  # mean chosen k = 7 / 4
    assert 'mtp_spec_decode_num_speculative_tokens_bucket{le="0.0"} 1.0' in text
    assert 'mtp_spec_decode_num_speculative_tokens_bucket{le="2.0"} 2.0' in text
    assert 'mtp_spec_decode_step_seconds_count{k="3"} 2.0' in text
    assert 'mtp_spec_decode_step_seconds_sum{k="0"} 0.002' in text
    assert "mtp_spec_decode_request_acceptance_rate_count 1.0" in text
    assert "mtp_spec_decode_request_acceptance_rate_sum 0.75" in text  # 3 of 4 drafts
    assert 'mtp_spec_decode_request_acceptance_rate_bucket{le="0.7"} 0.0' in text
