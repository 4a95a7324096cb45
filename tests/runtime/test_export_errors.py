"""Every bad input: a one-line error naming the problem, its own exit code, and no output at all."""

import errno
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_runtime import cli, export
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.safetensors_io import ShardWriter


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    out = tmp_path_factory.mktemp("pristine") / "v3"
    assert cli.main(["make-tiny", "--arch", "deepseek_v3", "--out", str(out), "--shards", "3"]) == 0
    return out


@pytest.fixture
def model(pristine, tmp_path):
    dst = tmp_path / "in" / "model"
    shutil.copytree(pristine, dst)
    (tmp_path / "out").mkdir()
    return dst


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def mtp_shard(model):
    index = CheckpointIndex(model)
    return model / index.weight_map["model.layers.3.eh_proj.weight"]


def run_cli(model, capsys, *extra):
    target = model.parent.parent / "out" / "draft"
    code = cli.main(["export", "--input-dir", str(model), "--output-dir", str(target), *extra])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mtp export: error: ")
    assert list((model.parent.parent / "out").iterdir()) == []  # no output, no temp dir
    return code, err


def test_missing_config(model, capsys):
    (model / "config.json").unlink()
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_MISSING_INPUT and "config.json not found" in err


def test_missing_index(model, capsys):
    (model / "model.safetensors.index.json").unlink()
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_MISSING_INPUT and "model.safetensors.index.json" in err


