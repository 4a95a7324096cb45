"""The MTP draft module against a direct re-computation of
h' = eh_proj([enorm(embed(t+1)); hnorm(h)]) -> decoder layer -> shared_head.norm -> shared_head.head,
with the decoder layer taken from transformers and the rest written out here."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mtp_runtime.checkpoint.draft_layout import draft_config, draft_name
from mtp_runtime.layers.attention import AttentionMetadata, RowSelection
from mtp_runtime.models.loader import LoadError, load_draft, load_model

DECODER_LAYERS = {
    "deepseek_v3": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer,
    "deepseek_v32": transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32DecoderLayer,
    "glm4_moe": transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeDecoderLayer,
}
OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_draft(path, ref_model, read_dense_state, fuse_experts):
    """A function (next_ids [n], hidden [n, H]) -> (shared_head.norm output [n, H], draft logits [n, V])
    over positions 0..n-1."""
    config, state = read_dense_state(path)
    L, eps = config["num_hidden_layers"], config["rms_norm_eps"]
    p = f"model.layers.{L}."
    mtp = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
    hf_config = ref_model.config
    if hasattr(hf_config, "mlp_layer_types"):
        hf_config.mlp_layer_types = list(hf_config.mlp_layer_types) + ["sparse"]
    layer = DECODER_LAYERS[ref_model.config.model_type.replace("_mtp", "")](hf_config, L).float().eval()
    fused = fuse_experts({"x." + k: v for k, v in mtp.items() if not k.startswith(OWN)}, config)
    layer.load_state_dict({k[2:]: v for k, v in fused.items()})

    def run(next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = next_ids.shape[0]
        e = rms(mtp["embed_tokens.weight"][next_ids], mtp["enorm.weight"], eps)
        x = torch.cat([e, rms(hidden, mtp["hnorm.weight"], eps)], dim=-1) @ mtp["eh_proj.weight"].T
        positions = torch.arange(n)[None]
        pos_emb = ref_model.model.rotary_emb(x[None], positions)
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_embeddings=pos_emb, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        normed = rms(out[0], mtp["shared_head.norm.weight"], eps)
        return normed, normed @ mtp["shared_head.head.weight"].T

    return run


def new_caches(module, blocks: int = 16, block_size: int = 4):
    return [{k: torch.zeros(blocks, block_size, *s) for k, s in spec.items()} for spec in module.kv_cache_spec()]


def main_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_batched(ids[None])[0]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32", "glm4_moe"])
def test_draft_matches_recomputation_including_reuse(tiny_dirs, reference_model, checkpoint_state, arch):
    path = tiny_dirs[arch]
    model = load_model(path)
    draft = load_draft(path, model)
    reference = reference_draft(path, reference_model(path), *checkpoint_state)
    ids = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(4))
    n = 16  # > index_topk (12) for V3.2
    hidden = main_hidden(model, ids)
    with torch.no_grad():
        caches = new_caches(draft)
        # prefill over positions 0..n-1: inputs t_1..t_n, hiddens h_0..h_{n-1}
        out = draft(ids[1:n + 1], hidden[:n], torch.arange(n), caches, AttentionMetadata.for_sequence(0, n, 4))
        logits = draft.compute_logits(out)
        expected_normed, expected = reference(ids[1:n + 1], hidden[:n])
        assert (logits - expected).abs().max().item() <= 1e-4
        # the hidden the draft hands on (and is fed back on reuse) is the shared_head.norm output
        assert (out - expected_normed).abs().max().item() <= 1e-4
        # reuse for draft position 2: input = its own guess, hidden = its own shared_head.norm output
        guess = logits[-1:].argmax(-1)
        out2 = draft(guess, out[-1:], torch.tensor([n]), caches, AttentionMetadata.for_sequence(n, 1, 4))
        expected_normed2, expected2 = reference(torch.cat([ids[1:n + 1], guess]),
                                                torch.cat([hidden[:n], expected_normed[-1:]]))
        assert (draft.compute_logits(out2) - expected2[-1:]).abs().max().item() <= 1e-4
        assert (out2 - expected_normed2[-1:]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32", "glm4_moe"])
@pytest.mark.parametrize("news", [(18, 6), (3, 2)], ids=["per-sequence", "decode-batch"])
def test_selected_rows_match_the_full_forward_and_cache_every_key(tiny_dirs, arch, news):
    """forward_selected: the chosen rows' outputs as the full forward gives them, and the same cache."""
    model = load_model(tiny_dirs[arch])
    draft = load_draft(tiny_dirs[arch], model)
    block_size, total = 4, sum(news)
    tables = [list(range(5)), list(range(5, 7))]
    slots = [t[p // block_size] * block_size + p % block_size for t, n in zip(tables, news) for p in range(n)]
    meta = lambda: AttentionMetadata([0, news[0], total], list(news), tables, torch.tensor(slots), block_size)  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    ids, hidden = torch.randint(3, 512, (total,), generator=gen), torch.randn(total, model.config.hidden_size, generator=gen)
    positions = torch.tensor([p for n in news for p in range(n)])
    rows = [news[0] - 1, news[0] + 1, total - 1]  # the last row of a chunk, a middle row, a last row
    with torch.no_grad():
        full_caches, caches = new_caches(draft), new_caches(draft)
        full = draft(ids, hidden, positions, full_caches, meta())
        step = meta()
        out = draft.forward_selected(ids, hidden, positions, caches, step, RowSelection.of(step, rows))
    assert out.shape == (len(rows), model.config.hidden_size)
    torch.testing.assert_close(out, full[rows], rtol=1e-5, atol=1e-5)
    for name in full_caches[0]:
        assert torch.equal(caches[0][name], full_caches[0][name]), name


def write_exported(src, dst):
    """The `mtp export` layout of src's MTP layer, written directly with safetensors."""
    from mtp_runtime.checkpoint.index import CheckpointIndex

    index = CheckpointIndex(src)
    tensors = {}
    for name in index.names():
        renamed = draft_name(name, index.config)
        if renamed is not None:
            tensors[renamed] = index.read(name)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    arch = "deepseek_v32" if "index_topk" in index.config else index.config["model_type"]
    (dst / "config.json").write_text(json.dumps(draft_config(index.config, arch, None)))
    return dst


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm4_moe"])
def test_exported_directory_loads_the_same_draft(tiny_dirs, tmp_path, arch):
    model = load_model(tiny_dirs[arch])
    from_main = load_draft(tiny_dirs[arch], model)
    exported = load_draft(write_exported(tiny_dirs[arch], tmp_path / "draft"), model)
    assert exported.config.is_mtp and exported.config.model_type == f"{arch}_mtp"
    ids = torch.randint(3, 512, (14,), generator=torch.Generator().manual_seed(6))
    hidden = main_hidden(model, ids)
    with torch.no_grad():
        a = from_main.compute_logits(from_main.forward_batched(ids[None, 1:], hidden[None, :-1]))
        b = exported.compute_logits(exported.forward_batched(ids[None, 1:], hidden[None, :-1]))
    assert torch.equal(a, b)


def test_missing_shared_head_falls_back_to_main_lm_head(tmp_path, tiny_writer):
    path = tiny_writer(tmp_path / "nohead", "deepseek_v3", drop=("model.layers.3.shared_head.head.weight",))
    with pytest.raises(LoadError, match="shared_head.head"):
        load_draft(path)  # without the main model there is nothing to share
    model = load_model(path)
    draft = load_draft(path, model)
    assert draft.shared_head.head is model.lm_head
    ids = torch.randint(3, 512, (8,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = draft.forward_batched(ids[None, 1:], main_hidden(model, ids)[None, :-1])
        logits = draft.compute_logits(out)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, model.compute_logits(out))


def _copy_main_head_into_mtp_layer(path) -> None:
    """Rewrite the checkpoint so its MTP layer stores copies of the main head and embedding, as the
    published DeepSeek-V3 checkpoints do."""
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {shard: load_file(path / shard) for shard in set(index.values())}
    copies = {"model.layers.3.shared_head.head.weight": "lm_head.weight",
              "model.layers.3.embed_tokens.weight": "model.embed_tokens.weight"}
    for dst, src in copies.items():
        shards[index[dst]][dst] = shards[index[src]][src].clone()
    for shard, tensors in shards.items():
        save_file(tensors, path / shard, metadata={"format": "pt"})


def test_mtp_head_and_embedding_equal_to_the_main_ones_are_shared(tmp_path, tiny_writer):
    distinct = tiny_writer(tmp_path / "distinct", "deepseek_v3")
    model = load_model(distinct)
    draft = load_draft(distinct, model)
    assert draft.shared_head.head is not model.lm_head and draft.embed_tokens is not model.model.embed_tokens

    copied = tiny_writer(tmp_path / "copied", "deepseek_v3")
    _copy_main_head_into_mtp_layer(copied)
    model = load_model(copied)
    draft = load_draft(copied, model)
    assert draft.shared_head.head is model.lm_head and draft.embed_tokens is model.model.embed_tokens
    unshared = load_draft(copied)  # no main model to share with: the draft keeps its own copies
    ids = torch.randint(3, 512, (8,), generator=torch.Generator().manual_seed(9))
    hidden = main_hidden(model, ids)[None, :-1]
    with torch.no_grad():
        a = draft.compute_logits(draft.forward_batched(ids[None, 1:], hidden))
        b = unshared.compute_logits(unshared.forward_batched(ids[None, 1:], hidden))
    assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32", "glm4_moe"])
def test_write_keys_writes_exactly_the_cache_forward_writes(tiny_dirs, arch):
    """The draft's keys-only pass (MtpDraft.write_keys, which for MLA skips the query projections:
    prompt chunks, and the keys adaptive depth's k = 0 steps left out) must put in the cache what a
    full draft forward puts there."""
    path = tiny_dirs[arch]
    model = load_model(path)
    draft = load_draft(path, model)
    ids = torch.randint(3, 512, (14,), generator=torch.Generator().manual_seed(9))
    n = 13
    hidden = main_hidden(model, ids)
    with torch.no_grad():
        full, keys_only = new_caches(draft), new_caches(draft)
        meta = AttentionMetadata.for_sequence(0, n, 4)
        draft(ids[1:n + 1], hidden[:n], torch.arange(n), full, meta)
        draft.write_keys(ids[1:n + 1], hidden[:n], torch.arange(n), keys_only, meta)
    for name in full[0]:
        assert keys_only[0][name].abs().sum() > 0, name
        torch.testing.assert_close(keys_only[0][name], full[0][name], rtol=1e-5, atol=1e-6, msg=name)
