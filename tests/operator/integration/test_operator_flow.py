"""End to end through the real kopf operator against kmock (fixtures in conftest.py)."""

from __future__ import annotations

import asyncio
import time

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


def group_gang(cr: dict, group: int = 0) -> dict:
    """A group's whole-group-restart record (status.groups[].gang)."""
    groups = cr.get("status", {}).get("groups", [])
    return next((g.get("gang") or {} for g in groups if g["index"] == group), {})


def condition(cr: dict, ctype: str) -> dict:
    return next((x for x in cr.get("status", {}).get("conditions", []) if x["type"] == ctype), {})


async def wait(check, what, timeout=15.0):
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


async def test_export_failure_reports_message_and_creates_no_statefulset(cluster, runtime):
    await cluster.create_cr("bad", spec(runtime.port))
    job = (await wait(lambda: cluster.list("batch/v1/jobs"), "the export job"))[0]
    await cluster.finish_job(job["metadata"]["name"], succeeded=False,
                             message="mtp export: model.layers.61.eh_proj.weight missing in the index")
    await wait(lambda: cluster.cr("bad").get("status", {}).get("phase") == "Failed", "phase Failed")
    draft = condition(cluster.cr("bad"), "DraftReady")
    assert draft["status"] == "False" and draft["reason"] == "ExportFailed"
    assert "eh_proj.weight missing" in draft["message"]
    await asyncio.sleep(0.6)  # a few more reconciles: still no group
    assert not cluster.list("apps/v1/statefulsets")
    warnings = [e for e in cluster.list("v1/events") if e["reason"] == "PhaseFailed"]
    assert warnings and warnings[0]["type"] == "Warning"


async def _running_group(cluster, runtime, name="ds", **changes):
    await cluster.create_cr(name, spec(runtime.port, export=None, draftModel={"path": "/models/ds-mtp"}, **changes))
    await wait(lambda: len(cluster.list("v1/pods")) == cluster.cr(name)["spec"]["nnodes"], "rank pods")
    for pod in cluster.list("v1/pods"):
        await cluster.set_pod(pod["metadata"]["name"], ready=True)
    await wait(lambda: cluster.cr(name).get("status", {}).get("phase") == "Running", "phase Running")
    assert not cluster.list("batch/v1/jobs")  # draftModel given: nothing to export


async def test_gang_restart_when_one_rank_restarts(cluster, runtime):
    await _running_group(cluster, runtime)
    await wait(lambda: group_gang(cluster.cr("ds")).get("members"), "gang baseline")
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.list("v1/pods")}
    await cluster.set_pod("ds-1", ready=False, restarts=1)  # rank 1's container restarted alone
    await wait(lambda: group_gang(cluster.cr("ds")).get("restarts") == 1, "a gang restart")
    assert cluster.requests("DELETE", "/pods") and not cluster.requests("DELETE", "/pods/")
    after = await wait(lambda: len(cluster.list("v1/pods")) == 2 and
                       {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.list("v1/pods")}, "new pods")
    assert all(after[name] != uid for name, uid in before.items()), "every rank was recreated, not only rank 1"
    for pod in ("ds-0", "ds-1"):
        await cluster.set_pod(pod, ready=True)
    await wait(lambda: cluster.cr("ds")["status"]["phase"] == "Running", "Running again")
    assert any(e["reason"] == "GangRestart" for e in cluster.list("v1/events"))


def _baseline_is_current(cluster) -> bool:
    pods = cluster.list("v1/pods")
    members = group_gang(cluster.cr("ds")).get("members", {})
    current = {p["metadata"]["labels"][c.LABEL_POD_INDEX]:
               f"{p['metadata']['uid']}/{p['status']['containerStatuses'][0]['restartCount']}" for p in pods}
    return len(pods) == 2 and members == current


async def test_gang_restart_budget_exhausted_fails(cluster, runtime):
    await _running_group(cluster, runtime)
    for attempt in range(1, 4):
        await wait(lambda: _baseline_is_current(cluster), "the gang baseline of the current pods")
        await cluster.set_pod("ds-1", ready=True, restarts=attempt)
        if attempt <= 2:  # budget 2 in the test settings
            await wait(lambda: group_gang(cluster.cr("ds"))["restarts"] == attempt, f"restart {attempt}")
            await wait(lambda: len(cluster.list("v1/pods")) == 2 and not any(
                p["status"]["containerStatuses"][0]["restartCount"] for p in cluster.list("v1/pods")),
                "recreated pods")
            for pod in ("ds-0", "ds-1"):
                await cluster.set_pod(pod, ready=True)
    await wait(lambda: cluster.cr("ds")["status"]["phase"] == "Failed", "Failed after the budget")
    assert condition(cluster.cr("ds"), "Ready")["reason"] == "GangRestartBudgetExhausted"
    assert group_gang(cluster.cr("ds"))["restarts"] == 2


