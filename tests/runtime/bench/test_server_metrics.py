"""Acceptance is read from the server's Prometheus text: ours and vLLM's names."""

from types import SimpleNamespace

from mtp_runtime.bench.server_metrics import parse_spec_counters
from mtp_runtime.server.metrics import ServerMetrics


def output(request_id, tokens, draft, accepted, per_position, steps, finished=False):
    return SimpleNamespace(request_id=request_id, prompt_token_ids=[1, 2, 3], token_ids=list(range(tokens)),
                           draft_tokens=draft, accepted_tokens=accepted, accepted_per_position=per_position,
                           verify_steps=steps, finished=finished, ttft_s=0.01, tpot_s=0.002)


def test_deltas_of_our_own_exposition():
    metrics = ServerMetrics(num_speculative_tokens=2)
    before = parse_spec_counters(metrics.render().decode())
    assert before.found and before.draft == 0 and before.per_position == {0: 0.0, 1: 0.0}
    metrics.observe_output(output("a", 3, 4, 3, [2, 1], 2))
    metrics.observe_output(output("a", 6, 8, 5, [4, 1], 4, finished=True))
    delta = parse_spec_counters(metrics.render().decode()).minus(before)
    assert (delta.draft, delta.accepted, delta.steps) == (8, 5, 4)
    assert delta.acceptance_rate == 5 / 8
    assert delta.per_position_rate() == {0: 1.0, 1: 0.25}


def test_vllm_names_and_absent_counters():
    text = ("# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 10\n'
            "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7\n')
    counters = parse_spec_counters(text)
    assert counters.found and counters.acceptance_rate == 0.7
    assert parse_spec_counters("# TYPE other counter\nother_total 1\n").acceptance_rate is None
