"""The real kopf operator against kmock (an in-memory Kubernetes API on loopback).

kmock stores objects and streams watch events, but it does not assign uids,
bump resourceVersion/generation, expand generateName, or delete collections;
`ApiServer` fills exactly those gaps. `Controllers` plays the StatefulSet
controller (creates a pod per rank, recreates deleted ones) so whole-group
restarts can be observed end to end; tests mark readiness and Job results
themselves, as the kubelet and the Job controller would.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import aiohttp.web
import kmock
import pytest
import pytest_asyncio
from kmock._internal.dicts import patch_dict

from mtp_operator import constants as c
from mtp_operator.embedded import EmbeddedOperator
from mtp_operator.settings import OperatorSettings

NS = "default"
CR = f"{c.GROUP}/{c.VERSION}/{c.PLURAL}"
_versions = itertools.count(1)


def _load_fake_apiserver():
    """The benchmark's in-memory API server (hack/) holds the label-selector
    and JSON-patch code this emulator needs too; load it rather than copy it."""
    path = Path(__file__).resolve().parents[3] / "hack" / "fake_apiserver.py"
    spec = importlib.util.spec_from_file_location("mtp_fake_apiserver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fake = _load_fake_apiserver()
_matches = _fake.label_match
_json_patch = _fake.json_patch


class ApiServer(kmock.KubernetesEmulator):
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.method == "DELETE" and request.name is None:
            return await self._delete_collection(request)
        if request.resource is not None and request.method == "PATCH" and isinstance(request.data, list):
            return await self._json_patch(request)
        if request.resource is not None and isinstance(request.data, dict):
            self._fill_server_fields(request)
        return await super()._handle(request)

    def _fill_server_fields(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(_versions))
        if request.action == kmock.action.CREATE:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("namespace", request.namespace)
            meta["uid"] = str(uuid.uuid4())
            meta["generation"] = 1
            meta["creationTimestamp"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        elif request.action == kmock.action.UPDATE and request.subresource is None and "spec" in request.data:
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                old = self.objects[key].raw
                if patch_dict(json.loads(json.dumps(old.get("spec", {}))), request.data["spec"]) != old.get("spec"):
                    meta["generation"] = old["metadata"].get("generation", 1) + 1

    async def _json_patch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                return aiohttp.web.json_response({"kind": "Status", "code": 404}, status=404)
            try:
                new = _json_patch(self.objects[key].raw, request.data)
            except ValueError as exc:
                return aiohttp.web.json_response({"kind": "Status", "code": 422, "message": str(exc)}, status=422)
            new["metadata"]["resourceVersion"] = str(next(_versions))
            self.objects[key].create(new)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": new})
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                self.objects[key].delete()  # the last finalizer is gone: the deletion completes
                await self._buses[request.resource].put({"type": "DELETED", "object": new})
        return aiohttp.web.json_response(new)

    async def _delete_collection(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        selector = request.params.get("labelSelector", "")
        deleted = []
        async with self._lock:
            for (resource, namespace, _), obj in list(self.objects.items()):
                if resource != request.resource or namespace != request.namespace or obj.deleted:
                    continue
                raw = obj.raw
                if _matches(raw.get("metadata", {}).get("labels") or {}, selector):
                    obj.delete()
                    deleted.append(raw)
                    await self._buses[request.resource].put({"type": "DELETED", "object": raw})
        return aiohttp.web.json_response({"kind": "List", "apiVersion": "v1", "items": deleted})


def objects(server: ApiServer, resource: str, namespace: str = NS) -> list[dict]:
    wanted = kmock.resource(resource)
    return [obj.raw for (res, ns, _), obj in list(server.objects.items())
            if res == wanted and ns == namespace and not obj.deleted]


class Controllers:
    """The StatefulSet controller's part: one pod per rank, recreated when deleted."""

    def __init__(self, server: ApiServer):
        self.server = server
        self.created_pods = 0

    async def run(self) -> None:
        while True:
            for sts in objects(self.server, "apps/v1/statefulsets"):
                existing = {p["metadata"]["name"] for p in objects(self.server, "v1/pods")}
                for rank in range(sts["spec"]["replicas"]):
                    name = f"{sts['metadata']['name']}-{rank}"
                    if name not in existing:
                        await self.create_pod(sts, rank)
            await asyncio.sleep(0.05)

    async def create_pod(self, sts: dict, rank: int) -> None:
        labels = {**sts["spec"]["template"]["metadata"]["labels"], c.LABEL_POD_INDEX: str(rank)}
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{sts['metadata']['name']}-{rank}", "namespace": NS, "labels": labels},
                "spec": sts["spec"]["template"]["spec"],
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "False"}],
                           "containerStatuses": [{"name": "server", "restartCount": 0, "ready": False}]}}
        async with self.server.post(f"/api/v1/namespaces/{NS}/pods", json=body) as response:
            assert response.status == 200, await response.text()
        self.created_pods += 1


