"""ParallelState from the group, and model sizes that must divide by it."""

import pytest

from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.config import ModelConfig
from mtp_runtime.multinode.parallel_setup import ParallelConfigError, build_parallel_state, check_model_fits


def test_every_rank_is_tensor_parallel_and_ep_splits_experts():
    tp = build_parallel_state(rank=1, world_size=4)
    assert (tp.tp_rank, tp.tp_size, tp.ep_rank, tp.ep_size) == (1, 4, 0, 1)
    ep = build_parallel_state(rank=3, world_size=4, ep_size=4)
    assert (ep.tp_rank, ep.ep_rank, ep.ep_size) == (3, 3, 4)
    assert list(ep.local_experts(8)) == [6, 7]


def test_unsupported_layouts_are_rejected_naming_the_flag():
    with pytest.raises(ParallelConfigError, match="--dp_size 2: attention data parallelism is not implemented"):
        build_parallel_state(0, 4, dp_size=2)
    with pytest.raises(ParallelConfigError, match="--ep_size 2: must be 1 .* or 4"):
        build_parallel_state(0, 4, ep_size=2)


def test_sizes_that_do_not_divide_name_the_config_field():
    glm = ModelConfig.from_dict(build_config("glm4_moe"))  # 2 kv heads
    check_model_fits(glm, build_parallel_state(0, 2))
    with pytest.raises(ParallelConfigError, match="num_key_value_heads = 2 is not divisible by the 4"):
        check_model_fits(glm, build_parallel_state(0, 4))
    dsv3 = ModelConfig.from_dict(build_config("deepseek_v3", num_attention_heads=6, num_key_value_heads=6))
    with pytest.raises(ParallelConfigError, match="num_attention_heads = 6"):
        check_model_fits(dsv3, build_parallel_state(0, 4))
    experts = ModelConfig.from_dict(build_config("deepseek_v3"))
    check_model_fits(experts, build_parallel_state(0, 4, ep_size=4))
    twelve = ModelConfig.from_dict(build_config("deepseek_v3", n_routed_experts=12, num_attention_heads=8,
                                                num_key_value_heads=8))
    with pytest.raises(ParallelConfigError, match="n_routed_experts = 12 is not divisible by --ep_size 8"):
        check_model_fits(twelve, build_parallel_state(0, 8, ep_size=8))
