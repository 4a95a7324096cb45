"""Acceptance is read from the server's Prometheus text, under our names or vLLM's."""

from mtp_runtime.bench.server_metrics import parse_spec_counters


def test_vllm_names_and_absent_counters():
    text = ("# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 10\n'
            "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7\n')
    counters = parse_spec_counters(text)
    assert counters.found and counters.acceptance_rate == 0.7
    assert parse_spec_counters("# TYPE other counter\nother_total 1\n").acceptance_rate is None
