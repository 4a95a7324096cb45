"""EngineConfig: every engine setting, validated once, and the KV-cache sizing rule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    model: str
    draft_model: str | None = None  # None: the MTP layer inside `model`'s checkpoint
    num_speculative_tokens: int = 0  # k; 0 = plain decoding
    max_memory_utilization: float = 0.9  # share of FREE device memory (CPU: available RAM) for KV blocks
    max_tokens_per_batch: int = 2048
    max_seqs_per_batch: int = 16
    block_size: int = 16
    enable_prefix_cache: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # explicit block count (tests, tiny budgets); None: sized from memory
    seed: int = 0  # generator for requests without their own seed
    # Decode/verify/draft forwards compiled (torch.compile; start-up compiles them, or loads them from the
    # disk cache). None: graph mode wherever it can run (models/graph.py, resolve_graph); False: eager.
    enable_graph: bool | None = None
    # Graph mode's one-call decode step compiled ahead of time (AOTInductor, engine/aot_step.py: no
    # dynamo on the call path; packages cached on disk). None: wherever it can (DeepSeek-V3 on CPU),
    # else the dynamo-compiled step after a warning; True: required (an error where it cannot);
    # False: the dynamo-compiled step.
    aot_step: bool | None = None
    # Adaptive depth: num_speculative_tokens is the largest k; every step picks k in 0..K (engine/spec_policy.py)
    speculative_adaptive: bool = False
    # A step of fewer tokens than this (a decode step: batch size x (k + 1)) runs on one thread, larger
    # ones on all of the process's torch threads: on a step this small the second thread's fork and
    # join in every kernel cost more than it saves (hack/bench_llama_cpp.py, 2 threads). 0: every step
    # on every thread. In graph mode it applies to the one-call decode steps, compiled for it.
    single_thread_tokens: int = 8

    def __post_init__(self) -> None:
        if not Path(self.model, "config.json").is_file():
            raise ValueError(f"EngineConfig.model={self.model!r}: no config.json there; give a checkpoint directory")
        if self.draft_model is not None and not Path(self.draft_model, "config.json").is_file():
            raise ValueError(f"EngineConfig.draft_model={self.draft_model!r}: no config.json there; give the "
                             f"`mtp export` output directory or leave it unset to use the model's MTP layer")
        _check(_is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 8,
               "num_speculative_tokens", self.num_speculative_tokens, "an integer in 0..8")
        _check(isinstance(self.max_memory_utilization, (int, float)) and 0 < self.max_memory_utilization <= 1,
               "max_memory_utilization", self.max_memory_utilization, "a fraction in (0, 1]")
        _check(_is_int(self.block_size) and self.block_size >= 1, "block_size", self.block_size, "an integer >= 1")
        _check(_is_int(self.max_seqs_per_batch) and self.max_seqs_per_batch >= 1,
               "max_seqs_per_batch", self.max_seqs_per_batch, "an integer >= 1")
        _check(_is_int(self.max_tokens_per_batch) and self.max_tokens_per_batch > self.num_speculative_tokens,
               "max_tokens_per_batch", self.max_tokens_per_batch,
               f"an integer >= num_speculative_tokens + 1 = {self.num_speculative_tokens + 1}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
               "max_model_len", self.max_model_len, "an integer >= 2 or unset")
        _check(self.num_kv_blocks is None or (_is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1),
               "num_kv_blocks", self.num_kv_blocks, "an integer >= 1 or unset")
        _check(_is_int(self.single_thread_tokens) and self.single_thread_tokens >= 0, "single_thread_tokens",
               self.single_thread_tokens, "an integer >= 0 (0: every step on every thread)")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _check(isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda", "npu"),
               "device", self.device, "cpu, cuda[:i] or npu[:i]")
        for name in ("enable_prefix_cache", "enable_chunked_prefill", "speculative_adaptive"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        _check(self.enable_graph is None or isinstance(self.enable_graph, bool), "enable_graph", self.enable_graph,
               "true, false or unset (None: graph mode where it can run)")
        _check(self.aot_step is None or isinstance(self.aot_step, bool), "aot_step", self.aot_step,
               "true, false or unset (None: ahead of time where the step can be)")
        if self.speculative_adaptive and not self.num_speculative_tokens:
            raise ValueError("EngineConfig.speculative_adaptive=True needs num_speculative_tokens >= 1: it is the "
                             "largest k adaptive depth may choose")

    @property
    def speculative(self) -> bool:
        return self.num_speculative_tokens > 0

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        """Blocks one sequence can ever hold: its longest context plus the speculative overhang."""
        return -(-(max_model_len + 2 * self.num_speculative_tokens) // self.block_size)

    def kv_block_count(self, bytes_per_block: int, free_bytes: int, max_model_len: int) -> int:
        """How many blocks to allocate: the explicit count, or max_memory_utilization of the free
        memory (main + draft bytes per block), capped at what max_seqs_per_batch full-length
        sequences can use so a CPU run does not reserve all RAM."""
        per_seq = self.max_blocks_per_seq(max_model_len)
        if self.num_kv_blocks is not None:
            if self.num_kv_blocks < per_seq:
                raise ValueError(f"EngineConfig.num_kv_blocks={self.num_kv_blocks} cannot hold one sequence of "
                                 f"max_model_len={max_model_len} ({per_seq} blocks of {self.block_size}); "
                                 f"raise it or lower max_model_len")
            return self.num_kv_blocks
        fits = int(self.max_memory_utilization * free_bytes) // bytes_per_block
        if fits < per_seq:
            raise ValueError(f"KV cache: {self.max_memory_utilization:.0%} of {free_bytes / 2**30:.2f} GiB free "
                             f"holds {fits} blocks of {bytes_per_block} bytes, one sequence of "
                             f"max_model_len={max_model_len} needs {per_seq}; raise max_memory_utilization "
                             f"or lower max_model_len")
        return min(fits, self.max_seqs_per_batch * per_seq)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name}={value!r} is invalid: expected {expected}")