async def test_spec_update_rolls_the_whole_group(cluster, runtime):
    await _running_group(cluster, runtime)
    old_hash = cluster.get("apps/v1/statefulsets", "ds")["metadata"]["annotations"][c.ANNOTATION_TEMPLATE_HASH]
    await cluster.patch_cr("ds", {"spec": {"image": "example.com/mtp/runtime:2", "nnodes": 3}})
    sts = await wait(lambda: (s := cluster.get("apps/v1/statefulsets", "ds")) and
                     s["metadata"]["annotations"][c.ANNOTATION_TEMPLATE_HASH] != old_hash and s, "patched sts")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/mtp/runtime:2"
    new_hash = sts["metadata"]["annotations"][c.ANNOTATION_TEMPLATE_HASH]
    pods = await wait(lambda: (ps := cluster.list("v1/pods")) and len(ps) == 3 and
                      all(p["metadata"]["labels"][c.LABEL_TEMPLATE_HASH] == new_hash for p in ps) and ps,
                      "three pods on the new template")
    assert "--nnodes=3" in pods[0]["spec"]["containers"][0]["args"]
    # One collection delete of every pod on the old template: the group rolls together.
    assert any(f"{c.LABEL_TEMPLATE_HASH}!={new_hash}" in r.params.get("labelSelector", "")
               for r in cluster.requests("DELETE", "/pods"))
    for pod in pods:
        await cluster.set_pod(pod["metadata"]["name"], ready=True)
    await wait(lambda: cluster.cr("ds")["status"]["phase"] == "Running"
               and cluster.cr("ds")["status"]["observedGeneration"] == 2, "Running at generation 2")
    assert cluster.cr("ds")["status"]["nodes"] == "3/3"
    assert cluster.cr("ds")["spec"]["image"] == "example.com/mtp/runtime:2"  # spec never rewritten


async def test_operator_restart_mid_export_creates_no_second_job(cluster, runtime):
    await cluster.create_cr("ds", spec(runtime.port))
    job = (await wait(lambda: cluster.list("batch/v1/jobs"), "the export job"))[0]
    await asyncio.sleep(0.3)
    await cluster.operator.stop()
    posts_before = len(cluster.requests("POST", "/jobs"))
    await cluster.operator.start()
    await asyncio.sleep(0.8)  # resume handler + several timer reconciles
    assert [j["metadata"]["name"] for j in cluster.list("batch/v1/jobs")] == [job["metadata"]["name"]]
    assert len(cluster.requests("POST", "/jobs")) == posts_before, "the restarted operator posted a Job again"
    await cluster.finish_job(job["metadata"]["name"], succeeded=True)
    await wait(lambda: cluster.get("apps/v1/statefulsets", "ds"), "the statefulset after the restart")


async def test_delete_releases_the_resource_and_children_are_owned(cluster, runtime):
    await _running_group(cluster, runtime)
    await wait(lambda: cluster.cr("ds").get("metadata", {}).get("finalizers"), "kopf's finalizer (timers)")
    uid = cluster.cr("ds")["metadata"]["uid"]
    for resource in ("apps/v1/statefulsets", "v1/services"):
        for child in cluster.list(resource):
            owner = child["metadata"]["ownerReferences"][0]
            assert owner["uid"] == uid and owner["controller"] is True  # the API server's GC deletes them
    await cluster.request("DELETE", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/default/{c.PLURAL}/ds")
    await wait(lambda: not cluster.cr("ds"), "the MtpDeployment to be gone (finalizer released)")


@pytest.mark.parametrize("operator_settings", [{"metrics_interval": 3600.0}], indirect=True)
async def test_delete_during_a_timer_run_releases_the_resource_promptly(cluster, runtime, monkeypatch):
    # A timer still running when the CR is deleted holds kopf's finalizer until it ends; when its run
    # changes nothing, no watch event follows, and kopf looks again only after
    # settings.background.cancellation_polling (60 s by default). No scrape runs here (a scrape's
    # status patch would be such an event): the level timer's reconcile is slowed instead.
    from mtp_operator import handlers
    await _running_group(cluster, runtime)
    real, in_flight = handlers.reconcile, []

    def slow_reconcile(*args, **kwargs):
        in_flight.append(1)
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(handlers, "reconcile", slow_reconcile)
    await wait(lambda: in_flight, "a level run in flight")
    await cluster.request("DELETE", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/default/{c.PLURAL}/ds")
    await wait(lambda: not cluster.cr("ds"), "the MtpDeployment to be gone after the run ended", timeout=10.0)
