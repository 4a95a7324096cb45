"""A minimal in-memory Kubernetes API server for the operator benchmark.

Just enough of the API for kopf and the official client: discovery, and per
resource list / watch (resourceVersion-aware replay) / get / create / merge
patch (incl. /status) / delete / deletecollection with label selectors
(equality and set-based: `k=v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`).
Every write bumps a global resourceVersion; creates assign uid, generation
and creationTimestamp; spec patches bump generation. Each request costs O(1)
in the number of past requests (kmock rescans its request history when
matching reactions, which dominates at hundreds of objects).

    server = FakeApiServer(resources)       # {"v1/pods": ("Pod", True), ...}
    url = await server.start()              # http://127.0.0.1:PORT
    server.objects[("batch/v1/jobs", ns, name)]
    server.on_create.append(callback)       # callback(resource_key, obj), e.g. a fake Job controller
    server.on_event.append(callback)        # callback(resource_key, "ADDED"|"MODIFIED"|"DELETED", obj)
    StatefulSetController(server)           # plays the StatefulSet controller (pods, its ControllerRevisions)
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
import json
import re
import uuid
from datetime import datetime, timezone
from typing import Any, Callable

from aiohttp import web


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    *parents, last = _pointer(path)
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    return node, last


def _get(doc: Any, path: str) -> Any:
    node, last = _parent(doc, path)
    return node[int(last)] if isinstance(node, list) else node.get(last)


def _remove(doc: Any, path: str) -> Any:
    node, last = _parent(doc, path)
    return node.pop(int(last) if isinstance(node, list) else last)


def _add(doc: Any, path: str, value: Any, replace: bool = False) -> None:
    node, last = _parent(doc, path)
    if not isinstance(node, list):
        node[last] = value
    elif last == "-":
        node.append(value)
    elif replace:
        node[int(last)] = value
    else:
        node.insert(int(last), value)


def json_patch(target: dict, ops: list[dict]) -> dict:
    """RFC 6902 (kopf sends it for finalizers and for our conditions, led by a resourceVersion test);
    raises ValueError on a failed test."""
    doc = copy.deepcopy(target)
    for op in ops:
        kind, path = op["op"], op["path"]
        if kind == "test":
            if _get(doc, path) != op["value"]:
                raise ValueError(f"test failed at {path}")
        elif kind in ("add", "replace"):
            _add(doc, path, copy.deepcopy(op["value"]), replace=kind == "replace")
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "move":
            _add(doc, path, _remove(doc, op["from"]))
        elif kind == "copy":
            _add(doc, path, copy.deepcopy(_get(doc, op["from"])))
        else:
            raise ValueError(f"unknown JSON patch op {kind!r} at {path}")
    return doc


_SET_TERM = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _terms(selector: str) -> list[str]:
    """Split a selector at the commas outside parentheses (`k in (a,b)` is one term)."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return [t.strip() for t in terms if t.strip()]


