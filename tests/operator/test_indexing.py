"""Summaries of children and observations built from them."""

from __future__ import annotations

from mtp_operator import constants as c
from mtp_operator.indexing import (export_observation, job_summary, owner_key, pod_summary, rank_observations,
                                   statefulset_summary)


def pod(name, rank=None, ready=True, restarts=0, hash_="h1", job=None, terminated=None, deleting=False):
    labels = {c.LABEL_DEPLOYMENT: "ds", c.LABEL_COMPONENT: c.COMPONENT_EXPORT if job else c.COMPONENT_SERVER,
              c.LABEL_TEMPLATE_HASH: hash_}
    if rank is not None:
        labels[c.LABEL_POD_INDEX] = str(rank)
    if job:
        labels["batch.kubernetes.io/job-name"] = job
    meta = {"name": name, "namespace": "ns", "uid": f"u-{name}", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    state = {"terminated": terminated} if terminated else {"running": {}}
    return {"metadata": meta, "status": {"podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"restartCount": restarts, "state": state}]}}


def test_pod_summary_and_rank_from_label_or_name():
    s = pod_summary(pod("ds-1", rank=1, restarts=2))
    assert s["rank"] == 1 and s["restarts"] == 2 and s["ready"] and s["podIP"] == "10.0.0.1"
    assert owner_key(pod("ds-1")) == ("ns", "ds")
    assert pod_summary(pod("ds-3"))["rank"] == 3  # no pod-index label: trailing ordinal
    assert owner_key({"metadata": {"name": "x", "namespace": "ns", "labels": {}}}) is None


def test_export_observation_states_and_termination_message():
    running = job_summary({"metadata": {"name": "j"}, "status": {"active": 1}})
    done = job_summary({"metadata": {"name": "j"}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}})
    failed = job_summary({"metadata": {"name": "j"}, "status": {"conditions": [{"type": "Failed", "status": "True"}]}})
    pods = [pod_summary(pod("j-x", job="j", terminated={"exitCode": 1, "message": "no MTP layer\n"}))]
    assert export_observation("j", [], []).state == "absent"
    assert export_observation("j", [running], []).state == "running"
    assert export_observation("j", [done], []).state == "succeeded"
    observed = export_observation("j", [failed], pods)
    assert observed.state == "failed" and observed.message == "no MTP layer"
    assert export_observation("other", [done], []).state == "absent"


def test_rank_observations_only_server_pods():
    pods = [pod_summary(p) for p in (pod("ds-0", 0), pod("ds-1", 1, hash_="old", deleting=True),
                                     pod("j-x", job="j"))]
    ranks = rank_observations(pods, "h1")
    assert [(r.rank, r.current, r.terminating) for r in ranks] == [(0, True, False), (1, False, True)]


def test_statefulset_summary():
    body = {"metadata": {"name": "ds", "annotations": {c.ANNOTATION_TEMPLATE_HASH: "h"}}}
    assert statefulset_summary(body) == {"name": "ds", "templateHash": "h", "group": 0, "revision": None}
