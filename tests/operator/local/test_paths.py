"""Pod paths under the model volume's mountPath -> local paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtp_operator.local.paths import LocalPathError, LocalPaths
from mtp_operator.spec import parse_spec


def spec(volume: dict) -> object:
    return parse_spec({
        "model": {"path": "/models/m", "mountPath": "/models", "volume": volume},
        "draftModel": {"path": "/models/m-mtp"},
    })


def test_host_path_is_the_local_root():
    paths = LocalPaths.for_spec(spec({"hostPath": "/srv/models"}), None)
    assert paths.to_local("/models/m") == Path("/srv/models/m")
    assert paths.to_local("/models") == Path("/srv/models")


def test_models_dir_overrides_and_stands_in_for_a_claim(tmp_path):
    paths = LocalPaths.for_spec(spec({"claimName": "weights"}), tmp_path)
    assert paths.to_local("/models/m/sub") == tmp_path / "m" / "sub"


def test_claim_without_models_dir_names_the_field():
    with pytest.raises(LocalPathError, match=r"spec\.model\.volume\.claimName.*--models-dir"):
        LocalPaths.for_spec(spec({"claimName": "weights"}), None)


def test_path_outside_the_volume_is_refused(tmp_path):
    paths = LocalPaths.for_spec(spec({"hostPath": "/srv"}), tmp_path)
    with pytest.raises(LocalPathError, match="not under"):
        paths.to_local("/etc/passwd")
    # A sibling that only shares the prefix is outside too.
    assert not paths.is_pod_path("/models-other/x")


def test_rewrite_argv_both_flag_forms(tmp_path):
    paths = LocalPaths.for_spec(spec({"hostPath": "/srv"}), tmp_path)
    argv = ["mtp", "serve", "--model=/models/m", "--draft_model", "/models/m-mtp", "--port=8000",
            "--note=/modelsX", "/models"]
    assert paths.rewrite_argv(argv) == [
        "mtp", "serve", f"--model={tmp_path}/m", "--draft_model", f"{tmp_path}/m-mtp", "--port=8000",
        "--note=/modelsX", str(tmp_path),
    ]