def label_match(labels: dict[str, str], selector: str) -> bool:
    for term in _terms(selector):
        set_term = _SET_TERM.match(term)
        if set_term:
            key, op, values = set_term.groups()
            listed = {v.strip() for v in values.split(",") if v.strip()}
            if op == "in" and labels.get(key) not in listed:
                return False
            if op == "notin" and key in labels and labels[key] in listed:
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.strip()) != value.lstrip("=").strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeApiServer:
    def __init__(self, resources: dict[str, tuple[str, bool]]):
        self.resources = resources  # "group/version/plural" or "v1/plural" -> (kind, namespaced)
        self.objects: dict[tuple[str, str | None, str], dict] = {}
        self.events: dict[str, list[tuple[int, dict]]] = {key: [] for key in resources}
        self.changed: dict[str, asyncio.Condition] = {}
        self.version = 0
        self.requests = 0
        self.request_counts: collections.Counter[str] = collections.Counter()  # "VERB resource": calls
        self.on_create: list[Callable[[str, dict], Any]] = []
        self.on_event: list[Callable[[str, str, dict], Any]] = []  # after every stored change
        self.runner: web.AppRunner | None = None
        self.stopping = False  # ends every watch stream (else stop() waits out aiohttp's shutdown timeout)

    # --- storage -----------------------------------------------------------
    def _bump(self, obj: dict) -> None:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)

    async def _emit(self, key: str, kind: str, obj: dict) -> None:
        self.events[key].append((self.version, {"type": kind, "object": copy.deepcopy(obj)}))
        cond = self.changed.setdefault(key, asyncio.Condition())
        async with cond:
            cond.notify_all()
        for callback in self.on_event:
            callback(key, kind, obj)

    # --- routing -----------------------------------------------------------
    def _parse(self, request: web.Request) -> tuple[str, str | None, str | None, str | None]:
        parts = [p for p in request.path.split("/") if p]
        prefix = parts[:2] if parts[0] == "api" else parts[:3]
        rest = parts[len(prefix):]
        group_version = "/".join(prefix[1:])
        namespace = None
        if rest and rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        key = f"{group_version}/{rest[0]}"
        if key not in self.resources:
            raise web.HTTPNotFound(text=f"unknown resource {key}")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        return key, namespace, name, sub

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        parts = [p for p in request.path.split("/") if p]
        if request.path == "/version":
            return web.json_response({"major": "1", "minor": "30", "gitVersion": "v1.30.0"})
        if parts in (["api"], ["apis"]) or (len(parts) == 2 and parts[0] == "api") or \
                (len(parts) in (2, 3) and parts[0] == "apis"):
            return web.json_response(self._discovery(parts))
        key, namespace, name, sub = self._parse(request)
        method = request.method
        verb = {"GET": "watch" if request.query.get("watch") in ("true", "1") else ("list" if name is None else "get"),
                "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())
        self.request_counts[f"{verb} {key.rsplit('/', 1)[1]}{'/' + sub if sub else ''}"] += 1
        if method == "GET" and name is None:
            if request.query.get("watch") in ("true", "1"):
                return await self._watch(request, key, namespace)
            return web.json_response(self._list(key, namespace, request.query.get("labelSelector", "")))
        if method == "GET":
            return web.json_response(self._get(key, namespace, name))
        if method == "POST":
            return web.json_response(await self._create(key, namespace, await request.json()), status=201)
        if method == "PATCH":
            return web.json_response(await self._patch(key, namespace, name, sub, await request.json()))
        if method == "DELETE" and name is None:
            return web.json_response(await self._delete_collection(key, namespace,
                                                                   request.query.get("labelSelector", "")))
        if method == "DELETE":
            return web.json_response(await self._delete(key, namespace, name))
        raise web.HTTPMethodNotAllowed(method, ["GET", "POST", "PATCH", "DELETE"])

    def _discovery(self, parts: list[str]) -> dict:
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"]}
        groups: dict[str, set[str]] = {}
        for key in self.resources:
            gv = key.rsplit("/", 1)[0]
            if "/" in gv:
                group, version = gv.split("/")
                groups.setdefault(group, set()).add(version)
        if parts == ["apis"]:
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in sorted(vs)],
                 "preferredVersion": {"groupVersion": f"{g}/{sorted(vs)[0]}", "version": sorted(vs)[0]}}
                for g, vs in groups.items()]}
        if parts[0] == "apis" and len(parts) == 2:
            vs = sorted(groups.get(parts[1], []))
            return {"kind": "APIGroup", "apiVersion": "v1", "name": parts[1],
                    "versions": [{"groupVersion": f"{parts[1]}/{v}", "version": v} for v in vs],
                    "preferredVersion": {"groupVersion": f"{parts[1]}/{vs[0]}", "version": vs[0]}}
        gv = "/".join(parts[1:])
        listed = []
        for key, (kind, namespaced) in self.resources.items():
            if key.rsplit("/", 1)[0] != gv:
                continue
            plural = key.rsplit("/", 1)[1]
            verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "watch"]
            listed.append({"name": plural, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                           "verbs": verbs})
            listed.append({"name": f"{plural}/status", "singularName": "", "namespaced": namespaced,
                           "kind": kind, "verbs": ["get", "patch"]})
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": listed}

    # --- verbs -------------------------------------------------------------
    def _selected(self, key: str, namespace: str | None, selector: str) -> list[dict]:
        return [obj for (k, ns, _), obj in self.objects.items()
                if k == key and (namespace is None or ns == namespace)
                and label_match(obj["metadata"].get("labels") or {}, selector)]

    def _list(self, key: str, namespace: str | None, selector: str) -> dict:
        return {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)},
                "items": self._selected(key, namespace, selector)}

    def _get(self, key: str, namespace: str | None, name: str) -> dict:
        obj = self.objects.get((key, namespace, name))
        if obj is None:
            raise web.HTTPNotFound(text=json.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}),
                                   content_type="application/json")
        return obj

    async def _create(self, key: str, namespace: str | None, body: dict) -> dict:
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta["namespace"] = namespace
        if (key, namespace, meta["name"]) in self.objects:
            raise web.HTTPConflict(text=json.dumps({"kind": "Status", "code": 409, "reason": "AlreadyExists"}),
                                   content_type="application/json")
        meta.update(uid=str(uuid.uuid4()), generation=1,
                    creationTimestamp=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        self._bump(body)
        self.objects[(key, namespace, meta["name"])] = body
        await self._emit(key, "ADDED", body)
        for callback in self.on_create:
            callback(key, body)
        return body

    async def _patch(self, key: str, namespace: str | None, name: str, sub: str | None, patch: Any) -> dict:
        old = self._get(key, namespace, name)
        if isinstance(patch, list):
            try:
                new = json_patch(old, patch)
            except ValueError as exc:
                raise web.HTTPUnprocessableEntity(text=json.dumps({"kind": "Status", "code": 422,
                                                                   "message": str(exc)}),
                                                  content_type="application/json") from None
        else:
            if sub == "status":
                patch = {"status": patch.get("status")} if "status" in patch else {}
            new = merge_patch(old, patch)
        if sub is None and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._bump(new)
        self.objects[(key, namespace, name)] = new
        await self._emit(key, "MODIFIED", new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return await self._delete(key, namespace, name)
        return new

    async def _delete(self, key: str, namespace: str | None, name: str) -> dict:
        obj = self._get(key, namespace, name)
        if obj["metadata"].get("finalizers"):  # wait for the finalizers' owners to release it
            if not obj["metadata"].get("deletionTimestamp"):
                now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                return await self._patch(key, namespace, name, None, {"metadata": {"deletionTimestamp": now}})
            return obj
        self.objects.pop((key, namespace, name))
        self._bump(obj)
        await self._emit(key, "DELETED", obj)
        return obj

    async def _delete_collection(self, key: str, namespace: str | None, selector: str) -> dict:
        gone = self._selected(key, namespace, selector)
        for obj in gone:
            await self._delete(key, namespace, obj["metadata"]["name"])
        return {"kind": "List", "apiVersion": "v1", "items": gone}

    async def _watch(self, request: web.Request, key: str, namespace: str | None) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        since = int(request.query.get("resourceVersion") or self.version)
        cond = self.changed.setdefault(key, asyncio.Condition())
        position = 0
        while not self.stopping:
            log = self.events[key]
            while position < len(log):
                version, event = log[position]
                position += 1
                ns = event["object"]["metadata"].get("namespace")
                if version > since and (namespace is None or ns == namespace):
                    await response.write(json.dumps(event).encode() + b"\n")
            async with cond:
                if position >= len(self.events[key]) and not self.stopping:
                    await cond.wait()
        return response

    async def start(self, host: str = "127.0.0.1") -> str:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://{host}:{port}"

    async def stop(self) -> None:
        self.stopping = True
        for cond in self.changed.values():
            async with cond:
                cond.notify_all()
        if self.runner is not None:
            await self.runner.cleanup()


POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
REVISION_HASH_LABEL = "controller-revision-hash"  # what the real controller puts on its pods and revisions


class StatefulSetController:
    """The StatefulSet controller's part, at once and for every StatefulSet (a fleet's groups too).

    OnDelete, as the operator's StatefulSets are: pod `<set>-<i>` for each i < replicas, made from the
    template the StatefulSet has when the pod is (re)created; a deleted pod comes back from the current
    template, pods beyond `replicas` are deleted, and so are a deleted StatefulSet's pods. Pods are
    Running and Ready at once (`ready=False`: Running, not Ready). Like the real controller it also
    records each template as a ControllerRevision `<set>-<hash>` labelled with the template's labels
    (so an operator must tell those from its own), and keeps `status` (replicas, readyReplicas,
    currentRevision) up to date.
    """

    STS, PODS, REVISIONS = "apps/v1/statefulsets", "v1/pods", "apps/v1/controllerrevisions"

    def __init__(self, server: FakeApiServer, ready: bool = True, pod_ip: str = "127.0.0.1"):
        self.server, self.ready, self.pod_ip = server, ready, pod_ip
        self.pending: set[tuple[str, str]] = set()
        self.tasks: set[asyncio.Task] = set()
        self.pods_created = 0
        server.on_event.append(self.observe)

    def observe(self, key: str, kind: str, obj: dict) -> None:
        meta = obj["metadata"]
        if key == self.STS:
            self._schedule(meta["namespace"], meta["name"])
        elif key == self.PODS and kind == "DELETED":
            owner = next((ref["name"] for ref in meta.get("ownerReferences") or []
                          if ref.get("kind") == "StatefulSet"), None)
            if owner is not None:
                self._schedule(meta["namespace"], owner)

    def _schedule(self, namespace: str, name: str) -> None:
        if (namespace, name) in self.pending:
            return
        self.pending.add((namespace, name))
        task = asyncio.get_running_loop().create_task(self.sync(namespace, name))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def sync(self, namespace: str, name: str) -> None:
        self.pending.discard((namespace, name))
        objects = self.server.objects
        sts = objects.get((self.STS, namespace, name))
        if sts is None:  # deleted: its pods go with it (the garbage collector's part)
            for (key, ns, pod_name), pod in list(objects.items()):
                if key == self.PODS and ns == namespace and any(
                        ref.get("kind") == "StatefulSet" and ref.get("name") == name
                        for ref in pod["metadata"].get("ownerReferences") or []):
                    await self.server._delete(self.PODS, namespace, pod_name)
            return
        template = sts["spec"]["template"]
        revision = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        revision_name = f"{name}-{revision}"
        if (self.REVISIONS, namespace, revision_name) not in objects:
            await self.server._create(self.REVISIONS, namespace, {
                "apiVersion": "apps/v1", "kind": "ControllerRevision",
                "metadata": {"name": revision_name, "namespace": namespace,
                             "labels": {**(template["metadata"].get("labels") or {}), REVISION_HASH_LABEL: revision},
                             "ownerReferences": [self._owner(sts)]},
                "data": {"spec": {"template": template}}, "revision": sts["metadata"].get("generation", 1)})
        replicas = sts["spec"].get("replicas", 1)
        for index in range(replicas):
            if (self.PODS, namespace, f"{name}-{index}") not in objects:
                await self.server._create(self.PODS, namespace, self._pod(sts, index, revision))
                self.pods_created += 1
        index = replicas
        while (self.PODS, namespace, f"{name}-{index}") in objects:
            await self.server._delete(self.PODS, namespace, f"{name}-{index}")
            index += 1
        status = {"replicas": replicas, "readyReplicas": replicas if self.ready else 0,
                  "currentRevision": revision_name, "updateRevision": revision_name,
                  "observedGeneration": sts["metadata"].get("generation", 1)}
        if (sts.get("status") or {}) != status and (self.STS, namespace, name) in objects:
            await self.server._patch(self.STS, namespace, name, "status", {"status": status})

    @staticmethod
    def _owner(sts: dict) -> dict:
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"],
                "uid": sts["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}

    def _pod(self, sts: dict, index: int, revision: str) -> dict:
        template = copy.deepcopy(sts["spec"]["template"])
        name = f"{sts['metadata']['name']}-{index}"
        labels = {**(template["metadata"].get("labels") or {}), POD_INDEX_LABEL: str(index),
                  REVISION_HASH_LABEL: f"{sts['metadata']['name']}-{revision}",
                  "statefulset.kubernetes.io/pod-name": name}
        ready = "True" if self.ready else "False"
        containers = template["spec"].get("containers") or []
        meta = {"name": name, "labels": labels, "ownerReferences": [self._owner(sts)]}
        if template["metadata"].get("annotations"):
            meta["annotations"] = template["metadata"]["annotations"]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": template["spec"],
                "status": {"phase": "Running", "podIP": self.pod_ip, "conditions": [{"type": "Ready", "status": ready}],
                           "containerStatuses": [{"name": c.get("name", "server"), "restartCount": 0,
                                                  "ready": self.ready} for c in containers]}}
