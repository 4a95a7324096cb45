"""One reconcile step with a recording API double: which calls, in which state."""

from __future__ import annotations

from mtp_operator import constants as c
from mtp_operator.reconcile import Cluster, phase_event, reconcile
from mtp_operator.revisions import group_template, revision_hash
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import SpecError, parse_spec


class RecordingKube:
    """Records the calls kube.KubeApi would make; `exists` makes create_job report a conflict."""

    def __init__(self, exists=False):
        self.calls = []
        self.exists = exists

    def create_job(self, namespace, body):
        self.calls.append(("create_job", body["metadata"]["name"]))
        return not self.exists

    def apply_service(self, namespace, body):
        self.calls.append(("apply_service", body["metadata"]["name"]))

    def apply_statefulset(self, namespace, body):
        self.calls.append(("apply_statefulset", body["metadata"]["name"]))

    def delete_pods(self, namespace, label_selector):
        self.calls.append(("delete_pods", label_selector))

    def delete_statefulset(self, namespace, name):
        self.calls.append(("delete_statefulset", name))

    def create_controller_revision(self, namespace, body):
        self.calls.append(("create_controller_revision", body["metadata"]["name"]))
        return True

    def delete_controller_revision(self, namespace, name):
        self.calls.append(("delete_controller_revision", name))


SETTINGS = OperatorSettings(probe_pods=False)


def revision_of(cr):
    """The ControllerRevision summary an index would hold for the CR's current spec (none if invalid)."""
    try:
        template = group_template(parse_spec(cr["spec"]))
    except SpecError:
        return None
    rev = revision_hash(template)
    return {"name": f"ds-{rev}", "hash": rev, "revision": 1, "spec": template}


def step(cr, kube, jobs=(), pods=(), statefulsets=()):
    revision = revision_of(cr)
    cluster = Cluster(kube, SETTINGS, list(jobs), list(pods), list(statefulsets), [revision] if revision else [])
    return reconcile(cr, cluster, None, now=1000.0)


def test_first_reconcile_keeps_the_revision_in_a_controller_revision(make_cr):
    kube = RecordingKube()
    out = reconcile(make_cr(), Cluster(kube, SETTINGS), None, now=1000.0)
    rev = out.status["updateRevision"]
    assert kube.calls[0] == ("create_controller_revision", f"ds-{rev}") and out.status["currentRevision"] == rev


def cond(status, ctype):
    return next(x for x in status["conditions"] if x["type"] == ctype)


def test_invalid_spec_fails_without_api_calls(make_cr):
    kube = RecordingKube()
    out = step(make_cr(changes={"nnodes": 0}), kube)
    assert kube.calls == [] and out.status["phase"] == "Failed"
    assert cond(out.status, "Ready")["reason"] == "InvalidSpec" and "spec.nnodes" in cond(out.status, "Ready")["message"]
    assert cond(out.status, "DraftReady")["status"] == "False"


def test_rules_the_api_server_cannot_check_fail_the_spec(make_cr):
    """The CRD admits these (operator settings, mtp serve's own validator); the reconcile refuses them."""
    kube = RecordingKube()
    settings = OperatorSettings(probe_pods=False, allowed_host_path_prefixes=("/mnt/models",))
    cr = make_cr(changes={"model": {"volume": {"claimName": None, "hostPath": "/srv/models"}}})
    out = reconcile(cr, Cluster(kube, settings), None, now=1000.0)
    assert kube.calls == [] and out.status["phase"] == "Failed"
    assert "spec.model.volume.hostPath: /srv/models is outside" in cond(out.status, "Ready")["message"]
    out = step(make_cr(changes={"runtime": {"blockSize": 4096}}), kube)
    assert kube.calls == [] and "spec.runtime.blockSize: " in cond(out.status, "Ready")["message"]


def test_api_key_secret_never_reaches_status_or_events(make_cr):
    out = step(make_cr(changes={"apiKeySecret": {"name": "mtp-api", "key": "token"}}), RecordingKube())
    text = repr(out.status) + repr(out.events)
    assert "mtp-api" not in text and "token" not in text


