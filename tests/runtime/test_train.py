"""Joint main + MTP training for `mtp make-tiny --train-steps`: it learns, it is deterministic, it is cached."""

from __future__ import annotations

import pytest
import torch

from mtp_runtime import train
from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.tokenizer import build_tokenizer
from mtp_runtime.cli import main as mtp_main

SIZES = dict(vocab_size=512, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2)
OPTS = train.TrainOptions(steps=12, seq_len=32, batch=4, lr=3e-3, corpus_bytes=60_000)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_training_lowers_both_losses(cache_dir):
    config = build_config("deepseek_v3", **SIZES)
    model, draft = train.build_for_training(config, seed=0)
    ids = train.corpus_ids(build_tokenizer(512), "train", OPTS.corpus_bytes)
    window = ids[:4 * 34].view(4, 34)
    with torch.no_grad():
        _, main0, mtp0 = train.joint_loss(model, draft, window, 0.3)
    train.train(model, draft, ids, train.TrainOptions(steps=30, seq_len=32, batch=4, corpus_bytes=60_000))
    with torch.no_grad():
        loss, main1, mtp1 = train.joint_loss(model, draft, window, 0.3)
    assert main1 < main0 - 0.5 and mtp1 < mtp0 - 0.5
    assert abs(loss.item() - (main1 + 0.3 * mtp1)) < 1e-4
    # the draft is trained on the token after next: its loss there beats its loss on the next token
    hidden = model.forward_batched(window[:, :32])
    logits = draft.compute_logits(draft.forward_batched(window[:, 1:33], hidden)).detach()
    ce = torch.nn.functional.cross_entropy
    assert ce(logits.flatten(0, 1), window[:, 2:].flatten()) < ce(logits.flatten(0, 1), window[:, 1:33].flatten())


def test_trained_checkpoint_is_deterministic_and_cached(cache_dir, monkeypatch):
    config = build_config("glm4_moe", **SIZES)
    tok = build_tokenizer(512)
    first = train.trained_checkpoint(config, tok, OPTS)
    a = {n: CheckpointIndex(first).read(n) for n in CheckpointIndex(first).names()}
    # a fresh run with the same arguments reproduces every tensor bit for bit
    second_root = cache_dir.parent / "cache2"
    monkeypatch.setenv("MTP_CACHE_DIR", str(second_root))
    second = train.trained_checkpoint(config, build_tokenizer(512), OPTS)
    assert second != first
    b = {n: CheckpointIndex(second).read(n) for n in CheckpointIndex(second).names()}
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # an identical call is served from the cache without training
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("retrained a cached checkpoint"))
    assert train.trained_checkpoint(config, build_tokenizer(512), OPTS) == second
    # other arguments mean another checkpoint
    for change in ({"mtp_loss_weight": 0.5}, {"threads": 2}, {"seed": 1}):
        assert train.cache_key(config, tok, OPTS, 1, False) != train.cache_key(
            config, tok, train.TrainOptions(**{**OPTS.__dict__, **change}), 1, False)


def test_make_tiny_train_options(cache_dir, tmp_path, capsys):
    out = tmp_path / "trained"
    args = ["make-tiny", "--arch", "deepseek_v32", "--out", str(out), "--train-steps", "3", "--train-seq-len", "16",
            "--train-batch", "2", "--mtp-loss-weight", "0.5", "--vocab-size", "512", "--hidden-size", "32",
            "--num-hidden-layers", "2", "--shards", "1"]
    assert mtp_main(args) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    assert mtp_main(args) == 1  # --out is not empty now
    assert "not empty" in capsys.readouterr().err
    assert mtp_main(args + ["--force"]) == 0
    assert mtp_main(["make-tiny", "--arch", "glm4_moe", "--out", str(tmp_path / "x"), "--train-steps", "0",
                     "--train-batch", "0"]) == 0  # 0 steps: an untrained checkpoint, batch unused
    assert mtp_main(["make-tiny", "--arch", "glm4_moe", "--out", str(tmp_path / "y"), "--train-steps", "2",
                     "--train-seq-len", "0"]) == 1
    assert "--train-seq-len must be positive" in capsys.readouterr().err


def test_bench_preset_shape():
    for arch in ("deepseek_v3", "deepseek_v32", "glm4_moe"):
        config = build_config(arch, **train.bench_sizes(arch))
        assert config["num_hidden_layers"] >= 8 and 4096 <= config["vocab_size"] <= 16384
        assert config["n_routed_experts"] > 1 and config["first_k_dense_replace"] < config["num_hidden_layers"]



