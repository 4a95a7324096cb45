"""Children of an MtpDeployment as small summaries (kopf indices), and observations from them.

The operator indexes its Jobs, pods and StatefulSets by (namespace, owner
name) from kopf's watches, so a reconcile reads cluster state from memory and
makes API calls only to change something.

    job_summary(body) / pod_summary(body) / statefulset_summary(body) -> dict
    export_observation(job_name, jobs, pods) -> ExportObservation
    rank_observations(pods, template_hash) -> list[RankObservation]
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from mtp_operator import constants as c
from mtp_operator.observations import ExportObservation, RankObservation

JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
_ORDINAL = re.compile(r"-(\d+)$")


def owner_key(body: Mapping[str, Any]) -> tuple[str, str] | None:
    meta = body.get("metadata", {})
    owner = (meta.get("labels") or {}).get(c.LABEL_DEPLOYMENT)
    return (meta.get("namespace"), owner) if owner else None


def job_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    status = body.get("status") or {}
    conditions = {cond.get("type"): cond.get("status") for cond in status.get("conditions") or []}
    return {
        "name": body["metadata"]["name"],
        "succeeded": conditions.get("Complete") == "True" or (status.get("succeeded") or 0) > 0,
        "failed": conditions.get("Failed") == "True",
        "active": status.get("active") or 0,
    }


def _termination_message(status: Mapping[str, Any]) -> str:
    for container in status.get("containerStatuses") or []:
        for state_key in ("state", "lastState"):
            terminated = (container.get(state_key) or {}).get("terminated") or {}
            if terminated.get("exitCode", 0) != 0:
                return (terminated.get("message") or terminated.get("reason") or
                        f"exit code {terminated.get('exitCode')}").strip()
    return ""


def pod_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    labels = meta.get("labels") or {}
    status = body.get("status") or {}
    conditions = {cond.get("type"): cond.get("status") for cond in status.get("conditions") or []}
    index = labels.get(c.LABEL_POD_INDEX)
    if index is None:  # older clusters: the trailing ordinal of the pod name
        match = _ORDINAL.search(meta["name"])
        index = match.group(1) if match else None
    group = labels.get(c.LABEL_GROUP, "0")  # a pod from before fleets: the one group
    return {
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "component": labels.get(c.LABEL_COMPONENT),
        "group": int(group) if str(group).isdigit() else None,
        "rank": int(index) if index is not None and str(index).isdigit() else None,
        "templateHash": labels.get(c.LABEL_TEMPLATE_HASH),
        "jobName": next((labels[k] for k in JOB_NAME_LABELS if k in labels), None),
        "ready": conditions.get("Ready") == "True",
        "restarts": sum(cs.get("restartCount", 0) for cs in status.get("containerStatuses") or []),
        "terminating": bool(meta.get("deletionTimestamp")),
        "podIP": status.get("podIP"),
        "terminationMessage": _termination_message(status),
    }


def statefulset_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    annotations = meta.get("annotations") or {}
    group = (meta.get("labels") or {}).get(c.LABEL_GROUP, "0")
    return {"name": meta["name"], "templateHash": annotations.get(c.ANNOTATION_TEMPLATE_HASH),
            "group": int(group) if str(group).isdigit() else None, "revision": annotations.get(c.ANNOTATION_REVISION)}


def revision_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """A ControllerRevision of ours: its hash, number and the spec it holds."""
    meta = body["metadata"]
    return {"name": meta["name"], "hash": (meta.get("labels") or {}).get(c.LABEL_REVISION_HASH),
            "revision": body.get("revision", 0), "spec": (body.get("data") or {}).get("spec")}


def export_observation(job_name: str, jobs: Iterable[Mapping[str, Any]],
                       pods: Iterable[Mapping[str, Any]]) -> ExportObservation:
    job = next((j for j in jobs if j["name"] == job_name), None)
    if job is None:
        return ExportObservation(job_name, "absent")
    if job["succeeded"]:
        return ExportObservation(job_name, "succeeded")
    if job["failed"]:
        messages = [p["terminationMessage"] for p in pods if p.get("jobName") == job_name and p["terminationMessage"]]
        return ExportObservation(job_name, "failed", messages[-1] if messages else "")
    return ExportObservation(job_name, "running")


def rank_observations(pods: Iterable[Mapping[str, Any]], template_hash: str) -> list[RankObservation]:
    return [
        RankObservation(rank=p["rank"], uid=p["uid"], restart_count=p["restarts"], ready=p["ready"],
                        current=p["templateHash"] == template_hash, terminating=p["terminating"])
        for p in pods if p.get("component") == c.COMPONENT_SERVER and p.get("rank") is not None
    ]
