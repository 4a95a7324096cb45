"""The reference loop and `mtp generate`: speculative output is identical to plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mtp_runtime.cli import main as mtp_main
from mtp_runtime.reference_session import ReferenceSession

PROMPT = "def main(args):\n    parser = argparse.ArgumentParser()\n    "


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A briefly trained tiny V3.2 checkpoint (draft and main agree often) and its exported draft."""
    root = tmp_path_factory.mktemp("gen")
    mp = pytest.MonkeyPatch()
    mp.setenv("MTP_CACHE_DIR", str(root / "cache"))
    try:
        model = root / "model"
        assert mtp_main(["make-tiny", "--arch", "deepseek_v32", "--out", str(model), "--vocab-size", "512",
                         "--hidden-size", "64", "--num-hidden-layers", "2", "--index-topk", "16",
                         "--train-steps", "150", "--train-seq-len", "64", "--train-batch", "8"]) == 0
        draft = root / "draft"
        assert mtp_main(["export", "--input-dir", str(model), "--output-dir", str(draft)]) == 0
    finally:
        mp.undo()
    return model, draft


def check_counters(result, k):
    assert result.draft_tokens == k * result.verify_steps
    assert result.accepted_tokens == sum(result.accepted_per_position)
    assert result.accepted_per_position == sorted(result.accepted_per_position, reverse=True)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_equals_plain_decoding(trained, k):
    # How many drafts the trained MTP layer gets right depends on its training corpus (the
    # standard library of the running Python), so this test asserts only what holds for any
    # weights; the accept paths are forced below with drafts that are right by construction.
    model, draft = trained
    plain = ReferenceSession(model).generate(PROMPT, max_tokens=40)
    spec = ReferenceSession(model, draft).generate(PROMPT, max_tokens=40, num_speculative_tokens=k)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 40
    check_counters(spec, k)


class KnownAnswerDraft(nn.Module):
    """A draft with the draft interface that proposes the true greedy token after next, except at
    every fifth position (a wrong token there), so verify steps accept some, all and none."""

    def __init__(self, true_ids: list[int], vocab_size: int):
        super().__init__()
        self.true_ids, self.vocab_size = true_ids, vocab_size
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(1))  # the runner reads the cache dtype from a norm

    def kv_cache_spec(self):
        return []

    def forward(self, input_ids, hidden, positions, caches, meta):
        return positions.float()[:, None]  # "hidden_out": the position it was computed at

    def compute_logits(self, hidden_out):
        logits = torch.zeros(hidden_out.shape[0], self.vocab_size)
        for row, position in enumerate(hidden_out[:, 0].long().tolist()):
            target = position + 2  # the draft at position p proposes the token at p + 2
            token = self.true_ids[target] if target < len(self.true_ids) and position % 5 else 0
            logits[row, token] = 1.0
        return logits


@pytest.mark.parametrize("k", [1, 3])
def test_accepted_drafts_keep_the_output_of_plain_decoding(trained, k):
    model, _ = trained
    session = ReferenceSession(model)
    prompt_ids = session.encode(PROMPT)
    plain = session.generate(prompt_ids, max_tokens=40)
    session.draft = KnownAnswerDraft(prompt_ids + plain.token_ids, session.model.config.vocab_size)
    spec = session.generate(prompt_ids, max_tokens=40, num_speculative_tokens=k)
    assert spec.token_ids == plain.token_ids
    check_counters(spec, k)
    assert 0 < spec.accepted_tokens < spec.draft_tokens  # accept and reject paths both ran
    assert spec.accepted_per_position[k - 1] > 0  # some step accepted all k drafts (bonus token)
    assert spec.verify_steps < 40  # fewer main-model steps than tokens


def test_draft_from_main_checkpoint_and_bfloat16(trained):
    model, draft = trained
    a = ReferenceSession(model, model).generate(PROMPT, max_tokens=12, num_speculative_tokens=2)
    b = ReferenceSession(model, draft).generate(PROMPT, max_tokens=12, num_speculative_tokens=2)
    assert a.token_ids == b.token_ids and a.accepted_per_position == b.accepted_per_position
    low = ReferenceSession(model, draft, dtype="bfloat16").generate(PROMPT, max_tokens=12, num_speculative_tokens=2)
    assert len(low.token_ids) == 12


def test_generate_command_json(trained, capsys):
    model, draft = trained
    assert mtp_main(["generate", "--model", str(model), "--draft_model", str(draft), "--num_speculative_tokens=2",
                     "--max_tokens", "16", "--json", "--prompt", PROMPT]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"text", "token_ids", "draft_tokens", "accepted_tokens", "accepted_per_position"}
    assert len(out["token_ids"]) == 16 and len(out["accepted_per_position"]) == 2
    assert mtp_main(["generate", "--model", str(model), "--max_tokens", "16", "--prompt", PROMPT]) == 0
    assert capsys.readouterr().out.rstrip("\n") == out["text"]


def test_max_tokens_and_eos_stop(trained):
    model, draft = trained
    session = ReferenceSession(model, draft)
    assert session.generate(PROMPT, max_tokens=0, num_speculative_tokens=2).token_ids == []
    ids = session.generate(PROMPT, max_tokens=7, num_speculative_tokens=3).token_ids
    assert len(ids) == 7  # accepted drafts past the limit are dropped
    session.eos_ids = (ids[2],)
    stopped = session.generate(PROMPT, max_tokens=7, num_speculative_tokens=3)
    assert stopped.token_ids == ids[:ids.index(ids[2]) + 1] and stopped.finish_reason == "stop"


def test_sampling_is_seeded(trained):
    model, draft = trained
    session = ReferenceSession(model, draft)
    a = session.generate(PROMPT, max_tokens=10, num_speculative_tokens=2, temperature=0.8, seed=3)
    b = session.generate(PROMPT, max_tokens=10, num_speculative_tokens=2, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids


def test_bad_arguments(trained, capsys):
    model, _ = trained
    assert mtp_main(["generate", "--model", str(model), "--num_speculative_tokens", "2", "--prompt", "x"]) == 2
    assert "--draft_model" in capsys.readouterr().err
    assert mtp_main(["generate", "--model", str(model / "nope"), "--prompt", "x"]) == 1
    assert "config.json" in capsys.readouterr().err
