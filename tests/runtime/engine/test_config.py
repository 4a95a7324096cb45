"""EngineConfig validation and KV-cache sizing."""

import pytest

from mtp_runtime.engine.config import EngineConfig


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("num_speculative_tokens", -1), ("max_memory_utilization", 0.0), ("max_memory_utilization", 1.5),
    ("block_size", 0), ("max_seqs_per_batch", 0), ("max_tokens_per_batch", 2), ("max_model_len", 1),
    ("num_kv_blocks", 0), ("dtype", "int8"), ("device", "tpu"), ("enable_prefix_cache", "yes"),
    ("single_thread_tokens", -1), ("single_thread_tokens", True),
])
def test_bad_settings_name_the_field(model_dir, field, value):
    options = {"num_speculative_tokens": 2, field: value}
    with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
        EngineConfig(model=model_dir, **options)


def test_missing_model_directories_are_named(model_dir, tmp_path):
    with pytest.raises(ValueError, match="EngineConfig.model=.*no config.json"):
        EngineConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="EngineConfig.draft_model="):
        EngineConfig(model=model_dir, draft_model=str(tmp_path / "nope"))


def test_blocks_from_memory_are_capped_by_what_sequences_can_use(model_dir):
    cfg = EngineConfig(model=model_dir, block_size=16, max_seqs_per_batch=4, num_speculative_tokens=2,
                       max_memory_utilization=0.5)
    per_seq = -(-(1000 + 4) // 16)
    assert cfg.max_blocks_per_seq(1000) == per_seq
    # Plenty of memory: the cap (4 sequences of max_model_len) wins.
    assert cfg.kv_block_count(1024, 10 * 2**30, 1000) == 4 * per_seq
    # Little memory: half of it, in whole blocks.
    assert cfg.kv_block_count(1024, 200 * 1024, 1000) == 100
    with pytest.raises(ValueError, match="raise max_memory_utilization or lower max_model_len"):
        cfg.kv_block_count(1024, 50 * 1024, 1000)


def test_explicit_block_count_must_hold_one_sequence(model_dir):
    cfg = EngineConfig(model=model_dir, block_size=16, num_kv_blocks=10)
    assert cfg.kv_block_count(1024, 0, 100) == 10
    with pytest.raises(ValueError, match="num_kv_blocks=10 cannot hold one sequence"):
        cfg.kv_block_count(1024, 0, 1000)
