"""The operator against the real API server and controllers: the Job and StatefulSet
controllers make the pods, kwok runs them, the garbage collector deletes them.

The operator probes each rank's /health and rank 0's /metrics on the pod IPs kwok gives
(127.1.x.y), where `rank_servers` answers as fake ranks.
"""

from __future__ import annotations

import threading
import time

import pytest

from mtp_operator import constants as c

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_spec(http_port: int, **changes) -> dict:
    spec = {"model": {"path": "/models/ds", "modelType": "deepseek_v3", "volume": {"claimName": "models"}},
            "export": {"outputPath": "/models/ds-mtp"}, "nnodes": 2, "image": "registry.example/mtp/runtime:1",
            "ports": {"http": http_port, "master": 29500},
            # Template changes are judged at once (the rollout tests judge on real figures).
            "rollout": {"canary": {"analysisSeconds": 0, "minDraftTokens": 0}}}
    spec.update(changes)
    return spec


def server_pods(kube, namespace: str, name: str) -> list[dict]:
    return [p for p in kube.items(f"/api/v1/namespaces/{namespace}/pods",
                                  f"{c.LABEL_DEPLOYMENT}={name},{c.LABEL_COMPONENT}={c.COMPONENT_SERVER}")
            if not p["metadata"].get("deletionTimestamp")]


def group(cr: dict, index: int = 0) -> dict:
    """status.groups[index] (restarts, revision, readyNodes, figures)."""
    return next((g for g in cr.get("status", {}).get("groups", []) if g["index"] == index), {})


def phase(kube, namespace: str, name: str) -> str | None:
    return kube.cr(namespace, name).get("status", {}).get("phase")


def running(kube, namespace: str, name: str, nnodes: int):
    """The CR is Running with every rank ready and its status caught up with the spec."""
    cr = kube.cr(namespace, name)
    status = cr.get("status", {})
    return (status.get("phase") == "Running" and status.get("readyNodes") == nnodes
            and status.get("observedGeneration") == cr["metadata"]["generation"]) and cr


def events(kube, namespace: str, reason: str | None = None) -> list[dict]:
    found = kube.items(f"/api/v1/namespaces/{namespace}/events")
    return [e for e in found if reason is None or e["reason"] == reason]


def children(kube, namespace: str, name: str) -> dict[str, list[str]]:
    selector = f"{c.LABEL_DEPLOYMENT}={name}"
    paths = {"jobs": f"/apis/batch/v1/namespaces/{namespace}/jobs",
             "statefulsets": f"/apis/apps/v1/namespaces/{namespace}/statefulsets",
             "services": f"/api/v1/namespaces/{namespace}/services",
             "pods": f"/api/v1/namespaces/{namespace}/pods",
             "controllerrevisions": f"/apis/apps/v1/namespaces/{namespace}/controllerrevisions"}
    return {kind: [o["metadata"]["name"] for o in kube.items(path, selector)] for kind, path in paths.items()}


def wait_running(kube, namespace, name, nnodes, replicas=None, timeout=60, what="Running"):
    """Running with `nnodes` ready ranks in all (and `replicas` ready groups); the status on failure."""
    def check():
        cr = running(kube, namespace, name, nnodes)
        return cr if cr and (replicas is None or cr["status"].get("readyReplicas") == replicas) else None

    try:
        return kube.eventually(check, timeout, f"{name} {what}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status: {kube.cr(namespace, name).get('status')}") from None


def run_to_running(kube, namespace, name, spec, nnodes=2, timeout=90):
    code, answer = kube.create_cr(namespace, name, spec)
    assert code in (200, 201), answer
    return wait_running(kube, namespace, name, nnodes, timeout=timeout)


