"""End to end through the real kopf operator against kmock (fixtures in conftest.py)."""

from __future__ import annotations

import asyncio

import pytest

from mtp_operator import constants as c

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
CR = f"{c.GROUP}/{c.VERSION}/{c.PLURAL}"


def spec(port: int, **changes) -> dict:
    base = {"model": {"path": "/models/ds", "modelType": "deepseek_v3", "volume": {"claimName": "models"}},
            "export": {"outputPath": "/models/ds-mtp"}, "nnodes": 2, "image": "example.com/mtp/runtime:1",
            "ports": {"http": port, "master": 29500}, "speculative": {"minAcceptanceRate": 0.5}}
    base.update(changes)
    return base


def condition(cr: dict, ctype: str) -> dict:
    return next((x for x in cr.get("status", {}).get("conditions", []) if x["type"] == ctype), {})


async def wait(check, what, timeout=15.0):
    import time
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_export_then_group_then_running_with_acceptance(cluster, runtime):
    await cluster.create_cr("ds", spec(runtime.port))
    jobs = await wait(lambda: cluster.list("batch/v1/jobs"), "the export job")
    job = jobs[0]
    assert job["metadata"]["ownerReferences"][0]["kind"] == "MtpDeployment"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:1] == ["export"]
    await wait(lambda: cluster.cr("ds").get("status", {}).get("phase") == "Exporting", "phase Exporting")
    assert not cluster.list("apps/v1/statefulsets")

    await cluster.finish_job(job["metadata"]["name"], succeeded=True)
    sts = await wait(lambda: cluster.get("apps/v1/statefulsets", "ds"), "the statefulset")
    assert sts["spec"]["replicas"] == 2
    services = {s["metadata"]["name"]: s for s in cluster.list("v1/services")}
    assert services["ds-ranks"]["spec"]["clusterIP"] == "None"
    assert services["ds"]["spec"]["selector"][c.LABEL_POD_INDEX] == "0"
    await wait(lambda: condition(cluster.cr("ds"), "DraftReady").get("status") == "True", "DraftReady")
    await wait(lambda: len(cluster.list("v1/pods")) == 2, "two rank pods")
    assert cluster.cr("ds")["status"]["phase"] == "Starting"

    runtime.advance(draft=100, accepted=80)
    for pod in ("ds-0", "ds-1"):
        await cluster.set_pod(pod, ready=True)
    await wait(lambda: cluster.cr("ds").get("status", {}).get("phase") == "Running", "phase Running")
    status = cluster.cr("ds")["status"]
    assert status["readyNodes"] == 2 and status["nodes"] == "2/2"
    assert status["masterAddress"] == f"ds-0.ds-ranks.{cluster_ns()}.svc:29500"
    assert status["observedGeneration"] == 1
    assert condition(cluster.cr("ds"), "Ready")["status"] == "True"

    runtime.advance(draft=100, accepted=90)
    await wait(lambda: cluster.cr("ds").get("status", {}).get("speculative", {}).get("acceptanceRate"),
               "acceptance in status")
    runtime.advance(draft=200, accepted=50)  # 25% over the next interval: below minAcceptanceRate 0.5
    await wait(lambda: condition(cluster.cr("ds"), "Degraded").get("reason") == "LowAcceptance", "LowAcceptance")
    assert cluster.cr("ds")["status"]["phase"] == "Degraded"
    reasons = {e["reason"] for e in cluster.list("v1/events")}
    assert {"ExportStarted", "PhaseExporting", "PhaseRunning", "PhaseDegraded"} <= reasons


def cluster_ns() -> str:
    return "default"
