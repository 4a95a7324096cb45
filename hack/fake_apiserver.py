"""A minimal in-memory Kubernetes API server for the operator benchmark.

Just enough of the API for kopf and the official client: discovery, and per
resource list / watch (resourceVersion-aware replay) / get / create / merge
patch (incl. /status) / delete / deletecollection with label selectors.
Every write bumps a global resourceVersion; creates assign uid, generation
and creationTimestamp; spec patches bump generation. Each request costs O(1)
in the number of past requests (kmock rescans its request history when
matching reactions, which dominates at hundreds of objects).

    server = FakeApiServer(resources)       # {"v1/pods": ("Pod", True), ...}
    url = await server.start()              # http://127.0.0.1:PORT
    server.objects[("batch/v1/jobs", ns, name)]
    server.on_create.append(callback)       # callback(resource_key, obj), e.g. a fake Job controller
"""

from __future__ import annotations

import asyncio
import copy
import json
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


def json_patch(target: dict, ops: list[dict]) -> dict:
    """RFC 6902 add/replace/remove/test (what kopf sends for finalizers); raises ValueError on a failed test."""
    doc = copy.deepcopy(target)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if op["op"] == "test":
            current = node[int(last)] if isinstance(node, list) else node.get(last)
            if current != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        elif op["op"] in ("add", "replace"):
            if isinstance(node, list):
                node.append(op["value"]) if last == "-" else node.insert(int(last), op["value"])
            else:
                node[last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
    return doc


def label_match(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key) != value.lstrip("="):
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
        self.on_create: list[Callable[[str, dict], Any]] = []
        self.runner: web.AppRunner | None = None

    # --- storage -----------------------------------------------------------
    def _bump(self, obj: dict) -> None:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)

    async def _emit(self, key: str, kind: str, obj: dict) -> None:
        self.events[key].append((self.version, {"type": kind, "object": copy.deepcopy(obj)}))
        cond = self.changed.setdefault(key, asyncio.Condition())
        async with cond:
            cond.notify_all()

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
        while True:
            log = self.events[key]
            while position < len(log):
                version, event = log[position]
                position += 1
                ns = event["object"]["metadata"].get("namespace")
                if version > since and (namespace is None or ns == namespace):
                    await response.write(json.dumps(event).encode() + b"\n")
            async with cond:
                if position >= len(self.events[key]):
                    await cond.wait()

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
        if self.runner is not None:
            await self.runner.cleanup()
