"""Building a missing sample model from the make-tiny annotation (real make-tiny)."""

from __future__ import annotations

import json
import sys

import pytest

from mtp_operator.local.model_prep import MAKE_TINY_ANNOTATION, ModelPrepError, ensure_model, make_tiny_argv


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
    # Present now: nothing to do.
    assert not ensure_model(model, {MAKE_TINY_ANNOTATION: "--arch glm4_moe"}, log=lines.append)


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
