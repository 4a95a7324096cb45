"""A real Kubernetes control plane on loopback, for tests and for trying the operator by hand.

    plane = ControlPlane(bin_dir, work_dir)      # bin_dir from hack/control-plane-bin.sh
    plane.start()                                # etcd, kube-apiserver, kube-controller-manager, kwok, nodes
    plane.kubeconfig                             # admin (system:masters) kubeconfig path
    plane.token_kubeconfig(token, path)          # same cluster, another identity (e.g. a ServiceAccount)
    plane.stop()                                 # kills only the processes it started

    python hack/control_plane.py [--nodes 2]     # start one, print its kubeconfig, stop on Ctrl-C

What runs:
- etcd on 127.0.0.1 (a fresh data directory).
- kube-apiserver on 127.0.0.1 only, TLS from a CA made here, the default admission chain,
  static-token authentication and RBAC authorization, ServiceAccount tokens signed with a key
  made here (TokenRequest works), an audit log of every request at Metadata level (what
  each user did: the RBAC tests read it).
- kube-controller-manager with the controllers a workload needs (StatefulSet, Job, ReplicaSet,
  Deployment, garbage collector, endpoints, namespaces, ServiceAccounts and their tokens) and the
  HorizontalPodAutoscaler's (it reads a target's scale subresource; no metrics API runs here).
- kwok, which plays the kubelet for nodes annotated kwok.x-k8s.io/node=fake: nodes turn Ready,
  bound pods turn Running and Ready with an address from POD_CIDR (127.1.0.0/16, so that
  probing a pod IP reaches loopback, where a test can serve a fake rank), and pods of Jobs
  complete. Its own HTTP server is off.
- A binding loop (instead of kube-scheduler): every unbound pod with the default scheduler
  name goes to the first fake node whose allocatable resources still fit its requests.

No process listens on anything but 127.0.0.1, and nothing is sent anywhere else.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
POD_CIDR = "127.1.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"  # allocated addresses only: nothing runs kube-proxy, no packet goes there
ADMIN_TOKEN_USER = "mtp-test-admin"
NODE_RESOURCES = {"cpu": "64", "memory": "512Gi", "pods": "110", "huawei.com/Ascend910": "8", "nvidia.com/gpu": "8"}
CONTROLLERS = ("statefulset,job,replicaset,deployment,garbagecollector,endpoint,endpointslice,namespace,"
               "serviceaccount,serviceaccount-token,ttl-after-finished,horizontalpodautoscaling")
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
"""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (Linux), so a
    killed test run leaves no control plane behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def binaries_dir() -> Path:
    """The directory hack/control-plane-bin.sh provides (building what is missing)."""
    done = subprocess.run(["bash", str(REPO / "hack" / "control-plane-bin.sh")], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"hack/control-plane-bin.sh failed:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def parse_quantity(text: str) -> float:
    """A Kubernetes quantity as a number (cpu in cores, memory in bytes); enough for fitting pods."""
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def pod_requests(pod: dict[str, Any]) -> dict[str, float]:
    """What the scheduler charges a pod: sum over containers, at least its largest init container."""
    spec = pod.get("spec", {})

    def total(containers: list[dict[str, Any]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for container in containers:
            resources = container.get("resources") or {}
            wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for name, value in wanted.items():
                out[name] = out.get(name, 0.0) + parse_quantity(str(value))
        return out

    need = total(spec.get("containers") or [])
    for init in spec.get("initContainers") or []:
        for name, value in total([init]).items():
            need[name] = max(need.get(name, 0.0), value)
    need["pods"] = 1.0
    return need


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class ControlPlane:
    bin_dir: Path
    work_dir: Path
    nodes: int = 2
    processes: list[Process] = field(default_factory=list)
    api_port: int = 0
    admin_token: str = ""

    # -- paths -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.work_dir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.work_dir / "pki" / "ca.crt"

    @property
    def audit_log(self) -> Path:
        return self.work_dir / "audit.log"

    # -- start / stop ------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> "ControlPlane":
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._make_pki()
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controller_manager()
            self._start_kwok()
            self._create_nodes()
            self._binder = threading.Thread(target=self._bind_loop, name="pod-binder", daemon=True)
            self._stop_binding = threading.Event()
            self._binder.start()
            self.wait_for(lambda: self._nodes_ready(), timeout, "kwok to make the fake nodes Ready")
            self.wait_for(lambda: self._default_service_account(), timeout,
                          "the ServiceAccount controller's default ServiceAccount")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_binding = getattr(self, "_stop_binding", None)
        if stop_binding is not None:
            stop_binding.set()
            self._binder.join(5)
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in reversed(self.processes):
            try:
                proc.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        self.processes.clear()

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()

    def check_alive(self) -> None:
        for proc in self.processes:
            if proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; log tail:\n{tail}")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.work_dir / f"{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, preexec_fn=_die_with_parent,
                                 env={**os.environ, **(env or {})})
        handle.close()
        proc = Process(name, popen, log)
        self.processes.append(proc)
        return proc

    def wait_for(self, check, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                result = check()
            except (OSError, urllib.error.URLError, ssl.SSLError, json.JSONDecodeError):
                result = None
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.2)

    # -- pieces ------------------------------------------------------------------------------

    def _make_pki(self) -> None:
        pki = self.work_dir / "pki"
        pki.mkdir(exist_ok=True)

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=pki)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                "-days", "2", "-subj", "/CN=mtp-test-ca")
        (pki / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
                "-subj", "/CN=kube-apiserver")
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "server.crt", "-days", "2", "-extfile", "server.ext")
        openssl("genrsa", "-out", "sa.key", "2048")
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        self.admin_token = os.urandom(16).hex()
        (pki / "tokens.csv").write_text(f'{self.admin_token},{ADMIN_TOKEN_USER},{ADMIN_TOKEN_USER},"system:masters"\n')
        (self.work_dir / "audit-policy.yaml").write_text(AUDIT_POLICY)

    def _start_etcd(self, timeout: float) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [
            str(self.bin_dir / "etcd"), "--data-dir", str(self.work_dir / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ])
        self.wait_for(lambda: urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2).status == 200,
                      timeout, "etcd")

    def _start_apiserver(self, timeout: float) -> None:
        pki = self.work_dir / "pki"
        self.api_port = free_port()
        self._spawn("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.api_port}", f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--anonymous-auth=false",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            f"--audit-policy-file={self.work_dir / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
            "--audit-log-maxsize=0", "--profiling=false", "--v=1",
        ])
        self._write_kubeconfig(self.kubeconfig, self.admin_token)
        self.wait_for(lambda: self._get("/readyz") == "ok", timeout, "kube-apiserver /readyz")

    def _start_controller_manager(self) -> None:
        pki = self.work_dir / "pki"
        self._spawn("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"), f"--kubeconfig={self.kubeconfig}",
            f"--controllers={CONTROLLERS}", "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=false", "--concurrent-statefulset-syncs=5",
            "--concurrent-gc-syncs=5", "--v=1",
        ])

    def _start_kwok(self) -> None:
        self._spawn("kwok", [
            str(self.bin_dir / "kwok"), f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={POD_CIDR}", "--node-ip=127.0.0.1", "--node-lease-duration-seconds=40",
            "--server-address=",
        ])

    def _create_nodes(self) -> None:
        for index in range(self.nodes):
            name = f"kwok-node-{index}"
            self.request("POST", "/api/v1/nodes", {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake",
                                                           "node.alpha.kubernetes.io/ttl": "0"},
                             "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                        "kubernetes.io/arch": "amd64", "type": "kwok"}},
                "spec": {},
                "status": {"capacity": NODE_RESOURCES, "allocatable": NODE_RESOURCES},
            })

    def _nodes_ready(self) -> bool:
        nodes = self.request("GET", "/api/v1/nodes")["items"]
        ready = [n for n in nodes if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in n.get("status", {}).get("conditions", []))]
        return len(ready) >= self.nodes

    def _default_service_account(self) -> bool:
        try:
            self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
            return True
        except urllib.error.HTTPError:
            return False

    # -- scheduling --------------------------------------------------------------------------

    def _bind_loop(self) -> None:
        while not self._stop_binding.wait(0.1):
            try:
                self.bind_pending()
            except (OSError, urllib.error.URLError, ssl.SSLError, json.JSONDecodeError):
                continue  # the server is going away, or a pod went while we bound it

    def bind_pending(self) -> int:
        """Bind every unscheduled pod to a fitting node; returns how many were bound."""
        pods = self.request("GET", "/api/v1/pods")["items"]
        nodes = [n for n in self.request("GET", "/api/v1/nodes")["items"]
                 if not n["spec"].get("unschedulable")]
        used: dict[str, dict[str, float]] = {n["metadata"]["name"]: {} for n in nodes}
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if node in used and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                for name, value in pod_requests(pod).items():
                    used[node][name] = used[node].get(name, 0.0) + value
        bound = 0
        for pod in pods:
            meta = pod["metadata"]
            if pod["spec"].get("nodeName") or meta.get("deletionTimestamp") \
                    or pod["spec"].get("schedulerName", "default-scheduler") != "default-scheduler":
                continue
            need = pod_requests(pod)
            for node in nodes:
                name = node["metadata"]["name"]
                allocatable = node["status"].get("allocatable", {})
                if all(used[name].get(r, 0.0) + v <= parse_quantity(str(allocatable.get(r, "0"))) + 1e-9
                       for r, v in need.items()):
                    try:
                        self.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding",
                                     {"apiVersion": "v1", "kind": "Binding",
                                      "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                                      "target": {"apiVersion": "v1", "kind": "Node", "name": name}})
                    except urllib.error.HTTPError:
                        break  # already bound, or gone: the next pass sees it
                    for r, v in need.items():
                        used[name][r] = used[name].get(r, 0.0) + v
                    bound += 1
                    break
        return bound

    # -- HTTP --------------------------------------------------------------------------------

    def _context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _get(self, path: str) -> str:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        with urllib.request.urlopen(req, context=self._context(), timeout=5) as response:
            return response.read().decode()

    def request(self, method: str, path: str, body: Any = None, token: str | None = None,
                content_type: str = "application/json") -> Any:
        """One API call as admin (or as `token`); HTTPError on a non-2xx answer."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token or self.admin_token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, context=self._context(), timeout=30) as response:
            text = response.read().decode()
        return json.loads(text) if text else None

    # -- kubeconfigs -------------------------------------------------------------------------

    def _write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "mtp-test",
            "clusters": [{"name": "mtp-test", "cluster": {"server": self.url,
                                                          "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "mtp-test-user", "user": {"token": token}}],
            "contexts": [{"name": "mtp-test", "context": {"cluster": "mtp-test", "user": "mtp-test-user",
                                                          "namespace": namespace}}],
        }, indent=1))
        return path

    def token_kubeconfig(self, token: str, path: Path, namespace: str = "default") -> Path:
        return self._write_kubeconfig(path, token, namespace)

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A TokenRequest for a ServiceAccount (what a pod of that account would mount)."""
        answer = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                              {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                               "spec": {"expirationSeconds": seconds}})
        return answer["status"]["token"]

    def audit_events(self, username: str | None = None) -> list[dict[str, Any]]:
        """Audit log entries, optionally of one user only: each request once, when its response
        completed, except watches, which are counted when they start (they end only when closed)."""
        events = []
        if not self.audit_log.exists():
            return events
        for line in self.audit_log.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
            stage, verb = event.get("stage"), event.get("verb")
            if not (stage == "ResponseComplete" and verb != "watch" or stage == "ResponseStarted" and verb == "watch"):
                continue
            if username is None or event.get("user", {}).get("username") == username:
                events.append(event)
        return events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="fake kwok nodes (default 2)")
    parser.add_argument("--work-dir", help="where logs, certificates and etcd data go (default: a temp dir)")
    args = parser.parse_args(argv)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="mtp-control-plane-"))
    plane = ControlPlane(binaries_dir(), work, nodes=args.nodes)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    started = time.monotonic()
    with plane:
        print(f"control plane up in {time.monotonic() - started:.1f} s: {plane.url}")
        print(f"export KUBECONFIG={plane.kubeconfig}")
        print(f"logs and audit log: {work}   (Ctrl-C stops everything)")
        sys.stdout.flush()
        try:
            while True:
                time.sleep(1)
                plane.check_alive()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