def test_missing_input_dir(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    code, err = run_cli(tmp_path / "nope" / "model", capsys)
    assert code == export.EXIT_MISSING_INPUT and "input directory not found" in err


def test_unknown_model_type(model, capsys):
    edit_json(model / "config.json", model_type="llama")
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_UNKNOWN_MODEL and "'llama'" in err and "--model-type" in err
    with pytest.raises(export.ExportError) as e:
        export.export_mtp(model, model.parent / "x", model_type="qwen")
    assert e.value.exit_code == export.EXIT_UNKNOWN_MODEL


def test_no_mtp_layers(model, capsys):
    edit_json(model / "config.json", num_nextn_predict_layers=0)
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_NO_MTP_LAYERS and "num_nextn_predict_layers is 0" in err


def test_missing_mtp_tensors_are_named(model, capsys):
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.3.eh_proj.weight"]
    del index["weight_map"]["model.layers.3.shared_head.head.weight"]
    index_path.write_text(json.dumps(index))
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_MISSING_TENSORS
    assert "model.layers.3.eh_proj.weight" in err and "model.layers.3.shared_head.head.weight" in err


def test_truncated_shard(model, capsys):
    shard = mtp_shard(model)
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_CORRUPT_INPUT and shard.name in err and "truncated" in err


def test_corrupt_shard_header(model, capsys):
    shard = mtp_shard(model)
    data = bytearray(shard.read_bytes())
    data[8:16] = b"garbage!"
    shard.write_bytes(bytes(data))
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_CORRUPT_INPUT and shard.name in err


def test_missing_mtp_shard_file(model, capsys):
    shard = mtp_shard(model)
    shard.unlink()
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_MISSING_INPUT and shard.name in err and "not found" in err


def test_non_integer_config_size(model, capsys):
    edit_json(model / "config.json", num_hidden_layers="3")
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_CORRUPT_INPUT and "num_hidden_layers is '3'" in err
    edit_json(model / "config.json", num_hidden_layers=3, num_attention_heads="4")
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_CORRUPT_INPUT and "num_attention_heads is '4'" in err


def test_non_integer_header_offsets(model, capsys):
    shard = mtp_shard(model)
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    begin, end = header["model.layers.3.eh_proj.weight"]["data_offsets"]
    header["model.layers.3.eh_proj.weight"]["data_offsets"] = [str(begin), str(end)]
    raw = json.dumps(header).encode()  # data offsets are relative to the header's end
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_CORRUPT_INPUT and "bad header entry" in err and shard.name in err


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fp8_scale_of_the_wrong_shape(tmp_path, capsys, keep_fp8):
    model = tmp_path / "in" / "fp8"
    assert cli.main(["make-tiny", "--arch", "deepseek_v3", "--fp8", "--hidden-size", "160", "--out", str(model)]) == 0
    capsys.readouterr()
    (tmp_path / "out").mkdir()
    name = "model.layers.3.self_attn.q_a_proj.weight_scale_inv"
    shard = model / CheckpointIndex(model).weight_map[name]
    tensors = load_file(shard)
    tensors[name] = torch.ones(1, 1)
    save_file(tensors, shard, metadata={"format": "pt"})
    code, err = run_cli(model, capsys, *(["--keep-fp8"] if keep_fp8 else []))
    assert code == export.EXIT_CORRUPT_INPUT and name in err and "expected [1, 2]" in err


def test_output_with_foreign_content(model, capsys):
    target = model.parent.parent / "out" / "draft"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    for extra in ([], ["--force"]):
        code = cli.main(["export", "--input-dir", str(model), "--output-dir", str(target), *extra])
        assert code == export.EXIT_OUTPUT_CONFLICT
        assert "did not write" in capsys.readouterr().err
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert [p.name for p in target.parent.iterdir()] == ["draft"]


@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_no_space_left(model, capsys, monkeypatch, where):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "shard":
        monkeypatch.setattr(ShardWriter, "_emit", full)
    else:
        real = export._write_json
        monkeypatch.setattr(export, "_write_json", lambda p, d: full() if p.name == "mtp-export.json" else real(p, d))
    code, err = run_cli(model, capsys)
    assert code == export.EXIT_NO_SPACE and "no space left" in err


def test_exit_codes_are_distinct():
    codes = [v for k, v in vars(export).items() if k.startswith("EXIT_") and k != "EXIT_OK"]
    assert len(codes) == len(set(codes)) and 0 not in codes and 1 not in codes and 2 not in codes


def tree_digest(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_force_never_replaces_an_output_that_holds_the_input(model, tmp_path, capsys):
    # The data-loss sequence: export, copy the checkpoint into the export, re-export from the copy
    # into that same export with --force. Before, the copy (the new input) was deleted.
    out = tmp_path / "x" / "out"
    assert cli.main(["export", "--input-dir", str(model), "--output-dir", str(out)]) == 0
    shutil.copytree(model, out / "model")
    before = tree_digest(out)
    capsys.readouterr()
    code = cli.main(["export", "--input-dir", str(out / "model"), "--output-dir", str(out), "--force"])
    err = capsys.readouterr().err
    assert code == export.EXIT_OUTPUT_OVERLAPS_INPUT
    assert err.startswith("mtp export: error: ") and "contains the input directory" in err
    assert str(out) in err and str(out / "model") in err
    assert tree_digest(out) == before  # the input checkpoint and the old export are untouched
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temp dir left beside it


@pytest.mark.parametrize("inside", ["draft", "sub/draft", "."])
def test_output_inside_the_input_is_refused(model, capsys, inside):
    before = tree_digest(model)
    target = model / inside
    code = cli.main(["export", "--input-dir", str(model), "--output-dir", str(target), "--force"])
    err = capsys.readouterr().err
    assert code == export.EXIT_OUTPUT_OVERLAPS_INPUT
    assert ("is the input directory" if inside == "." else "lies inside the input directory") in err
    assert str(model) in err
    assert tree_digest(model) == before and not (model / "sub").exists()


def test_output_reaching_the_input_through_a_symlink_is_refused(model, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(model, target_is_directory=True)
    code = cli.main(["export", "--input-dir", str(model), "--output-dir", str(link / "draft")])
    assert code == export.EXIT_OUTPUT_OVERLAPS_INPUT and "lies inside" in capsys.readouterr().err
    assert not (model / "draft").exists()


def test_output_beside_the_input_still_works(model, capsys):
    # A sibling whose name starts with the input's (model-mtp next to model) is not inside it.
    target = model.parent / f"{model.name}-mtp"
    assert cli.main(["export", "--input-dir", str(model), "--output-dir", str(target)]) == 0
    assert (target / "mtp-export.json").is_file()
