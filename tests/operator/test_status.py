"""Observations -> status: phases, conditions, figures."""

from __future__ import annotations

import pytest

from mtp_operator.metrics import SpecDecodeStats
from mtp_operator.observations import ExportObservation, Observations, RankObservation
from mtp_operator.status import compute_status, status_changes


def obs(export="succeeded", ready=(True, True), stats=None, generation=1, **kw):
    return Observations(
        generation=generation, nnodes=len(ready), draft_model_path="/models/d", master_address="h:29500",
        endpoint="http://svc:8000", template_hash="abc",
        export=None if export is None else ExportObservation("job-1", export, kw.pop("message", "")),
        ranks=[RankObservation(i, f"u{i}", 0, r, healthy=kw.get("healthy")) for i, r in enumerate(ready)],
        stats=stats, stats_time="2026-01-01T00:00:10Z", failure=kw.get("failure"), gang=kw.get("gang"))


def stats(rate):
    return SpecDecodeStats(rate, 0.9, [0.9], 100, 10.0, 50.0, 5.0, 0.2, 0.03, 1.0, 0.0, 0.4)


def cond(status, ctype):
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_exporting_then_starting_then_running():
    s1 = compute_status(None, obs(export="running", ready=()), min_acceptance_rate=None, now="T1")
    assert s1["phase"] == "Exporting" and cond(s1, "DraftReady")["status"] == "False"
    assert cond(s1, "Progressing")["reason"] == "Exporting"
    s2 = compute_status(s1, obs(ready=(True, False)), min_acceptance_rate=None, now="T2")
    assert s2["phase"] == "Starting" and s2["nodes"] == "1/2"
    assert cond(s2, "DraftReady") == {**cond(s2, "DraftReady"), "status": "True", "lastTransitionTime": "T2"}
    assert "rank 1: not ready" in cond(s2, "Ready")["message"]
    s3 = compute_status(s2, obs(stats=stats(0.8)), min_acceptance_rate=0.6, now="T3")
    assert s3["phase"] == "Running" and s3["readyNodes"] == 2
    assert cond(s3, "Ready")["status"] == "True" and cond(s3, "Ready")["lastTransitionTime"] == "T3"
    assert cond(s3, "DraftReady")["lastTransitionTime"] == "T2"  # unchanged status keeps its time
    assert s3["speculative"]["acceptanceRate"] == 0.8 and s3["throughput"]["generationTokensPerSecond"] == 50.0
    assert s3["latency"]["timePerOutputTokenSeconds"] == 0.03
    assert s3["speculative"]["observedTime"] == "2026-01-01T00:00:10Z"


def test_figures_are_kept_without_a_fresh_scrape():
    s1 = compute_status(None, obs(stats=stats(0.7)), min_acceptance_rate=None, now="T1")
    s2 = compute_status(s1, obs(stats=None), min_acceptance_rate=None, now="T2")
    assert s2["speculative"] == s1["speculative"]
    assert status_changes(s1, s2) == {}


