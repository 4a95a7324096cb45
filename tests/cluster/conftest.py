"""The real-control-plane tier: upstream kube-apiserver, kube-controller-manager and kwok.

One control plane per test session (hack/control_plane.py starts it from the
binaries hack/control-plane-bin.sh provides, building them once per version).
Each test gets its own namespace. Rank pods get kwok addresses in
127.1.0.0/16, so `RankServers` can serve a fake rank's /health and /metrics on
exactly a pod's IP: the operator's probes reach loopback and nothing else.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import threading
import time
import urllib.error
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from mtp_operator import constants as c
from mtp_operator.crd import CRD_FILE
from mtp_operator.embedded import EmbeddedOperator
from mtp_operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
CR_PATH = f"/apis/{c.GROUP}/{c.VERSION}"
pytestmark = pytest.mark.cluster


def _load_control_plane():
    path = REPO / "hack" / "control_plane.py"
    spec = importlib.util.spec_from_file_location("mtp_control_plane", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


control_plane_module = _load_control_plane()


class Kube:
    """Test-side API calls against the control plane (admin unless given a token)."""

    def __init__(self, plane, token: str | None = None):
        self.plane = plane
        self.token = token

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        return self.plane.request(method, path, body, token=self.token, content_type=content_type)

    def try_call(self, method: str, path: str, body: Any = None,
                 content_type: str = "application/json") -> tuple[int, Any]:
        """(HTTP status, parsed body) without raising on 4xx/5xx."""
        try:
            return 200, self.call(method, path, body, content_type)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                return exc.code, json.loads(text)
            except json.JSONDecodeError:
                return exc.code, text

    def get(self, path: str) -> dict | None:
        code, body = self.try_call("GET", path)
        if code == 404:
            return None
        assert code == 200, f"GET {path}: {code} {body}"
        return body

    def items(self, path: str, selector: str = "") -> list[dict]:
        query = f"?labelSelector={selector}" if selector else ""
        return self.call("GET", path + query)["items"]

    def merge_patch(self, path: str, patch: dict) -> dict:
        return self.call("PATCH", path, patch, content_type="application/merge-patch+json")

    # MtpDeployments --------------------------------------------------------------------------

    def cr_path(self, namespace: str, name: str = "") -> str:
        base = f"{CR_PATH}/namespaces/{namespace}/{c.PLURAL}"
        return f"{base}/{name}" if name else base

    def create_cr(self, namespace: str, name: str, spec: dict, dry_run: bool = False) -> tuple[int, Any]:
        body = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": namespace},
                "spec": spec}
        query = "?fieldValidation=Strict" + ("&dryRun=All" if dry_run else "")
        return self.try_call("POST", self.cr_path(namespace) + query, body)

    def cr(self, namespace: str, name: str) -> dict:
        return self.get(self.cr_path(namespace, name)) or {}

    # Helpers for the tests (test modules cannot import each other or this file).

    @staticmethod
    def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
        return eventually(check, timeout, what)

    @staticmethod
    def condition(cr: dict, ctype: str) -> dict:
        return condition(cr, ctype)


def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "", interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except urllib.error.HTTPError as exc:  # e.g. a 404 before an object exists
            last = f"HTTP {exc.code}"
        if last and not isinstance(last, str):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or check} (last: {last!r})")
        time.sleep(interval)


def condition(cr: dict, ctype: str) -> dict:
    return next((x for x in cr.get("status", {}).get("conditions", []) if x["type"] == ctype), {})


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    plane = control_plane_module.ControlPlane(control_plane_module.binaries_dir(),
                                              tmp_path_factory.mktemp("control-plane"), nodes=2)
    started = time.monotonic()
    plane.start()
    print(f"\ncontrol plane up in {time.monotonic() - started:.1f}s at {plane.url} (logs: {plane.work_dir})")
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kube(control_plane) -> Kube:
    return Kube(control_plane)


def wait_established(kube: Kube, name: str) -> dict:
    def established() -> dict | None:
        crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}") or {}
        conditions = (crd.get("status") or {}).get("conditions") or []
        return crd if any(x["type"] == "Established" and x["status"] == "True" for x in conditions) else None

    return eventually(established, 60, f"CRD {name} Established")


@pytest.fixture(scope="session")
def crd(kube) -> dict:
    """The generated CRD (crds/), created once and Established."""
    body = yaml.safe_load((REPO / CRD_FILE).read_text())
    code, answer = kube.try_call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body)
    assert code in (200, 201), f"the API server refused the CRD: {answer}"
    established = wait_established(kube, body["metadata"]["name"])
    # Discovery of the new resource lags Established by a moment; wait until it is served.
    eventually(lambda: kube.try_call("GET", f"{CR_PATH}/{c.PLURAL}")[0] == 200, 30, "the CR's REST endpoint")
    return established


_namespaces = itertools.count()


@pytest.fixture
def namespace(kube, crd) -> str:
    name = f"t{next(_namespaces)}-{uuid.uuid4().hex[:6]}"
    kube.call("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    eventually(lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 30,
               f"namespace {name}'s default ServiceAccount")
    yield name
    kube.try_call("DELETE", f"/api/v1/namespaces/{name}")


def operator_settings(namespace: str, **overrides: Any) -> OperatorSettings:
    values = dict(namespace=(namespace,), reconcile_interval=0.5, metrics_interval=1.0, gang_restart_budget=3,
                  gang_restart_backoff=0.0, health_timeout=1.0, metrics_timeout=1.0)
    values.update(overrides)
    return OperatorSettings(**values)


@pytest.fixture
def run_operator(control_plane, tmp_path):
    """run_operator(namespace, token=None, **settings) -> a started EmbeddedOperator watching
    `namespace` (fast test intervals, overridable); every one is stopped at the end."""
    started: list[EmbeddedOperator] = []

    def start(namespace: str, token: str | None = None, **overrides: Any) -> EmbeddedOperator:
        settings = operator_settings(namespace, **overrides)
        kubeconfig = control_plane.kubeconfig if token is None else control_plane.token_kubeconfig(
            token, tmp_path / f"operator-{len(started)}.kubeconfig")
        operator = EmbeddedOperator(settings, kubeconfig=str(kubeconfig))
        operator.start()
        started.append(operator)
        return operator

    yield start
    errors = []
    for operator in started:
        try:
            operator.stop()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    assert not errors, f"the operator failed: {errors}"


class FakeRank:
    """What one rank pod would answer on its HTTP port."""

    def __init__(self) -> None:
        self.health_status = 200
        self.draft = 0
        self.accepted = 0
        self.tpot_sum = 0.0
        self.tpot_count = 0
        # Serving load: each scrape finds `per_scrape` more drafted tokens at this acceptance and TPOT.
        self.per_scrape = 0
        self.acceptance = 0.0
        self.tpot = 0.01

    def metrics(self) -> str:
        if self.per_scrape:
            self.draft += self.per_scrape
            self.accepted += round(self.per_scrape * self.acceptance)
            self.tpot_sum += self.tpot * self.per_scrape
            self.tpot_count += self.per_scrape
        return (f"# TYPE mtp_spec_decode_draft_tokens_total counter\nmtp_spec_decode_draft_tokens_total {self.draft}\n"
                f"# TYPE mtp_spec_decode_accepted_tokens_total counter\n"
                f"mtp_spec_decode_accepted_tokens_total {self.accepted}\n"
                f"# TYPE mtp_spec_decode_steps_total counter\nmtp_spec_decode_steps_total {self.draft}\n"
                f"# TYPE mtp_time_per_output_token_seconds histogram\n"
                f"mtp_time_per_output_token_seconds_sum {self.tpot_sum}\n"
                f"mtp_time_per_output_token_seconds_count {self.tpot_count}\n")


class RankServers:
    """Serves a FakeRank on every running pod's IP of one namespace (kwok gives them 127.1.x.y)."""

    def __init__(self, kube: Kube, namespace: str, port: int, profile: Callable[[dict], dict] | None = None):
        self.kube, self.namespace, self.port = kube, namespace, port
        self.profile = profile  # pod -> FakeRank attributes (e.g. acceptance by the pod's image)
        self.by_ip: dict[str, tuple[ThreadingHTTPServer, FakeRank]] = {}
        self.uids: dict[str, str] = {}  # address -> the pod it serves now
        self.default = FakeRank()
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="rank-servers", daemon=True)
        self.lock = threading.Lock()

    def rank(self, ip: str) -> FakeRank:
        return self.by_ip[ip][1]

    def _fresh(self, fake: FakeRank, pod: dict) -> None:
        """A new pod behind an address (kwok reuses the addresses of deleted pods): counters from zero."""
        fake.__dict__.update(FakeRank().__dict__)
        fake.__dict__.update(self.default.__dict__)
        if self.profile is not None:
            fake.__dict__.update(self.profile(pod))
        self.uids[pod["status"]["podIP"]] = pod["metadata"]["uid"]

    def _serve(self, ip: str, pod: dict) -> None:
        fake = FakeRank()
        self._fresh(fake, pod)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.startswith("/health"):
                    status, body = fake.health_status, json.dumps({"state": "ok"}).encode()
                elif self.path.startswith("/metrics"):
                    status, body = 200, fake.metrics().encode()
                else:
                    status, body = 404, b"{}"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        server = ThreadingHTTPServer((ip, self.port), Handler)
        threading.Thread(target=server.serve_forever, name=f"rank-{ip}", daemon=True).start()
        self.by_ip[ip] = (server, fake)

    def _loop(self) -> None:
        while not self.stop_flag.wait(0.1):
            try:
                pods = self.kube.items(f"/api/v1/namespaces/{self.namespace}/pods")
            except (OSError, urllib.error.URLError):
                continue
            for pod in pods:
                ip = pod.get("status", {}).get("podIP")
                if ip and ip.startswith("127.") and ip not in self.by_ip:
                    with self.lock:
                        self._serve(ip, pod)
                elif ip in self.by_ip and self.uids.get(ip) != pod["metadata"]["uid"] \
                        and not pod["metadata"].get("deletionTimestamp"):
                    with self.lock:
                        self._fresh(self.by_ip[ip][1], pod)

    def __enter__(self) -> "RankServers":
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop_flag.set()
        self.thread.join(5)
        for server, _ in self.by_ip.values():
            server.shutdown()
            server.server_close()


