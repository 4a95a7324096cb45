import json
import shutil

import pytest
import torch

from mtp_runtime import cli
from mtp_runtime.checkpoint import naming
from mtp_runtime.checkpoint.draft_layout import draft_name
from mtp_runtime.checkpoint.fp8 import dequantize_fp8_blocks
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.safetensors_io import file_sha256
from mtp_runtime.export import EXIT_OUTPUT_CONFLICT, ExportError, export_mtp


def make(root, name, *flags):
    out = root / name
    assert cli.main(["make-tiny", "--out", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {
        "deepseek_v3": make(root, "v3", "--arch", "deepseek_v3", "--shards", "6"),
        "deepseek_v32": make(root, "v32", "--arch", "deepseek_v32"),
        "glm4_moe": make(root, "glm", "--arch", "glm4_moe", "--num-hidden-layers", "2"),
        "fp8": make(root, "fp8", "--arch", "deepseek_v32", "--fp8", "--hidden-size", "160", "--shards", "3"),
    }


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32", "glm4_moe"])
def test_export_layout_and_bitwise_tensors(sources, tmp_path, arch):
    src = CheckpointIndex(sources[arch])
    result = export_mtp(sources[arch], tmp_path / "draft")
    assert result.model_type == f"{arch}_mtp" and not result.skipped
    out = CheckpointIndex(tmp_path / "draft")
    mtp_names = [n for n in src.names() if naming.is_mtp_tensor(n, src.config)]
    assert sorted(out.names()) == sorted(draft_name(n, src.config) for n in mtp_names)
    for name in mtp_names:
        assert torch.equal(out.read(draft_name(name, src.config)).view(torch.uint8), src.read(name).view(torch.uint8))
    assert {"model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "model.enorm.weight", "model.hnorm.weight",
            "model.eh_proj.weight", "model.shared_head.norm.weight", "model.shared_head.head.weight"} <= set(out.names())
    config = out.config
    assert config["model_type"] == f"{arch}_mtp"
    assert (config["num_hidden_layers"], config["first_k_dense_replace"]) == (1, 0)
    assert config["architectures"] == [{"deepseek_v3": "DeepseekMTPForCausalLM", "deepseek_v32": "DeepseekV32MtpForCausalLM",
                                        "glm4_moe": "Glm4MoeMtpForCausalLM"}[arch]]
    index = json.loads((tmp_path / "draft" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(out.info(n).nbytes for n in out.names())
    manifest = json.loads((tmp_path / "draft" / "mtp-export.json").read_text())
    assert manifest["tool_version"] and manifest["source"]["fingerprint"]
    for fname, entry in manifest["files"].items():
        assert file_sha256(tmp_path / "draft" / fname) == entry["sha256"]
    for fname in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "draft" / fname).read_bytes() == (sources[arch] / fname).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["draft"]  # no temp dir left behind


def test_reads_only_mtp_shards_and_tensors(sources, tmp_path):
    src = CheckpointIndex(sources["deepseek_v3"])
    mtp_names = [n for n in src.names() if naming.is_mtp_tensor(n, src.config)]
    mtp_shards = sorted({src.weight_map[n] for n in mtp_names})
    assert len(mtp_shards) < len(src.shard_files())
    result = export_mtp(sources["deepseek_v3"], tmp_path / "draft")
    assert result.shards_opened == mtp_shards
    mtp_bytes = sum(src.info(n).nbytes for n in mtp_names)
    header_bytes = sum((sources["deepseek_v3"] / s).stat().st_size for s in mtp_shards) - sum(
        src.info(n).nbytes for n in src.names() if src.weight_map[n] in mtp_shards)
    assert mtp_bytes <= result.bytes_read <= mtp_bytes + header_bytes


def test_other_shards_and_bytes_are_never_needed(sources, tmp_path):
    # Independent of the read counters: with every shard that holds no MTP
    # tensor deleted, and every byte of the MTP shards outside the MTP tensors
    # (and headers) overwritten, the export still succeeds with the same output.
    src = CheckpointIndex(sources["deepseek_v3"])
    mtp_names = [n for n in src.names() if naming.is_mtp_tensor(n, src.config)]
    mtp_shards = {src.weight_map[n] for n in mtp_names}
    stripped = tmp_path / "stripped"
    shutil.copytree(sources["deepseek_v3"], stripped)
    for shard in set(src.shard_files()) - mtp_shards:
        (stripped / shard).unlink()
    for shard in mtp_shards:
        data = bytearray((stripped / shard).read_bytes())
        for name in src.names():
            info = src.info(name) if src.weight_map[name] == shard else None
            if info is not None and name not in mtp_names:
                data[info.start : info.end] = b"\xff" * info.nbytes
        (stripped / shard).write_bytes(bytes(data))
    export_mtp(sources["deepseek_v3"], tmp_path / "reference")
    export_mtp(stripped, tmp_path / "draft")
    for path in (tmp_path / "reference").glob("*.safetensors"):
        assert (tmp_path / "draft" / path.name).read_bytes() == path.read_bytes()


def test_fp8_dequantised_by_default(sources, tmp_path):
    src = CheckpointIndex(sources["fp8"])
    export_mtp(sources["fp8"], tmp_path / "draft")
    out = CheckpointIndex(tmp_path / "draft")
    assert "quantization_config" not in out.config
    assert not any(n.endswith("_scale_inv") for n in out.names())
    name = "model.layers.3.self_attn.indexer.wq_b.weight"
    assert out.info("model.layers.0.self_attn.indexer.wq_b.weight").dtype == "BF16"
    expected = dequantize_fp8_blocks(src.read(name), src.read(naming.scale_name(name)), torch.bfloat16)
    assert torch.equal(out.read("model.layers.0.self_attn.indexer.wq_b.weight"), expected)


def test_keep_fp8_keeps_scales_and_quantization_config(sources, tmp_path):
    src = CheckpointIndex(sources["fp8"])
    export_mtp(sources["fp8"], tmp_path / "draft", keep_fp8=True)
    out = CheckpointIndex(tmp_path / "draft")
    assert out.config["quantization_config"] == src.config["quantization_config"]
    assert out.info("model.layers.0.mlp.experts.0.up_proj.weight").dtype == "F8_E4M3"
    assert out.info("model.layers.0.mlp.experts.0.up_proj.weight_scale_inv").dtype == "F32"


def test_rerun_is_a_no_op_and_mismatch_needs_force(sources, tmp_path, capsys):
    target = tmp_path / "draft"
    args = ["export", "--input-dir", str(sources["fp8"]), "--output-dir", str(target)]
    assert cli.main(args) == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert cli.main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == stamps
    with pytest.raises(ExportError) as e:
        export_mtp(sources["fp8"], target, keep_fp8=True)
    assert e.value.exit_code == EXIT_OUTPUT_CONFLICT and "--force" in str(e.value)
    assert export_mtp(sources["fp8"], target, keep_fp8=True, force=True).skipped is False
    assert "quantization_config" in CheckpointIndex(target).config
    # a damaged file makes the export stale again
    shard = next(target.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ExportError):
        export_mtp(sources["fp8"], target, keep_fp8=True)


def test_output_sharding(sources, tmp_path):
    result = export_mtp(sources["deepseek_v32"], tmp_path / "draft", max_shard_bytes=100_000)
    shards = sorted(p.name for p in (tmp_path / "draft").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(CheckpointIndex(tmp_path / "draft").weight_map.values()) == set(shards)
    assert result.num_tensors == len(CheckpointIndex(tmp_path / "draft").names())


def test_model_type_override(sources, tmp_path):
    copy = tmp_path / "v32-as-v3"
    shutil.copytree(sources["deepseek_v32"], copy)
    assert export_mtp(copy, tmp_path / "d1").model_type == "deepseek_v32_mtp"
    assert export_mtp(copy, tmp_path / "d2", model_type="deepseek_v3").model_type == "deepseek_v3_mtp"


def test_two_mtp_layers(tmp_path):
    src = make(tmp_path, "glm2", "--arch", "glm4_moe", "--num-nextn-predict-layers", "2", "--num-hidden-layers", "2")
    export_mtp(src, tmp_path / "draft")
    out = CheckpointIndex(tmp_path / "draft")
    assert out.config["num_hidden_layers"] == 2 and out.config["num_nextn_predict_layers"] == 2
    assert "model.enorm.weight" in out.names() and "model.layers.1.enorm.weight" in out.names()
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in out.names()
    assert torch.equal(out.read("model.layers.1.eh_proj.weight"), CheckpointIndex(src).read("model.layers.3.eh_proj.weight"))


def test_remote_code_named_by_auto_map_is_copied(sources, tmp_path):
    # DeepSeek-V3's config.json maps its classes to configuration_deepseek.py and
    # modeling_deepseek.py; the draft keeps the auto_map, so it needs the files.
    src = tmp_path / "src"
    shutil.copytree(sources["deepseek_v3"], src)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    (src / "configuration_deepseek.py").write_text("# configuration\n")
    (src / "modeling_deepseek.py").write_text("# modeling\n")
    (src / "unrelated.py").write_text("# not named by auto_map\n")
    export_mtp(src, tmp_path / "draft")
    draft = tmp_path / "draft"
    assert json.loads((draft / "config.json").read_text())["auto_map"] == config["auto_map"]
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        assert (draft / name).read_bytes() == (src / name).read_bytes()
        assert name in json.loads((draft / "mtp-export.json").read_text())["files"]
    assert not (draft / "unrelated.py").exists()