@pytest.mark.parametrize("cluster_wide", [True, False], ids=["cluster-wide", "namespaced"])
def test_full_flow_with_real_controllers(kube, namespace, install_chart, run_operator, rank_servers, cluster_wide):
    """The whole flow, with the operator authenticated as the chart's ServiceAccount (a TokenRequest
    token, as its pod would mount): no request is forbidden, and the chart grants nothing unused."""
    chart = install_chart(cluster_wide)
    port = free_port()
    servers = rank_servers(port)
    servers.default.draft, servers.default.accepted = 100, 80
    run_operator(namespace, token=chart.token, revision_history=1)  # the flow prunes old revisions too
    code, answer = kube.create_cr(namespace, "ds", base_spec(port))
    assert code in (200, 201), answer

    # Export Job -> its pod runs and completes under kwok -> the Job controller marks it Complete.
    jobs = kube.eventually(lambda: kube.items(f"/apis/batch/v1/namespaces/{namespace}/jobs"), 30, "the export Job")
    assert len(jobs) == 1 and jobs[0]["metadata"]["ownerReferences"][0]["kind"] == c.KIND
    kube.eventually(lambda: kube.condition(kube.cr(namespace, "ds"), c.CONDITION_DRAFT_READY).get("status") == "True" or None,
               60, "DraftReady")
    # The StatefulSet controller creates the rank pods, with the pod-index label the rank comes from.
    cr = kube.eventually(lambda: running(kube, namespace, "ds", 2), 60, "phase Running")
    pods = server_pods(kube, namespace, "ds")
    assert sorted(p["metadata"]["labels"][c.LABEL_POD_INDEX] for p in pods) == ["0", "1"]
    assert all(p["status"]["podIP"].startswith("127.1.") for p in pods)
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"] == 1
    assert kube.condition(cr, c.CONDITION_READY)["status"] == "True"
    kube.eventually(lambda: kube.cr(namespace, "ds")["status"].get("speculative", {}).get("draftTokens") is not None
               or None, 30, "rank 0's metrics in status")

    # A rank's pod is deleted: the controller recreates it, the operator restarts the whole group once.
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    kube.call("DELETE", f"/api/v1/namespaces/{namespace}/pods/ds-1?gracePeriodSeconds=0")
    kube.eventually(lambda: group(kube.cr(namespace, "ds")).get("restarts") == 1 or None, 60,
               "one gang restart")
    kube.eventually(lambda: running(kube, namespace, "ds", 2), 60, "Running after the gang restart")
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in server_pods(kube, namespace, "ds")}
    assert set(after) == set(before) and not set(after.values()) & set(before.values()), "rank 0 kept running"
    time.sleep(2 * 0.5 + 1)  # a few reconciles later: still exactly one
    assert group(kube.cr(namespace, "ds"))["restarts"] == 1
    assert len(events(kube, namespace, "GangRestart")) == 1

    # A spec change rolls the group as one: every pod replaced, on the new template, no gang restart.
    old_hash = kube.cr(namespace, "ds")["status"]["templateHash"]
    kube.merge_patch(kube.cr_path(namespace, "ds"), {"spec": {"image": "registry.example/mtp/runtime:2"}})
    cr = kube.eventually(lambda: (lambda r: r and r["status"]["templateHash"] != old_hash and r)(
        running(kube, namespace, "ds", 2)), 60, "Running on the new template")
    pods = server_pods(kube, namespace, "ds")
    assert {p["spec"]["containers"][0]["image"] for p in pods} == {"registry.example/mtp/runtime:2"}
    assert {p["metadata"]["labels"][c.LABEL_TEMPLATE_HASH] for p in pods} == {cr["status"]["templateHash"]}
    assert cr["metadata"]["generation"] == 2 and group(cr)["restarts"] == 0

    # nnodes 2 -> 3.
    kube.merge_patch(kube.cr_path(namespace, "ds"), {"spec": {"nnodes": 3}})
    wait_running(kube, namespace, "ds", 3, what="with 3 nodes")
    sts = kube.get(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/ds")
    assert sts["spec"]["replicas"] == 3 and len(server_pods(kube, namespace, "ds")) == 3

    # Two groups through the scale subresource, then back to one: the second group's StatefulSet goes.
    scale = kube.cr_path(namespace, "ds") + "/scale"
    assert kube.get(scale)["spec"]["replicas"] == 1
    kube.merge_patch(scale, {"spec": {"replicas": 2}})
    wait_running(kube, namespace, "ds", 6, replicas=2, what="with two groups")
    assert kube.get(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/ds-g1")["spec"]["replicas"] == 3
    kube.merge_patch(scale, {"spec": {"replicas": 1}})
    kube.eventually(lambda: kube.get(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/ds-g1") is None or None,
                    30, "group 1 removed")
    revisions = kube.items(f"/apis/apps/v1/namespaces/{namespace}/controllerrevisions", c.LABEL_REVISION_HASH)
    assert [r["metadata"]["labels"][c.LABEL_REVISION_HASH] for r in revisions] == \
        [kube.cr(namespace, "ds")["status"]["currentRevision"]], "older revisions were not pruned"

    # Deleting the MtpDeployment: the real garbage collector removes every child.
    assert all(children(kube, namespace, "ds").values())
    kube.call("DELETE", kube.cr_path(namespace, "ds"))
    # kopf removes its finalizer only after the object's timers have stopped; in the full suite on a
    # busy 2-core machine that once took more than 30 s (the other waits here allow 60)
    kube.eventually(lambda: kube.get(kube.cr_path(namespace, "ds")) is None or None, 60, "the CR gone (finalizer)")
    kube.eventually(lambda: not any(children(kube, namespace, "ds").values()) or None, 60,
               "the garbage collector to delete every child")

    used, forbidden = chart.used()
    assert not forbidden, [(e["verb"], e["objectRef"]) for e in forbidden]
    unused = chart.granted() - used
    assert not unused, f"the chart grants what the flow never uses: {sorted(unused)}"


def set_schedulable(kube, schedulable: bool) -> None:
    for node in kube.items("/api/v1/nodes"):
        kube.merge_patch(f"/api/v1/nodes/{node['metadata']['name']}", {"spec": {"unschedulable": not schedulable}})


def test_operator_restart_mid_export_makes_no_second_job(kube, namespace, run_operator, rank_servers):
    port = free_port()
    rank_servers(port)
    set_schedulable(kube, False)  # the export pod stays Pending: the export is "running" while we restart
    try:
        first = run_operator(namespace)
        code, answer = kube.create_cr(namespace, "ds", base_spec(port, nnodes=1))
        assert code in (200, 201), answer
        kube.eventually(lambda: kube.items(f"/apis/batch/v1/namespaces/{namespace}/jobs"), 30, "the export Job")
        kube.eventually(lambda: phase(kube, namespace, "ds") == "Exporting" or None, 30, "phase Exporting")
        first.stop()
        run_operator(namespace)
        time.sleep(3)  # several reconcile intervals of the new operator
        assert len(kube.items(f"/apis/batch/v1/namespaces/{namespace}/jobs")) == 1
    finally:
        set_schedulable(kube, True)
    kube.eventually(lambda: running(kube, namespace, "ds", 1), 90, "Running after the export")
    assert len(kube.items(f"/apis/batch/v1/namespaces/{namespace}/jobs")) == 1


def test_another_writer_s_condition_written_while_we_reconcile_is_kept(kube, namespace, run_operator, rank_servers,
                                                                       monkeypatch):
    """The race of the test below, made certain: another controller's condition lands after a handler
    has read the object and before kopf writes what it decided (a change of our own conditions).
    Written from the handler's copy, the list would go back to the writer's older condition."""
    import mtp_operator.handlers as handlers

    port = free_port()
    servers = rank_servers(port)
    path = kube.cr_path(namespace, "ds") + "/status"

    def write_external(message: str) -> None:
        for _ in range(20):  # the operator's own writes may get in first: read again and retry
            cr = kube.cr(namespace, "ds")
            conditions = [x for x in cr["status"].get("conditions", []) if x["type"] != "ExternalCheck"]
            cr["status"]["conditions"] = conditions + [{
                "type": "ExternalCheck", "status": "True", "reason": "Checked", "message": message,
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]
            if kube.try_call("PUT", path, cr)[0] == 200:
                return
        raise AssertionError("the external writer never got its update in")

    late = threading.Event()
    reconcile = handlers.reconcile

    def reconcile_then_another_writer(*args, **kwargs):
        outcome = reconcile(*args, **kwargs)
        if late.is_set() and outcome.status.get("phase") != "Running":  # our conditions change now
            late.clear()
            write_external("late")
        return outcome

    monkeypatch.setattr(handlers, "reconcile", reconcile_then_another_writer)
    run_operator(namespace)
    run_to_running(kube, namespace, "ds", base_spec(port, nnodes=1), nnodes=1)
    write_external("early")
    late.set()
    for ip in list(servers.by_ip):
        servers.rank(ip).health_status = 503
    kube.eventually(lambda: not late.is_set(), 30, "a reconcile that changes our conditions")
    kube.eventually(lambda: kube.condition(kube.cr(namespace, "ds"), "Ready").get("status") == "False", 30,
                    "Ready False written")
    time.sleep(1.5)  # more reconciles and scrapes
    cr = kube.cr(namespace, "ds")
    assert kube.condition(cr, "ExternalCheck").get("message") == "late", cr["status"]["conditions"]
    assert kube.condition(cr, "Ready")["status"] == "False"


def test_a_second_status_writer_loses_nothing(kube, namespace, run_operator, rank_servers):
    """Another controller keeps its own condition in our status (optimistic concurrency, PUT with
    resourceVersion) while the operator reconciles: neither side's update is lost, no handler fails."""
    port = free_port()
    servers = rank_servers(port)
    run_operator(namespace)
    run_to_running(kube, namespace, "ds", base_spec(port, nnodes=1), nnodes=1)
    path = kube.cr_path(namespace, "ds") + "/status"
    stop, written, conflicts = threading.Event(), [], []

    def writer() -> None:
        for round_ in range(30):
            if stop.is_set():
                return
            cr = kube.cr(namespace, "ds")
            conditions = [x for x in cr["status"].get("conditions", []) if x["type"] != "ExternalCheck"]
            conditions.append({"type": "ExternalCheck", "status": "True", "reason": "Checked",
                               "message": f"round {round_}", "lastTransitionTime": "2026-01-01T00:00:00Z"})
            cr["status"]["conditions"] = conditions
            code, _ = kube.try_call("PUT", path, cr)
            (written if code == 200 else conflicts).append(round_)
            time.sleep(0.1)

    thread = threading.Thread(target=writer)
    thread.start()
    # Meanwhile the operator has status to write: acceptance figures change every scrape, and its
    # own conditions change too while rank 0 answers /health with an error for a while (those go
    # with a resourceVersion test: a merge patch would put back the writer's condition as it was).
    rates, readiness = set(), []
    for tick in range(10):
        for ip in list(servers.by_ip):
            servers.rank(ip).draft += 50
            servers.rank(ip).accepted += 40
            servers.rank(ip).health_status = 503 if 2 <= tick < 5 else 200
        time.sleep(0.5)
        status = kube.cr(namespace, "ds")["status"]
        rates.add(status.get("speculative", {}).get("acceptanceRate"))
        readiness.append(kube.condition({"status": status}, "Ready").get("status"))
    thread.join(30)
    stop.set()
    assert written, f"the writer never got through ({len(conflicts)} conflicts)"
    time.sleep(2)  # reconciles and scrapes after the writer's last update
    cr = kube.cr(namespace, "ds")
    external = kube.condition(cr, "ExternalCheck")
    assert external.get("message") == f"round {written[-1]}", f"the writer's last update was lost: {external}"
    assert cr["status"]["phase"] == "Running"
    assert 0.8 in rates, f"the operator's own status updates stopped: {rates}"
    assert "False" in readiness and readiness[-1] == "True", f"our conditions did not change: {readiness}"
    # What kopf's retry rests on: a JSON patch led by a test of an older resourceVersion is refused
    # whole (422) by the API server, and kopf applies it again to the next copy it sees.
    stale = int(cr["metadata"]["resourceVersion"]) - 1
    code, _ = kube.try_call("PATCH", path, [{"op": "test", "path": "/metadata/resourceVersion", "value": str(stale)},
                                            {"op": "replace", "path": "/status/phase", "value": "Pending"}],
                            content_type="application/json-patch+json")
    assert code == 422 and kube.cr(namespace, "ds")["status"]["phase"] == "Running"
    errors = [e for e in events(kube, namespace) if e["involvedObject"]["kind"] == c.KIND
              and (e["type"] == "Error" or e["reason"] == "Error")]  # kopf's events for a failed handler
    assert not errors, [e["message"] for e in errors]