class Cluster:
    """Test-side handle: read objects, act as kubelet / Job controller / user."""

    def __init__(self, server: ApiServer, controllers: Controllers):
        self.server = server
        self.controllers = controllers

    def list(self, resource: str) -> list[dict]:
        return objects(self.server, resource)

    def get(self, resource: str, name: str) -> dict | None:
        return next((o for o in self.list(resource) if o["metadata"]["name"] == name), None)

    def cr(self, name: str) -> dict:
        return self.get(CR, name) or {}

    async def request(self, method: str, path: str, body: Any = None) -> dict:
        async with self.server.request(method, path, json=body,
                                       headers={"Content-Type": "application/merge-patch+json"}) as response:
            assert response.status < 300, f"{method} {path}: {response.status} {await response.text()}"
            return await response.json()

    async def create_cr(self, name: str, spec: dict) -> dict:
        body = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": NS},
                "spec": spec}
        return await self.request("POST", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{NS}/{c.PLURAL}", body)

    async def patch_cr(self, name: str, patch: dict) -> dict:
        return await self.request("PATCH", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{NS}/{c.PLURAL}/{name}", patch)

    async def finish_job(self, name: str, succeeded: bool, message: str = "") -> None:
        if not succeeded:
            job = self.get("batch/v1/jobs", name)
            labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name}
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"{name}-x1", "namespace": NS, "labels": labels},
                   "status": {"phase": "Failed", "containerStatuses": [{"name": "export", "restartCount": 0,
                              "state": {"terminated": {"exitCode": 1, "message": message}}}]}}
            await self.request("POST", f"/api/v1/namespaces/{NS}/pods", pod)
        condition = {"type": "Complete" if succeeded else "Failed", "status": "True"}
        status = {"succeeded": 1} if succeeded else {"failed": 2}
        await self.request("PATCH", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}/status",
                           {"status": {**status, "conditions": [condition]}})

    async def set_pod(self, name: str, ready: bool, restarts: int = 0) -> None:
        await self.request("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}/status", {"status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "server", "restartCount": restarts, "ready": ready}]}})

    def requests(self, method: str, path_part: str) -> list:
        return [r for r in list(self.server) if r.method == method and path_part in str(r.url.path)]


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(0.05)


def _declare_resources(server: ApiServer) -> None:
    info = kmock.ResourceInfo
    server.resources[CR] = info(kind=c.KIND, singular=c.SINGULAR, namespaced=True, shortnames=c.SHORT_NAMES,
                                subresources={"status"}, verbs={"list", "watch", "get", "patch", "create"})
    # Cluster-scoped resources that kopf's discovery expects to exist (never listed: scanning is off).
    server.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"list", "watch"})
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch"})
    for resource, kind in (("batch/v1/jobs", "Job"), ("v1/pods", "Pod"), ("apps/v1/statefulsets", "StatefulSet"),
                           ("apps/v1/controllerrevisions", "ControllerRevision"),
                           ("v1/services", "Service"), ("v1/events", "Event")):
        server.resources[resource] = info(kind=kind, namespaced=True, subresources={"status"},
                                          verbs={"list", "watch", "get", "patch", "create", "delete"})


@pytest.fixture
def operator_settings(request) -> OperatorSettings:
    """Fast intervals; a test changes any of them with indirect parametrisation (a dict of fields)."""
    fields = dict(namespace=(NS,), reconcile_interval=0.2, metrics_interval=0.3, gang_restart_budget=2,
                  gang_restart_backoff=0.0, health_timeout=1.0, metrics_timeout=1.0)
    return OperatorSettings(**{**fields, **getattr(request, "param", {})})


class OperatorProcess:
    """The real kopf operator in its own thread (EmbeddedOperator), started and stopped from async tests."""

    def __init__(self, settings: OperatorSettings):
        self.embedded = EmbeddedOperator(settings)

    async def start(self) -> None:
        await asyncio.to_thread(self.embedded.start)

    async def stop(self) -> None:
        await asyncio.to_thread(self.embedded.stop)


@pytest_asyncio.fixture
async def cluster(tmp_path, monkeypatch, operator_settings):
    async with ApiServer() as server, kmock.Server(server):
        _declare_resources(server)
        url = str(server.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "kmock", "user": "test", "namespace": NS}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        controllers = Controllers(server)
        controller_task = asyncio.create_task(controllers.run())
        operator = OperatorProcess(operator_settings)
        handle = Cluster(server, controllers)
        handle.operator = operator
        await operator.start()
        try:
            yield handle
        finally:
            await operator.stop()
            controller_task.cancel()
            await asyncio.gather(controller_task, return_exceptions=True)


class FakeRuntime:
    """Every rank's HTTP on one loopback port: /health and rank 0's /metrics."""

    def __init__(self) -> None:
        self.health_status = 200
        self.draft = 0
        self.accepted = 0
        self.port = 0

    def advance(self, draft: int, accepted: int) -> None:
        self.draft += draft
        self.accepted += accepted

    async def health(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"state": "ok"}, status=self.health_status)

    async def metrics(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        text = (f"# TYPE mtp_spec_decode_draft_tokens_total counter\nmtp_spec_decode_draft_tokens_total {self.draft}\n"
                f"# TYPE mtp_spec_decode_accepted_tokens_total counter\n"
                f"mtp_spec_decode_accepted_tokens_total {self.accepted}\n"
                f"# TYPE mtp_spec_decode_steps_total counter\nmtp_spec_decode_steps_total {self.draft}\n")
        return aiohttp.web.Response(text=text)


@pytest_asyncio.fixture
async def runtime():
    fake = FakeRuntime()
    app = aiohttp.web.Application()
    app.router.add_get("/health", fake.health)
    app.router.add_get("/metrics", fake.metrics)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = site._server.sockets[0].getsockname()[1]
    try:
        yield fake
    finally:
        await runner.cleanup()