@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_greedy_continuations_match_the_reference_loop(arch):
    from mtp_runtime.reference_generate import generate

    model, _ = train.build_for_training(build_config(arch, **SIZES), seed=0)
    model.eval()
    ids = train.corpus_ids(build_tokenizer(512), "train", OPTS.corpus_bytes)
    prompts = torch.stack([ids[i * 50:i * 50 + 9] for i in range(3)])
    out = train.greedy_continuations(model, prompts, 7, rows=2, block_size=4)  # 2 batches, 4 blocks a sequence
    assert out.shape == (3, 16) and torch.equal(out[:, :9], prompts)
    for row, prompt in zip(out, prompts):
        assert row[9:].tolist() == generate(model, prompt.tolist(), 7).token_ids


def _agreement(model, draft, data: torch.Tensor, prompt_len: int) -> float:
    """Share of generated positions where the draft's greedy token is the main model's next token."""
    with torch.no_grad():
        span = data.shape[1] - 2
        hidden = model.forward_batched(data[:, :span])
        guess = draft.compute_logits(draft.forward_batched(data[:, 1:span + 1], hidden)).argmax(-1)
    return (guess == data[:, 2:])[:, prompt_len - 1:].float().mean().item()


def test_distillation_trains_the_draft_on_main_continuations_and_leaves_main_alone():
    config = build_config("deepseek_v3", **SIZES)
    model, draft = train.build_for_training(config, seed=0)
    ids = train.corpus_ids(build_tokenizer(512), "train", OPTS.corpus_bytes)
    train.train(model, draft, ids, OPTS)
    opts = train.TrainOptions(**{**OPTS.__dict__, "distill_steps": 40, "distill_prompts": 16,
                                 "distill_prompt_len": 8, "distill_tokens": 24})
    main_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p.requires_grad for p in model.parameters()]
    shared = {id(p) for p in model.parameters()}
    own_before = {n: p.detach().clone() for n, p in draft.named_parameters() if id(p) not in shared}
    held_out = train.greedy_continuations(model, torch.stack([ids[-(i + 1) * 40:][:8] for i in range(8)]), 24)
    before = _agreement(model, draft, held_out, 8)
    losses = train.distill_draft(model, draft, ids, opts)
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])
    assert all(torch.equal(p, main_before[n]) for n, p in model.named_parameters())  # head and embedding too
    assert [p.requires_grad for p in model.parameters()] == trainable  # unfrozen again for whoever trains next
    changed = [n for n, p in draft.named_parameters() if n in own_before and not torch.equal(p, own_before[n])]
    assert "eh_proj.weight" in changed and len(changed) > len(own_before) // 2
    assert _agreement(model, draft, held_out, 8) > before + 0.05


def test_distill_options():
    with pytest.raises(ValueError, match="--distill-steps must be >= 0"):
        train.TrainOptions(steps=1, distill_steps=-1)
    with pytest.raises(ValueError, match="TrainOptions.distill_tokens must be positive"):
        train.TrainOptions(steps=1, distill_tokens=0)
    assert train.BENCH_TRAIN.distill_steps > 0
    config, tok = build_config("deepseek_v3", **SIZES), build_tokenizer(512)
    assert train.cache_key(config, tok, OPTS, 1, False) != train.cache_key(
        config, tok, train.TrainOptions(**{**OPTS.__dict__, "distill_steps": 5}), 1, False)
    with pytest.raises(ValueError, match="--distill-chain must be >= 1"):
        train.TrainOptions(steps=1, distill_chain=0)
    with pytest.raises(ValueError, match="--distill-chain 4 needs more generated tokens .*distill_tokens is 4"):
        train.TrainOptions(steps=1, distill_chain=4, distill_tokens=4)
    # chains: a distillation of the first draft only keeps the key it had before chains existed
    distilled = train.TrainOptions(**{**OPTS.__dict__, "distill_steps": 5})
    fields = {k: v for k, v in train.asdict(distilled).items() if k != "distill_chain"}
    blob = train.json.dumps({"config": config, "tokenizer": train.hashlib.sha256((tok / "tokenizer.json").read_bytes())
                             .hexdigest(), "train": fields, "shards": 1, "fp8": False,
                             "recipe": train.RECIPE_VERSION, "torch": torch.__version__}, sort_keys=True)
    assert train.cache_key(config, tok, distilled, 1, False) == train.hashlib.sha256(blob.encode()).hexdigest()[:20]
    assert train.cache_key(config, tok, distilled, 1, False) != train.cache_key(
        config, tok, train.TrainOptions(**{**distilled.__dict__, "distill_chain": 2}), 1, False)