@pytest.fixture
def rank_servers(kube, namespace):
    """rank_servers(port) -> RankServers for this test's namespace."""
    opened: list[RankServers] = []

    def open_servers(port: int, profile: Callable[[dict], dict] | None = None) -> RankServers:
        servers = RankServers(kube, namespace, port, profile).__enter__()
        opened.append(servers)
        return servers

    yield open_servers
    for servers in opened:
        servers.__exit__()


def helm_path() -> str:
    import shutil
    import sys

    found = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
    assert found, "helm not found: bash hack/setup-env.sh installs it into the venv"
    return found


class ChartInstall:
    """One `helm install` of charts/mtp-operator; its ServiceAccount's identity and token."""

    def __init__(self, control_plane, kube: Kube, release: str, namespace: str, values: dict[str, Any]):
        self.plane, self.kube = control_plane, kube
        self.release, self.namespace, self.values = release, namespace, values

    def helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([helm_path(), f"--kubeconfig={self.plane.kubeconfig}", *args], capture_output=True,
                              text=True, timeout=120)

    def install(self) -> "ChartInstall":
        values = self.plane.work_dir / f"values-{self.release}.yaml"
        values.write_text(yaml.safe_dump(self.values))
        done = self.helm("install", self.release, str(REPO / "charts" / "mtp-operator"), "-n", self.namespace,
                         "--create-namespace", "--values", str(values))
        assert done.returncode == 0, f"helm install failed:\n{done.stderr}"
        accounts = self.kube.items(f"/api/v1/namespaces/{self.namespace}/serviceaccounts",
                                   f"app.kubernetes.io/instance={self.release}")
        assert len(accounts) == 1, f"expected the chart's one ServiceAccount, got {accounts}"
        self.service_account = accounts[0]["metadata"]["name"]
        self.username = f"system:serviceaccount:{self.namespace}:{self.service_account}"
        self.token = self.plane.service_account_token(self.namespace, self.service_account)
        return self

    def uninstall(self) -> None:
        self.helm("uninstall", self.release, "-n", self.namespace)

    def granted(self) -> set[tuple[str, str, str]]:
        """(apiGroup, resource, verb) of every rule bound to the ServiceAccount by this release."""
        kind_paths = [("/apis/rbac.authorization.k8s.io/v1/clusterroles", "")] + [
            (f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", ns)
            for ns in {self.namespace, self.values.get("watchNamespace") or self.namespace}]
        out: set[tuple[str, str, str]] = set()
        for path, _ in kind_paths:
            for role in self.kube.items(path, f"app.kubernetes.io/instance={self.release}"):
                for rule in role.get("rules", []):
                    out |= {(g, r, v) for g in rule.get("apiGroups", []) for r in rule.get("resources", [])
                            for v in rule.get("verbs", [])}
        return out

    def used(self) -> tuple[set[tuple[str, str, str]], list[dict]]:
        """What the ServiceAccount did, from the audit log: (permissions used, forbidden requests)."""
        used, forbidden = set(), []
        for event in self.plane.audit_events(self.username):
            ref = event.get("objectRef")
            if ref is None:
                continue  # discovery (non-resource URLs)
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            if event.get("responseStatus", {}).get("code") == 403:
                forbidden.append(event)
            used.add((ref.get("apiGroup", ""), resource, event["verb"]))
        return used, forbidden


@pytest.fixture
def install_chart(control_plane, kube, namespace):
    """install_chart(cluster_wide) -> ChartInstall; namespaced installs watch the test's namespace."""
    installs: list[ChartInstall] = []

    def install(cluster_wide: bool) -> ChartInstall:
        release = f"mtp-{namespace}"
        values: dict[str, Any] = {"image": {"repository": "registry.example/mtp-operator"},
                                  "rbac": {"clusterWide": cluster_wide}}
        if cluster_wide:
            target = f"{namespace}-op"
        else:
            target, values["watchNamespace"] = namespace, namespace
        chart = ChartInstall(control_plane, kube, release, target, values).install()
        installs.append(chart)
        return chart

    yield install
    for chart in installs:
        chart.uninstall()
        if chart.namespace != namespace:
            kube.try_call("DELETE", f"/api/v1/namespaces/{chart.namespace}")
