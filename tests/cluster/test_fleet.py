"""Fleets on the real control plane: kubectl scale and the HPA through the scale subresource, per-group
gang restarts, garbage collection of every group, and rollouts judged on fake rank-0 figures."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mtp_operator import constants as c

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fleet_spec(port: int, replicas: int, **changes) -> dict:
    spec = {"model": {"path": "/models/ds", "modelType": "deepseek_v3", "volume": {"claimName": "models"}},
            "draftModel": {"path": "/models/ds-mtp"}, "nnodes": 2, "replicas": replicas,
            "image": "registry.example/mtp/runtime:1", "ports": {"http": port, "master": 29500}}
    spec.update(changes)
    return spec


def kubectl(plane, *args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    return subprocess.run([binary, f"--kubeconfig={plane.kubeconfig}", *args], capture_output=True, text=True,
                          timeout=60)


def statefulsets(kube, namespace: str) -> dict[str, dict]:
    items = kube.items(f"/apis/apps/v1/namespaces/{namespace}/statefulsets", f"{c.LABEL_DEPLOYMENT}=ds")
    return {s["metadata"]["name"]: s for s in items if not s["metadata"].get("deletionTimestamp")}


def group_pods(kube, namespace: str, group: int) -> dict[str, str]:
    pods = kube.items(f"/api/v1/namespaces/{namespace}/pods", f"{c.LABEL_DEPLOYMENT}=ds,{c.LABEL_GROUP}={group}")
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}


def fleet_ready(kube, namespace: str, replicas: int, nnodes: int = 2):
    cr = kube.cr(namespace, "ds")
    status = cr.get("status", {})
    ok = (status.get("readyReplicas") == replicas and status.get("replicas") == replicas
          and status.get("readyNodes") == replicas * nnodes
          and status.get("observedGeneration") == cr["metadata"]["generation"]
          and len(statefulsets(kube, namespace)) == replicas)
    return cr if ok else None


def wait_fleet(kube, namespace, replicas, nnodes=2, timeout=90, what=""):
    try:
        return kube.eventually(lambda: fleet_ready(kube, namespace, replicas, nnodes), timeout,
                               what or f"{replicas} ready groups")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status: {kube.cr(namespace, 'ds').get('status')}") from None


def test_kubectl_scale_hpa_gang_isolation_and_deletion(control_plane, kube, namespace, run_operator, rank_servers):
    port = free_port()
    rank_servers(port)
    run_operator(namespace)
    code, answer = kube.create_cr(namespace, "ds", fleet_spec(port, 1))
    assert code in (200, 201), answer
    wait_fleet(kube, namespace, 1)

    for replicas in (3, 0, 2):
        done = kubectl(control_plane, "scale", "mtpd/ds", f"--replicas={replicas}", "-n", namespace)
        assert done.returncode == 0, done.stderr
        if replicas:
            cr = wait_fleet(kube, namespace, replicas, what=f"kubectl scale to {replicas}")
            assert sorted(statefulsets(kube, namespace)) == sorted(
                ["ds"] + [f"ds-g{g}" for g in range(1, replicas)])
            assert [g["index"] for g in cr["status"]["groups"]] == list(range(replicas))
            masters = {s["metadata"]["name"]: s["spec"]["template"]["spec"]["containers"][0]["args"]
                       for s in statefulsets(kube, namespace).values()}
            assert all(any(f"{name}-0.ds-ranks." in a for a in args) for name, args in masters.items()), \
                "each group has its own master"
        else:
            cr = kube.eventually(lambda: (lambda r: r if r.get("status", {}).get("replicas") == 0
                                          and not statefulsets(kube, namespace) else None)(kube.cr(namespace, "ds")),
                                 60, "scale to zero")
            assert cr["status"]["phase"] == "Pending" and kube.get(f"/api/v1/namespaces/{namespace}/services/ds")
    scale = kube.get(kube.cr_path(namespace, "ds") + "/scale")
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == f"app.kubernetes.io/managed-by=mtp-operator,{c.LABEL_DEPLOYMENT}=ds," \
        f"{c.LABEL_COMPONENT}=server,{c.LABEL_POD_INDEX}=0"

    # The HPA sample: accepted by the API server, and the HPA controller reads our scale subresource.
    hpa = yaml.safe_load((REPO / "crds" / "samples" / "autoscaling" / "hpa.yaml").read_text())
    hpa["spec"]["scaleTargetRef"]["name"] = "ds"
    kube.call("POST", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers", hpa)

    def able_to_scale():
        found = kube.get(f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/tiny-cpu") or {}
        conditions = {x["type"]: x for x in (found.get("status") or {}).get("conditions") or []}
        return conditions.get("AbleToScale", {}).get("status") == "True" and conditions["AbleToScale"]

    assert kube.eventually(able_to_scale, 60, "the HPA controller to read the scale subresource")["reason"] \
        == "SucceededGetScale"
    kube.call("DELETE", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/tiny-cpu")

    # A rank of group 1 is lost: group 1 restarts as a whole, groups 0 and 2 are untouched.
    kubectl(control_plane, "scale", "mtpd/ds", "--replicas=3", "-n", namespace)
    cr = wait_fleet(kube, namespace, 3)
    before = {g: group_pods(kube, namespace, g) for g in range(3)}
    kube.call("DELETE", f"/api/v1/namespaces/{namespace}/pods/ds-g1-1?gracePeriodSeconds=0")
    cr = kube.eventually(lambda: (lambda r: r if [g["restarts"] for g in r.get("status", {}).get("groups", [])]
                                  == [0, 1, 0] else None)(kube.cr(namespace, "ds")), 60, "one restart of group 1")
    wait_fleet(kube, namespace, 3)
    after = {g: group_pods(kube, namespace, g) for g in range(3)}
    assert after[0] == before[0] and after[2] == before[2], "another group was touched"
    assert not set(after[1].values()) & set(before[1].values()), "group 1 restarted as a whole"

    # Deleting the MtpDeployment removes every group (the garbage collector).
    kube.call("DELETE", kube.cr_path(namespace, "ds"))
    def left() -> list[str]:
        pods = kube.items(f"/api/v1/namespaces/{namespace}/pods", f"{c.LABEL_DEPLOYMENT}=ds")
        return sorted(statefulsets(kube, namespace)) + [p["metadata"]["name"] for p in pods]

    try:
        kube.eventually(lambda: not left() or None, 120, "every group gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still there: {left()}") from None


ACCEPTANCE_BY_IMAGE = {"registry.example/mtp/runtime:1": 0.85, "registry.example/mtp/runtime:bad-draft": 0.30,
                       "registry.example/mtp/runtime:2": 0.84}


def by_image(pod: dict) -> dict:
    """Fake rank 0 figures by the image the pod runs: the revision's acceptance."""
    image = pod["spec"]["containers"][0]["image"]
    return {"per_scrape": 200, "acceptance": ACCEPTANCE_BY_IMAGE[image], "tpot": 0.01}


