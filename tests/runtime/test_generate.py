"""The reference loop and `mtp generate`: speculative output is identical to plain decoding."""

from __future__ import annotations

import json

import pytest

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


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_equals_plain_decoding(trained, k):
    model, draft = trained
    plain = ReferenceSession(model).generate(PROMPT, max_tokens=40)
    spec = ReferenceSession(model, draft).generate(PROMPT, max_tokens=40, num_speculative_tokens=k)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 40
    assert spec.draft_tokens == k * spec.verify_steps
    assert spec.accepted_tokens > 0  # the accept path really ran
    assert spec.accepted_tokens == sum(spec.accepted_per_position)
    assert spec.accepted_per_position == sorted(spec.accepted_per_position, reverse=True)
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
