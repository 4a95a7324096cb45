"""Building a missing sample model from the make-tiny annotation (real make-tiny)."""

from __future__ import annotations

import json
import sys

import pytest

from mtp_operator.local.model_prep import (
    MADE_WITH_FILE,
    MAKE_TINY_ANNOTATION,
    ModelPrepError,
    ensure_model,
    make_tiny_argv,
)


def test_makes_a_missing_model_with_the_annotation_arguments(tmp_path):
    model = tmp_path / "models" / "tiny"
    lines, output = [], []
    made = ensure_model(model, {MAKE_TINY_ANNOTATION: "--arch glm4_moe --seed 3 --shards 1"}, log=lines.append,
                        output=output.append)
    assert made
    # make-tiny's own output was passed on as it ran.
    assert any("glm4_moe checkpoint" in line for line in output)
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "glm4_moe"
    assert (model / "model.safetensors.index.json").is_file()
    assert "--arch glm4_moe" in lines[0]
    # No scratch folder left beside it.
    assert [p.name for p in model.parent.iterdir()] == ["tiny"]
    # Present now, made with these arguments: nothing to do.
    assert not ensure_model(model, {MAKE_TINY_ANNOTATION: "--arch glm4_moe --seed 3 --shards 1"}, log=lines.append)


def test_failed_make_tiny_leaves_nothing(tmp_path):
    model = tmp_path / "tiny"
    with pytest.raises(ModelPrepError, match="make-tiny failed") as err:
        ensure_model(model, {MAKE_TINY_ANNOTATION: "--arch no_such_arch"}, log=lambda _: None, output=lambda _: None)
    assert "no_such_arch" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_missing_model_without_annotation_says_what_to_do(tmp_path):
    with pytest.raises(ModelPrepError, match=rf"spec\.model\.path: no model at .*{MAKE_TINY_ANNOTATION}"):
        ensure_model(tmp_path / "absent", {})


def test_a_folder_with_foreign_files_is_not_overwritten(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "notes.txt").write_text("mine")
    with pytest.raises(ModelPrepError, match="exists but has no config.json"):
        ensure_model(model, {MAKE_TINY_ANNOTATION: "--arch deepseek_v3"})
    assert (model / "notes.txt").read_text() == "mine"


def test_annotation_may_not_choose_the_output(tmp_path):
    with pytest.raises(ModelPrepError, match="leave out --out"):
        make_tiny_argv("--arch deepseek_v3 --out /elsewhere", tmp_path)
    with pytest.raises(ModelPrepError, match=MAKE_TINY_ANNOTATION):
        make_tiny_argv("--arch 'unterminated", tmp_path)
    argv = make_tiny_argv("--arch deepseek_v3", tmp_path / "m")
    assert argv[:4] == [sys.executable, "-m", "mtp_runtime", "make-tiny"]
    assert argv[-2:] == ["--out", str(tmp_path / "m")]


def shard_bytes(model):
    return {p.name: p.read_bytes() for p in sorted(model.glob("*.safetensors"))}


SMALL = "--arch deepseek_v3 --num-hidden-layers 1 --shards 1"


def test_a_model_made_with_other_arguments_is_remade(tmp_path):
    model = tmp_path / "models" / "tiny"
    quiet = lambda _: None  # noqa: E731
    assert ensure_model(model, {MAKE_TINY_ANNOTATION: f"{SMALL} --seed 1"}, log=quiet, output=quiet)
    first = shard_bytes(model)
    lines = []
    # The same arguments (spelled differently): the model is what the annotation asks for.
    assert not ensure_model(model, {MAKE_TINY_ANNOTATION: f"  {SMALL}   --seed '1'"}, log=lines.append)
    assert lines == []
    assert ensure_model(model, {MAKE_TINY_ANNOTATION: f"{SMALL} --seed 2"}, log=lines.append, output=quiet)
    assert "was made with make-tiny --arch deepseek_v3 --num-hidden-layers 1 --shards 1 --seed 1" in lines[0]
    assert "now says" in lines[0] and lines[0].endswith("--seed 2: remaking it")
    assert shard_bytes(model) != first  # other weights: really made again
    assert [p.name for p in model.parent.iterdir()] == ["tiny"]  # no scratch or old copy left


def test_a_failed_remake_keeps_the_old_model_and_a_foreign_model_is_left_alone(tmp_path):
    model = tmp_path / "tiny"
    quiet = lambda _: None  # noqa: E731
    ensure_model(model, {MAKE_TINY_ANNOTATION: f"{SMALL} --seed 1"}, log=quiet, output=quiet)
    before = shard_bytes(model)
    with pytest.raises(ModelPrepError, match="make-tiny failed"):
        ensure_model(model, {MAKE_TINY_ANNOTATION: f"{SMALL} --hidden-size -5"}, log=quiet, output=quiet)
    assert shard_bytes(model) == before
    assert not ensure_model(model, {MAKE_TINY_ANNOTATION: f"{SMALL} --seed 1"}, log=quiet)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
    (model / MADE_WITH_FILE).unlink()  # as if the user had put their own checkpoint there
    lines = []
    assert not ensure_model(model, {MAKE_TINY_ANNOTATION: f"{SMALL} --seed 2"}, log=lines.append)
    assert shard_bytes(model) == before
    assert len(lines) == 1 and "mtp up did not make it" in lines[0] and str(model) in lines[0]
