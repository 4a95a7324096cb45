"""Tiny checkpoints from `mtp make-tiny` for the engine tests, and oracle drafts.

Random tiny models almost never agree with their own random MTP layer, so on
its own the engine would only exercise rejections. `OracleDrafts` replaces a
share of each step's proposals with the tokens greedy decoding really
produces next (known from a k = 0 run), so verify steps accept 0..k drafts
and the bonus-token, rollback and redraft paths all run on real models.
"""

import random

import pytest
import torch

from mtp_runtime.cli import main as mtp_main
from mtp_runtime.engine.config import EngineConfig
from mtp_runtime.engine.llm_engine import LLMEngine
from mtp_runtime.sampling_params import SamplingParams

ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    # Tiny models on a shared 2-core machine: extra threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {}
    for arch in ARCHS:
        out = root / arch
        args = ["make-tiny", "--arch", arch, "--out", str(out), "--vocab-size", "512",
                "--num-hidden-layers", "2", "--shards", "1"]
        # V3.2 with index_topk far below the contexts, so sparse selection decides what each query sees.
        extra = ["--index-topk", "8"] if arch == "deepseek_v32" else []
        assert mtp_main(args + extra) == 0
        dirs[arch] = str(out)
    return dirs


def _make_engine(model_dir, k, **options):
    settings = dict(max_model_len=96, block_size=4, max_seqs_per_batch=8, max_tokens_per_batch=64)
    settings.update(options)
    return LLMEngine(EngineConfig(model=model_dir, num_speculative_tokens=k, **settings))


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class OracleDrafts:
    """Wraps engine.runner.execute: after each real step, each proposal is replaced by the true
    next greedy token with probability `hit_rate` (else kept: almost surely wrong)."""

    def __init__(self, engine, reference: dict[str, list[int]], hit_rate: float = 0.7, seed: int = 0,
                 check=None):
        self.engine, self.reference, self.hit_rate = engine, reference, hit_rate
        self.rng = random.Random(seed)
        self.check = check  # called with the batch after the real step, before drafts are replaced
        self._execute = engine.runner.execute
        engine.runner.execute = self

    def __call__(self, batch):
        new_tokens, accepted = self._execute(batch)
        if self.check is not None:
            self.check(batch, new_tokens)
        for seq, tokens in zip(batch.seqs, new_tokens):
            if not tokens or not seq.draft_token_ids or seq.request_id not in self.reference:
                continue  # (requests without a known greedy continuation keep their real drafts)
            done = len(seq) + len(tokens) - seq.num_prompt_tokens  # outputs after this step
            truth = self.reference[seq.request_id][done:]
            seq.draft_token_ids = [truth[j] if j < len(truth) and self.rng.random() < self.hit_rate else d
                                   for j, d in enumerate(seq.draft_token_ids)]
        return new_tokens, accepted


def _run_requests(engine, requests, arrivals=None):
    """requests: {id: (prompt_ids, params)}; arrivals: {step: [ids]} (default: all at step 0).
    Returns {id: output token ids}."""
    arrivals = arrivals or {0: list(requests)}
    outputs, step = {}, 0
    last_arrival = max(arrivals)
    while step <= last_arrival or engine.has_unfinished_requests():
        for rid in arrivals.get(step, []):
            engine.add_request(rid, *requests[rid])
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        step += 1
        assert step < 2000, "engine did not finish"
    return outputs


class EngineKit:
    """The functions above, handed to tests as one fixture (test modules cannot import conftest)."""

    make_engine = staticmethod(_make_engine)
    greedy = staticmethod(_greedy)
    run_requests = staticmethod(_run_requests)
    OracleDrafts = OracleDrafts


@pytest.fixture(scope="session")
def kit():
    return EngineKit