def test_make_tiny_distill_steps(cache_dir, tmp_path, capsys):
    args = ["make-tiny", "--arch", "glm4_moe", "--out", str(tmp_path / "d"), "--train-steps", "2",
            "--train-seq-len", "16", "--train-batch", "2", "--vocab-size", "512", "--hidden-size", "32",
            "--num-hidden-layers", "2", "--distill-steps", "2"]
    assert mtp_main(args) == 0
    assert "trained 2 steps + 2 MTP distillation steps" in capsys.readouterr().out
    assert mtp_main(args[:-1] + ["-1", "--force"]) == 1
    assert "--distill-steps must be >= 0" in capsys.readouterr().err
    assert mtp_main(args + ["--distill-chain", "2", "--force"]) == 0
    assert "trained 2 steps + 2 MTP distillation steps (drafts 1-2)" in capsys.readouterr().out
    assert mtp_main(args + ["--distill-chain", "0", "--force"]) == 1
    assert "--distill-chain must be >= 1" in capsys.readouterr().err


def test_distilled_checkpoint_reuses_the_joint_run_and_reproduces(cache_dir, monkeypatch):
    config = build_config("deepseek_v3", **SIZES)
    tok = build_tokenizer(512)
    opts = train.TrainOptions(**{**OPTS.__dict__, "distill_steps": 3, "distill_prompts": 4,
                                 "distill_prompt_len": 8, "distill_tokens": 8})
    joint = train.trained_checkpoint(config, tok, OPTS)
    distilled = train.trained_checkpoint(config, tok, opts)
    assert distilled != joint
    a, b = CheckpointIndex(joint), CheckpointIndex(distilled)
    mtp = f"model.layers.{SIZES['num_hidden_layers']}."
    assert all(torch.equal(a.read(n), b.read(n)) for n in a.names() if not n.startswith(mtp))  # main unchanged
    assert not torch.equal(a.read(mtp + "eh_proj.weight"), b.read(mtp + "eh_proj.weight"))
    # another distillation setting starts from the cached joint run: no joint training
    monkeypatch.setattr(train, "_train", lambda *a, **k: pytest.fail("retrained the main model"))
    other = train.trained_checkpoint(config, tok, train.TrainOptions(**{**opts.__dict__, "distill_steps": 4}))
    assert other not in (joint, distilled)
    # a fresh cache (joint run and distillation both from scratch) writes the same tensors
    monkeypatch.undo()
    monkeypatch.setenv("MTP_CACHE_DIR", str(cache_dir.parent / "fresh"))
    c = CheckpointIndex(train.trained_checkpoint(config, tok, opts))
    assert all(torch.equal(b.read(n), c.read(n)) for n in b.names())


