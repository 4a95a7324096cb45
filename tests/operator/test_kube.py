"""kube.py: the one module with API calls, exercised against a loopback HTTP server."""

from __future__ import annotations

import http.server
import json
import re
from pathlib import Path

import pytest
from kubernetes import client

from mtp_operator import kube
from mtp_operator.kube import KubeApi, selector
from mtp_operator.manifests import build_client_service, build_statefulset
from mtp_operator.plan import plan_deployment
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import parse_spec

SOURCE = Path(kube.__file__).read_text()


class Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []
    conflict = True

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        Recorder.seen.append((self.command, self.path, self.headers.get("Content-Type"), body))
        code = 409 if self.command == "POST" and Recorder.conflict and "/events" not in self.path else 200
        payload = {"kind": "Status", "code": code} if code == 409 else {"metadata": {"name": "x"}}
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_PATCH = do_DELETE = _answer



@pytest.fixture
def api(serve_http):
    Recorder.seen = []
    with serve_http(Recorder) as port:
        yield KubeApi(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))


def test_selector():
    assert selector({"a": "b", "c": "d"}, {"h": "x"}) == "a=b,c=d,h!=x"


def test_create_job_conflict_means_exists(api):
    assert api.create_job("ns", {"metadata": {"name": "j"}}) is False
    Recorder.conflict = False
    try:
        assert api.create_job("ns", {"metadata": {"name": "j"}}) is True
    finally:
        Recorder.conflict = True


def test_apply_falls_back_to_merge_patch(api, make_cr):
    cr = make_cr(namespace="ns")
    spec = parse_spec(cr["spec"])
    plan = plan_deployment("ds", "ns", spec, master_host="h")
    sts = build_statefulset(plan, spec, cr, OperatorSettings())
    api.apply_statefulset("ns", sts)
    api.apply_service("ns", build_client_service(plan, spec, cr))
    assert Recorder.seen[1][3]["spec"]["template"]["spec"]["containers"][0]["args"] == \
        sts["spec"]["template"]["spec"]["containers"][0]["args"]  # sent as built, nothing dropped
    methods = [(m, p.split("?")[0], ct if m == "PATCH" else "") for m, p, ct, _ in Recorder.seen]
    assert methods == [  # POST bodies are JSON; the API server's default for a create
        ("POST", "/apis/apps/v1/namespaces/ns/statefulsets", ""),
        ("PATCH", "/apis/apps/v1/namespaces/ns/statefulsets/ds", "application/merge-patch+json"),
        ("POST", "/api/v1/namespaces/ns/services", ""),
        ("PATCH", "/api/v1/namespaces/ns/services/ds", "application/merge-patch+json"),
    ]


def test_delete_pods_is_one_collection_call_and_events_post(api):
    api.delete_pods("ns", "a=b,h!=x")
    method, path, _, _ = Recorder.seen[-1]
    assert method == "DELETE" and path.startswith("/api/v1/namespaces/ns/pods?")
    assert "labelSelector=a%3Db%2Ch%21%3Dx" in path
    api.post_event({"metadata": {"name": "ds", "namespace": "ns", "uid": "u"}}, "PhaseRunning", "ok")
    _, path, _, body = Recorder.seen[-1]
    assert path == "/api/v1/namespaces/ns/events" and body["involvedObject"]["kind"] == "MtpDeployment"


def test_docstring_lists_every_client_call():
    calls = set(re.findall(r"self\.(?:core|batch|apps)\.([a-z_]+)\(", SOURCE))
    docstring = kube.__doc__
    assert calls and all(name in docstring for name in calls), calls
    listed = set(re.findall(r"\b((?:create|patch|delete|delete_collection|read|list|replace)_namespaced_[a-z_]+)",
                            docstring))
    assert listed == calls
