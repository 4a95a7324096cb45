"""SamplingParams validation."""

import pytest

from mtp_runtime.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(temperature=0, top_k=0, stop="END")
    assert p.greedy and p.top_k == -1 and p.stop == ["END"]
    assert not SamplingParams().greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5),
    ("max_tokens", 0), ("max_tokens", True), ("stop", [""]), ("stop_token_ids", [-1]),
    ("seed", "7"), ("ignore_eos", "yes"),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})