def test_unlaunchable_spec_names_the_field(make_cr):
    cr = make_cr(changes={"engine": "vllm", "accelerator": {"resourceName": "nvidia.com/gpu", "count": 8},
                          "runtime": {"dpSize": 3}})
    out = step(cr, RecordingKube())
    assert out.status["phase"] == "Failed" and "spec.runtime.dpSize=3" in cond(out.status, "Ready")["message"]


def test_export_job_created_once_then_group_applied_once(make_cr):
    cr = make_cr()
    kube = RecordingKube()
    first = step(cr, kube)
    job = kube.calls[0][1]
    assert kube.calls == [("create_job", job)] and first.status["phase"] == "Exporting"
    assert ("Normal", "ExportStarted", f"created export job {job}") in first.events

    kube = RecordingKube()
    running = step({**cr, "status": first.status}, kube, jobs=[{"name": job, "succeeded": False, "failed": False}])
    assert kube.calls == [] and running.status["phase"] == "Exporting"

    kube = RecordingKube()
    done = [{"name": job, "succeeded": True, "failed": False}]
    ready = step({**cr, "status": running.status}, kube, jobs=done)
    assert kube.calls == [("apply_service", "ds-ranks"), ("apply_service", "ds"), ("apply_statefulset", "ds")]
    assert ready.status["phase"] == "Starting" and ready.status["appliedHash"]

    kube = RecordingKube()
    again = step({**cr, "status": ready.status}, kube, jobs=done,
                 statefulsets=[{"name": "ds", "group": 0, "revision": ready.status["updateRevision"]}])
    assert kube.calls == [] and again.status == ready.status  # level-based: nothing to change


def test_existing_job_after_restart_is_not_an_error(make_cr):
    kube = RecordingKube(exists=True)  # the index has not caught up; the API answers 409
    out = step(make_cr(), kube)
    assert kube.calls[0][0] == "create_job" and not out.events and out.status["phase"] == "Exporting"


def test_stale_pods_roll_the_whole_group(make_cr):
    cr = make_cr(changes={"export": None, "draftModel": {"path": "/models/d"}})
    pods = [{"name": f"ds-{r}", "uid": f"u{r}", "component": c.COMPONENT_SERVER, "rank": r, "templateHash": "old",
             "ready": True, "restarts": 0, "terminating": False, "podIP": "10.0.0.1", "jobName": None,
             "terminationMessage": "", "group": 0} for r in (0, 1)]
    kube = RecordingKube()
    out = step(cr, kube, pods=pods, statefulsets=[{"name": "ds", "group": 0}])
    deletes = [sel for name, sel in kube.calls if name == "delete_pods"]
    assert len(deletes) == 1 and f"{c.LABEL_TEMPLATE_HASH}!={out.status['templateHash']}" in deletes[0]
    assert out.status["phase"] == "Starting"


def test_phase_events():
    assert phase_event({"phase": "Starting"}, {"phase": "Starting"}) is None
    kind, reason, message = phase_event({"phase": "Running"}, {"phase": "Failed", "conditions": [
        {"type": "Ready", "message": "export failed"}]})
    assert (kind, reason) == ("Warning", "PhaseFailed") and "Running -> Failed: export failed" == message


def test_a_one_group_deployment_from_before_fleets_keeps_serving(make_cr):
    """The previous release's objects: StatefulSet `ds` and pods without group labels or revisions, the
    gang record at the top of status. The upgraded operator adopts them as group 0: no pod is deleted,
    no rollout starts, the gang record carries over, the StatefulSet keeps its name and selector."""
    cr = make_cr(changes={"export": None, "draftModel": {"path": "/models/d"}})
    kube = RecordingKube()
    plan_hash = step(cr, kube).status["templateHash"]
    members = {"0": "u0/0", "1": "u1/0"}
    old_status = {"phase": "Running", "templateHash": plan_hash, "appliedHash": "from-the-old-release",
                  "gang": {"members": members, "restarts": 1}}
    pods = [{"name": f"ds-{r}", "uid": f"u{r}", "component": c.COMPONENT_SERVER, "rank": r, "templateHash": plan_hash,
             "ready": True, "restarts": 0, "terminating": False, "podIP": "10.0.0.1", "jobName": None,
             "terminationMessage": "", "group": 0} for r in (0, 1)]  # pod_summary's group for an unlabelled pod
    kube = RecordingKube()
    out = step({**cr, "status": old_status}, kube, pods=pods,
               statefulsets=[{"name": "ds", "templateHash": plan_hash, "group": 0, "revision": None}])
    assert not [call for call in kube.calls if call[0] in ("delete_pods", "delete_statefulset")]
    assert ("apply_statefulset", "ds") in kube.calls  # relabelled in place (OnDelete: its pods stay)
    status = out.status
    assert status["phase"] == "Running" and status["currentRevision"] == status["updateRevision"]
    assert "rollout" not in status and status["groups"][0]["gang"]["members"] == members
    assert status["groups"][0]["restarts"] == 1 and "gang" not in status