def test_chain_mask_layout():
    mask = train.chain_mask(3, 2)
    assert mask.shape == (6, 6)
    # pass 1: causal; pass 2, row t: pass 1's rows up to t and its own row, nothing else
    assert mask[:3, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not mask[:3, 3:].any()
    assert mask[3:, :3].tolist() == mask[:3, :3].tolist()
    assert mask[3:, 3:].tolist() == torch.eye(3, dtype=torch.bool).tolist()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_chained_draft_in_training_matches_the_paged_draft_chain(arch):
    """What distillation trains for drafts 2 and 3 (forward_batched with chain_mask) is what the engine
    runs: the draft's first pass over positions 0..t in its paged cache, then its own output fed back
    at t+1 and t+2, each pass attending to the cache it finds."""
    from mtp_runtime.layers.attention import AttentionMetadata
    from mtp_runtime.reference_generate import allocate_caches

    model, draft = train.build_for_training(build_config(arch, **SIZES), seed=0)
    model.eval(), draft.eval()
    span, depth = 10, 3
    ids = torch.randint(3, 500, (span + depth + 1,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.forward_batched(ids[None, :span])
        inputs, tokens, outs = [hidden], [ids[None, 1:span + 1]], [draft.forward_batched(ids[None, 1:span + 1], hidden)]
        for j in range(2, depth + 1):
            inputs.append(outs[-1])
            tokens.append(ids[None, j:span + j])
            positions = train.chain_positions(span, j)
            outs.append(draft.forward_batched(torch.cat(tokens, 1), torch.cat(inputs, 1), positions,
                                              train.chain_mask(span, j), queries_from=(j - 1) * span))
        for t in (0, 4, span - 1):
            caches = allocate_caches(draft.kv_cache_spec(), span + depth, torch.float32, "cpu")
            h = draft(ids[1:t + 2], hidden[0, :t + 1], torch.arange(t + 1), caches,
                      AttentionMetadata.for_sequence(0, t + 1))[-1:]
            torch.testing.assert_close(h[0], outs[0][0, t], rtol=1e-4, atol=1e-5)
            for j in range(2, depth + 1):
                h = draft(ids[t + j:t + j + 1], h, torch.tensor([t + j - 1]), caches,
                          AttentionMetadata.for_sequence(t + j - 1, 1))
                torch.testing.assert_close(h[0], outs[j - 1][0, t], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch, extra", [("deepseek_v3", {}), ("deepseek_v32", {"index_topk": 6}),
                                         ("glm4_moe", {})])
def test_key_only_rows_give_the_full_forward_of_the_query_rows(arch, extra):
    """forward_batched(queries_from=n): the rows before n only give keys; the other rows' outputs and every
    gradient are those of the full forward whose first n outputs are thrown away."""
    _, draft = train.build_for_training(build_config(arch, **SIZES, **extra), seed=0)
    span, j = 10, 3
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 500, (2, j * span), generator=gen)
    hidden = torch.randn(2, j * span, SIZES["hidden_size"], generator=gen)
    positions, mask = train.chain_positions(span, j), train.chain_mask(span, j)
    results = []
    for queries_from, keep in ((0, slice((j - 1) * span, None)), ((j - 1) * span, slice(None))):
        draft.zero_grad()
        inputs = hidden.clone().requires_grad_(True)
        out = draft.forward_batched(tokens, inputs, positions, mask, queries_from=queries_from)[:, keep]
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        results.append((out.detach(), inputs.grad, grads))
    (full, full_input_grad, full_grads), (part, part_input_grad, part_grads) = results
    assert part.shape == (2, span, SIZES["hidden_size"])
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part_input_grad, full_input_grad, rtol=1e-4, atol=1e-6)
    assert full_grads.keys() == part_grads.keys() and full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(part_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chain_distillation_loss_adds_the_chained_drafts(monkeypatch):
    """With distill_chain 3 a step's loss is the first draft's CE plus CHAIN_LOSS_WEIGHT times the CE of
    drafts 2 and 3, each run as the engine chains them (checked against the paged draft above)."""
    config = build_config("deepseek_v3", **SIZES)
    ids = train.corpus_ids(build_tokenizer(512), "train", OPTS.corpus_bytes)
    model, draft = train.build_for_training(config, seed=0)
    captured = []
    real = train.greedy_continuations
    monkeypatch.setattr(train, "greedy_continuations", lambda *a, **k: captured.append(real(*a, **k)) or captured[0])
    opts = train.TrainOptions(**{**OPTS.__dict__, "batch": 2, "distill_steps": 1, "distill_prompts": 1,
                                 "distill_prompt_len": 8, "distill_tokens": 16, "distill_chain": 3})
    initial = {n: p.detach().clone() for n, p in draft.named_parameters()}
    loss = train.distill_draft(model, draft, ids, opts)[0]
    with torch.no_grad():
        for n, p in draft.named_parameters():
            p.copy_(initial[n])
        window = captured[0].expand(2, -1)  # one continuation: every sampled row is it
        span = window.shape[1] - 4
        hidden = model.forward_batched(window[:, :span])
        inputs, tokens, expected = [hidden], [window[:, 1:span + 1]], 0.0
        out = draft.forward_batched(tokens[0], hidden)
        for j in range(1, 4):
            if j > 1:
                inputs.append(out)
                tokens.append(window[:, j:span + j])
                positions = train.chain_positions(span, j)
                out = draft.forward_batched(torch.cat(tokens, 1), torch.cat(inputs, 1), positions,
                                            train.chain_mask(span, j))[:, (j - 1) * span:]
            logits = draft.compute_logits(out[:, 7:])  # generated rows: from the prompt's last token on
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, j + 8:span + j + 1].flatten())
            expected += ce.item() * (1.0 if j == 1 else train.CHAIN_LOSS_WEIGHT)
    assert loss == pytest.approx(expected, rel=1e-5)