def test_low_acceptance_degrades():
    s = compute_status(None, obs(stats=stats(0.4)), min_acceptance_rate=0.6, now="T")
    assert s["phase"] == "Degraded"
    degraded = cond(s, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "LowAcceptance"
    assert "0.400 is below minAcceptanceRate 0.6" in degraded["message"]


def test_export_failure_reports_the_termination_message():
    s = compute_status(None, obs(export="failed", ready=(), message="KeyError: model.layers.61"),
                       min_acceptance_rate=None, now="T")
    assert s["phase"] == "Failed"
    draft = cond(s, "DraftReady")
    assert draft["reason"] == "ExportFailed" and "KeyError: model.layers.61" in draft["message"]
    assert s["exportJob"] == "job-1"


def test_unhealthy_rank_keeps_group_starting():
    s = compute_status(None, obs(healthy=False), min_acceptance_rate=None, now="T")
    assert s["phase"] == "Starting" and s["readyNodes"] == 0


def test_failure_and_budget_exhaustion():
    s = compute_status(None, obs(failure=("InvalidSpec", "spec.nnodes: bad")), min_acceptance_rate=None, now="T")
    assert s["phase"] == "Failed" and cond(s, "Ready")["reason"] == "InvalidSpec"
    gang = {"members": {}, "restarts": 5, "reason": "GangRestartBudgetExhausted"}
    s = compute_status(None, obs(gang=gang), min_acceptance_rate=None, now="T")
    assert s["phase"] == "Failed" and cond(s, "Degraded")["status"] == "True"


def test_draft_provided_and_observed_generation():
    s = compute_status(None, obs(export=None, generation=7), min_acceptance_rate=None, now="T")
    assert cond(s, "DraftReady")["reason"] == "DraftProvided" and s["observedGeneration"] == 7
    assert "exportJob" not in s
    assert status_changes({"exportJob": "old", **s}, s) == {"exportJob": None}


def test_every_status_fits_the_crd_status_schema():
    # The API server prunes fields its schema does not list: a status field the
    # schema lacks would vanish silently. The models forbid unknown fields at
    # every level, and the CRD's status schema is generated from them.
    import jsonschema

    from mtp_operator.crd import build_crd
    from mtp_operator.status_schema import MtpDeploymentStatus

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    gang = {"members": {"0": "u0/0"}, "restarts": 1, "retired": ["u0"],
            "lastRestartTime": "2026-01-01T00:00:00Z", "reason": "GangRestartBackoff"}
    statuses = [
        compute_status(None, obs(export="running", ready=()), min_acceptance_rate=None),
        compute_status(None, obs(export="failed", ready=(), message="boom"), min_acceptance_rate=None),
        compute_status(None, obs(stats=stats(0.4), gang=gang), min_acceptance_rate=0.6),
        compute_status(None, obs(export=None, failure=("InvalidSpec", "spec.nnodes: bad")), min_acceptance_rate=None),
    ]
    for status in statuses:
        MtpDeploymentStatus.model_validate(status)
        jsonschema.Draft4Validator(schema).validate(status)


def test_draft_ready_says_whether_the_export_wrote_the_draft_or_found_it_up_to_date():
    skipped = compute_status(None, obs(message="/models/d: up to date (deepseek_v3_mtp), nothing to do"),
                             min_acceptance_rate=None, now="T1")
    assert cond(skipped, "DraftReady")["message"] == "export job job-1 found /models/d up to date"
    wrote = compute_status(None, obs(message="/models/d: exported deepseek_v3_mtp, 44 tensors"),
                           min_acceptance_rate=None, now="T1")
    assert cond(wrote, "DraftReady")["message"] == "export job job-1 wrote /models/d"
    assert cond(compute_status(None, obs(), min_acceptance_rate=None, now="T1"), "DraftReady")["message"] == \
        "export job job-1 wrote /models/d"  # a Job reports no summary: the message is what it always was


def test_mean_chosen_k_is_in_the_status_and_its_schema():
    from dataclasses import replace

    import jsonschema

    from mtp_operator.crd import build_crd
    from mtp_operator.status_schema import MtpDeploymentStatus

    status = compute_status(None, obs(stats=replace(stats(0.7), mean_speculative_tokens=1.25)),
                            min_acceptance_rate=None, now="T1")
    assert status["speculative"]["meanSpeculativeTokens"] == 1.25
    MtpDeploymentStatus.model_validate(status)
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    jsonschema.Draft4Validator(schema).validate(status)
    assert "meanSpeculativeTokens" not in compute_status(None, obs(stats=stats(0.7)), min_acceptance_rate=None,
                                                         now="T1")["speculative"]


def test_status_changes_delete_nested_keys_the_new_status_lacks():
    """A merge patch keeps what it does not mention: a finished rollout's keys must be nulled, or the
    next reconcile finds them again and patches forever."""
    old = {"phase": "Running", "rollout": {"phase": "Rolling", "canaryGroups": [3], "lastResult": "passed"}}
    new = {"phase": "Running", "rollout": {"lastResult": "passed"}}
    patch = status_changes(old, new)
    assert patch == {"rollout": {"phase": None, "canaryGroups": None}}
    applied = {**old, "rollout": {k: v for k, v in {**old["rollout"], **patch["rollout"]}.items() if v is not None}}
    assert applied == new and status_changes(applied, new) == {}


def test_a_status_update_goes_onto_the_newest_copy_under_a_resource_version_test():
    # kopf's own machinery turns the transformation into the JSON patch it sends: our fields and
    # conditions as one change of the newest copy, led by the test of its resourceVersion; another
    # writer's condition is kept as that copy has it, not as the handler's older copy had it.
    import jsonpatch
    from kopf import Patch

    from mtp_operator.status import StatusUpdate

    theirs = {"type": "ExternalCheck", "status": "True", "reason": "Checked", "message": "round 29"}
    mine_then = [{"type": "Ready", "status": "False", "reason": "RanksNotReady", "message": "0/1"}]
    mine_now = [{"type": "Ready", "status": "True", "reason": "GroupReady", "message": "all ready"},
                {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""}]
    newest = {"metadata": {"name": "ds", "resourceVersion": "42"},
              "status": {"phase": "Starting", "nodes": "0/1", "kopf": {"progress": {}},
                         "conditions": mine_then + [theirs]}}
    ours = {"phase": "Running", "readyNodes": 1, "conditions": mine_now + [{**theirs, "message": "round 28"}]}
    patch = Patch(fns=[StatusUpdate(ours)])
    ops = patch.as_json_patch(newest)
    assert all(op["path"].startswith("/status/") for op in ops)
    sent = [{"op": "test", "path": "/metadata/resourceVersion", "value": "42"}] + ops  # as kopf sends it
    written = jsonpatch.apply_patch(newest, sent)
    assert written["status"] == {"phase": "Running", "readyNodes": 1, "kopf": {"progress": {}},
                                 "conditions": mine_now + [theirs]}  # `nodes` is no longer ours to show
    newer = {**newest, "metadata": {"name": "ds", "resourceVersion": "43"}}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(newer, sent)  # another writer got in between: none of it is written
    fresh = {"metadata": {"name": "ds"}}  # no status at all yet
    StatusUpdate({"phase": "Pending", "conditions": mine_now})(fresh)
    assert fresh == {"metadata": {"name": "ds"}, "status": {"phase": "Pending", "conditions": mine_now}}