def test_client_service_selects_rank_0_of_every_group(make_cr):
    from mtp_operator.manifests import build_client_service, build_statefulset
    from mtp_operator.plan import kubernetes_master_host, plan_deployment

    spec = parse_spec(make_cr(changes={"replicas": 3})["spec"])
    service = None
    for group in range(3):
        plan = plan_deployment("ds", "default", spec, master_host=kubernetes_master_host("ds", "default", group),
                               settings=SETTINGS)
        service = service or build_client_service(plan, spec, {"metadata": {"name": "ds", "namespace": "default", "uid": "u"}})
        sts = build_statefulset(plan, spec, {"metadata": {"name": "ds", "namespace": "default", "uid": "u"}}, SETTINGS,
                                group=group, revision="r1")
        labels = sts["spec"]["template"]["metadata"]["labels"]
        selector = service["spec"]["selector"]
        for rank in range(spec.nnodes):
            pod_labels = {**labels, c.LABEL_POD_INDEX: str(rank)}
            selected = all(pod_labels.get(k) == v for k, v in selector.items())
            assert selected == (rank == 0), (group, rank)
        # Readiness gates the endpoints: rank 0's probe is /health, 200 only once its whole group is up.
        assert sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
        assert sts["metadata"]["name"] == ("ds" if group == 0 else f"ds-g{group}")


def test_a_new_revision_exporting_leaves_the_serving_fleet_ready(make_cr):
    """A spec change with a new export: the old revision's groups keep serving, so Ready stays True
    and Progressing says the export runs; nothing rolls until the draft is ready."""
    cr = make_cr()
    kube = RecordingKube()
    job = step(cr, kube).status["exportJob"]
    done = [{"name": job, "succeeded": True, "failed": False}]
    first = step(cr, RecordingKube(), jobs=done)
    rev = first.status["updateRevision"]
    plan_hash = first.status["groups"][0]["templateHash"]
    pods = [{"name": f"ds-{r}", "uid": f"u{r}", "component": c.COMPONENT_SERVER, "rank": r, "templateHash": plan_hash,
             "ready": True, "restarts": 0, "terminating": False, "podIP": "10.0.0.1", "jobName": None,
             "terminationMessage": "", "group": 0} for r in (0, 1)]
    sets = [{"name": "ds", "group": 0, "revision": rev, "templateHash": plan_hash}]
    running = step({**cr, "status": first.status}, RecordingKube(), jobs=done, pods=pods, statefulsets=sets)
    assert running.status["phase"] == "Running"
    changed = make_cr(changes={"export": {"outputPath": "/models/ds-mtp2"}}, generation=2)
    kube = RecordingKube()
    out = reconcile({**changed, "status": running.status}, Cluster(kube, SETTINGS, done, pods, sets,
                                                                   [revision_of(cr), revision_of(changed)]),
                    None, now=1000.0)
    assert [call[0] for call in kube.calls].count("create_job") == 1
    assert not [call for call in kube.calls if call[0] == "delete_pods"], "nothing rolls before the draft exists"
    assert out.status["phase"] == "Running" and cond(out.status, "Ready")["status"] == "True"
    assert cond(out.status, "Ready")["reason"] == "GroupsServing"
    assert cond(out.status, "DraftReady")["status"] == "False" and cond(out.status, "Progressing")["status"] == "True"
    assert out.status["currentRevision"] == rev != out.status["updateRevision"]