def images(kube, namespace) -> dict[int, str]:
    return {int(s["metadata"]["labels"][c.LABEL_GROUP]): s["spec"]["template"]["spec"]["containers"][0]["image"]
            for s in statefulsets(kube, namespace).values()}


def test_rollout_rolls_back_a_bad_canary_and_rolls_a_good_one_to_every_group(kube, namespace, run_operator,
                                                                             rank_servers):
    port = free_port()
    rank_servers(port, profile=by_image)
    run_operator(namespace)
    rollout = {"maxUnavailable": 1, "canary": {"groups": 1, "analysisSeconds": 2, "minDraftTokens": 200,
                                               "minAcceptanceRatio": 0.9, "maxTpotRatio": 1.2}}
    code, answer = kube.create_cr(namespace, "ds", fleet_spec(port, 4, rollout=rollout))
    assert code in (200, 201), answer
    wait_fleet(kube, namespace, 4)
    first = kube.cr(namespace, "ds")["status"]["currentRevision"]

    # A draft that no longer matches: its canary accepts 0.30 against the old groups' 0.85.
    kube.merge_patch(kube.cr_path(namespace, "ds"), {"spec": {"image": "registry.example/mtp/runtime:bad-draft"}})
    try:
        cr = kube.eventually(lambda: (lambda r: r if kube.condition(r, c.CONDITION_PROGRESSING).get("reason")
                                      == "CanaryFailed" else None)(kube.cr(namespace, "ds")), 90, "CanaryFailed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status: {kube.cr(namespace, 'ds').get('status')}") from None
    message = kube.condition(cr, c.CONDITION_PROGRESSING)["message"]
    assert "acceptance 0.300" in message and "acceptance 0.850" in message, message
    assert cr["status"]["currentRevision"] == first and cr["status"]["rollout"]["phase"] == "Failed"
    wait_fleet(kube, namespace, 4, what="the old revision serving every group again")
    assert set(images(kube, namespace).values()) == {"registry.example/mtp/runtime:1"}
    warnings = [e for e in kube.items(f"/api/v1/namespaces/{namespace}/events")
                if e["reason"] == "CanaryFailed" and e["type"] == "Warning"]
    assert len(warnings) == 1 and "0.300" in warnings[0]["message"]
    time.sleep(2)  # nothing more is rolled until the spec changes again
    assert set(images(kube, namespace).values()) == {"registry.example/mtp/runtime:1"}

    # A good one: 0.84 against 0.85 passes, and every group follows, one at a time.
    started = time.monotonic()
    kube.merge_patch(kube.cr_path(namespace, "ds"), {"spec": {"image": "registry.example/mtp/runtime:2"}})
    cr = kube.eventually(lambda: (lambda r: r if r and r["status"]["currentRevision"] not in (first,)
                                  and r["status"].get("updatedReplicas") == 4 else None)(
        fleet_ready(kube, namespace, 4)), 180, "the new revision on every group")
    rolled = time.monotonic() - started
    print(f"\nspec change -> 4 groups rolled (canary analysis {rollout['canary']['analysisSeconds']}s): {rolled:.1f}s")
    assert set(images(kube, namespace).values()) == {"registry.example/mtp/runtime:2"}
    assert "passed" in cr["status"]["rollout"]["lastResult"]
    revisions = kube.items(f"/apis/apps/v1/namespaces/{namespace}/controllerrevisions", c.LABEL_REVISION_HASH)
    assert len(revisions) == 3 and all(r["metadata"]["ownerReferences"][0]["kind"] == c.KIND for r in revisions)
