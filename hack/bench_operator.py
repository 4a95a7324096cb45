#!/usr/bin/env python3
"""Operator benchmark: reconcile latency, 200-resource steady state, peak memory.

Runs the real `mtp operator` (kopf, a separate process) against an in-memory
API server (hack/fake_apiserver.py) that also plays the Job controller: every
export Job it receives succeeds at once. Measures, in one run:

  1. reconcile latency: MtpDeployment created -> its export Job posted, median over N (default 50)
  2. steady state: M (default 200) MtpDeployments created at once -> every one has its
     StatefulSet (export Job done, Services and StatefulSet applied), wall time
  3. the operator's peak RSS (VmHWM) and requests per second once steady
  4. with --compare-kmock: kmock's per-request cost after K requests vs this server's,
     the reason the benchmark does not go through kmock

    python hack/bench_operator.py [--latency-n 50] [--scale-n 200] [--compare-kmock]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
sys.path.insert(0, str(REPO / "operator"))

from fake_apiserver import FakeApiServer  # noqa: E402

from mtp_operator import constants as c  # noqa: E402

NS = "bench"
CR_KEY = f"{c.GROUP}/{c.VERSION}/{c.PLURAL}"
RESOURCES = {
    CR_KEY: (c.KIND, True), "batch/v1/jobs": ("Job", True), "v1/pods": ("Pod", True),
    "apps/v1/statefulsets": ("StatefulSet", True), "v1/services": ("Service", True),
    "v1/events": ("Event", True), "v1/namespaces": ("Namespace", False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
}
TARGETS = {"latency_ms": 200.0, "scale_s": 60.0, "memory_mb": 200.0}


def cr(name: str) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"path": "/models/ds", "modelType": "deepseek_v3", "volume": {"claimName": "models"}},
                     "export": {"outputPath": "/models/ds-mtp"}, "nnodes": 2, "image": "example.com/mtp:1",
                     "accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Bench:
    def __init__(self, server: FakeApiServer):
        self.server = server
        self.job_posted: dict[str, float] = {}
        server.on_create.append(self.job_controller)

    def job_controller(self, key: str, obj: dict) -> None:
        if key != "batch/v1/jobs":
            return
        owner = obj["metadata"]["labels"][c.LABEL_DEPLOYMENT]
        self.job_posted[owner] = time.perf_counter()
        status = {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}
        asyncio.get_running_loop().create_task(
            self.server._patch(key, NS, obj["metadata"]["name"], "status", status))

    async def create(self, name: str) -> float:
        started = time.perf_counter()
        await self.server._create(CR_KEY, NS, cr(name))
        return started

    def has_statefulset(self, name: str) -> bool:
        return ("apps/v1/statefulsets", NS, name) in self.server.objects


async def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.perf_counter() + timeout
    while not check():
        if time.perf_counter() > deadline:
            raise SystemExit(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.002)


async def run(args: argparse.Namespace) -> dict:
    server = FakeApiServer(RESOURCES)
    bench = Bench(server)
    url = await server.start()
    tmp = Path(tempfile.mkdtemp(prefix="mtp-bench-"))
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": url}}],
        "users": [{"name": "bench", "user": {"token": "bench"}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}]}))
    health_port = free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "MTP_OPERATOR_HEALTH_PORT": str(health_port),
           "MTP_OPERATOR_RECONCILE_INTERVAL": str(args.reconcile_interval), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = open(tmp / "operator.log", "w")
    operator = subprocess.Popen([sys.executable, "-m", "mtp_runtime", "operator", "--namespace", NS],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # The operator is up once it watches MtpDeployments (after its indices are listed).
        await wait_for(lambda: server.changed.get(CR_KEY) is not None and server.requests > 8, 60, "operator start")
        await asyncio.sleep(1.0)
        liveness = await asyncio.to_thread(http_status, f"http://127.0.0.1:{health_port}/healthz")
        latencies = []
        for i in range(args.latency_n):
            name = f"lat-{i:03d}"
            started = await bench.create(name)
            await wait_for(lambda: name in bench.job_posted, 30, f"job of {name}")
            latencies.append((bench.job_posted[name] - started) * 1000)
        await wait_for(lambda: all(bench.has_statefulset(f"lat-{i:03d}") for i in range(args.latency_n)),
                       120, "latency resources' statefulsets")

        names = [f"scale-{i:03d}" for i in range(args.scale_n)]
        started = time.perf_counter()
        for name in names:
            await bench.create(name)
        await wait_for(lambda: all(bench.has_statefulset(n) for n in names), 300, "steady state")
        scale_s = time.perf_counter() - started
        await asyncio.sleep(args.settle)  # let the last status patches land
        settle_from = server.requests
        await asyncio.sleep(args.idle_window)
        idle_rps = (server.requests - settle_from) / args.idle_window
        peak_kib, rss_kib = vm_kib(operator.pid, "VmHWM"), vm_kib(operator.pid, "VmRSS")
    finally:
        operator.terminate()
        try:
            operator.wait(20)
        except subprocess.TimeoutExpired:
            operator.kill()
        await server.stop()
    return {
        "latency_ms_median": statistics.median(latencies), "latency_ms_p90": statistics.quantiles(latencies, n=10)[8],
        "latency_n": len(latencies), "scale_n": args.scale_n, "scale_s": scale_s,
        "resources_total": args.scale_n + args.latency_n,
        "peak_rss_mb": peak_kib / 1024, "rss_mb": rss_kib / 1024, "idle_requests_per_s": idle_rps,
        "reconcile_interval_s": args.reconcile_interval, "liveness_status": liveness, "operator_log": str(tmp / "operator.log"),
    }


async def compare_kmock(requests: int) -> dict:
    """Mean GET latency of the first and of the last 50 requests, kmock vs FakeApiServer."""
    import aiohttp
    import kmock

    async def timed(session_get, n: int) -> tuple[float, float]:
        costs = []
        for _ in range(n):
            t = time.perf_counter()
            async with session_get() as response:
                await response.read()
            costs.append(time.perf_counter() - t)
        return statistics.mean(costs[:50]) * 1000, statistics.mean(costs[-50:]) * 1000

    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        emulator.resources["v1/pods"] = kmock.ResourceInfo(kind="Pod", namespaced=True, verbs={"list"})
        km = await timed(lambda: emulator.get(f"/api/v1/namespaces/{NS}/pods"), requests)
    server = FakeApiServer({"v1/pods": ("Pod", True)})
    url = await server.start()
    async with aiohttp.ClientSession() as session:
        own = await timed(lambda: session.get(f"{url}/api/v1/namespaces/{NS}/pods"), requests)
    await server.stop()
    return {"requests": requests, "kmock_first50_ms": km[0], "kmock_last50_ms": km[1],
            "fake_first50_ms": own[0], "fake_last50_ms": own[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-n", type=int, default=50)
    parser.add_argument("--scale-n", type=int, default=200)
    parser.add_argument("--reconcile-interval", type=float, default=5.0, help="MTP_OPERATOR_RECONCILE_INTERVAL")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait after steady state")
    parser.add_argument("--idle-window", type=float, default=10.0, help="seconds to count requests once settled")
    parser.add_argument("--compare-kmock", type=int, default=0, metavar="K",
                        help="also time K sequential GETs on kmock and on the fake server")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"reconcile latency (create -> Job posted), median of {result['latency_n']}: "
          f"{result['latency_ms_median']:.1f} ms (p90 {result['latency_ms_p90']:.1f} ms; "
          f"target < {TARGETS['latency_ms']:.0f} ms, ratio {result['latency_ms_median'] / TARGETS['latency_ms']:.2f})")
    print(f"{result['scale_n']} MtpDeployments -> Job done + StatefulSet each: {result['scale_s']:.1f} s "
          f"(target < {TARGETS['scale_s']:.0f} s, ratio {result['scale_s'] / TARGETS['scale_s']:.2f}; "
          f"{result['resources_total']} resources live, reconcile timer {result['reconcile_interval_s']} s)")
    print(f"operator peak RSS: {result['peak_rss_mb']:.1f} MB (now {result['rss_mb']:.1f} MB; target < "
          f"{TARGETS['memory_mb']:.0f} MB, ratio {result['peak_rss_mb'] / TARGETS['memory_mb']:.2f})")
    print(f"operator liveness endpoint /healthz: HTTP {result['liveness_status']}")
    print(f"API requests/s once settled ({args.settle:.0f} s after steady state, over {args.idle_window:.0f} s): "
          f"{result['idle_requests_per_s']:.1f}")
    if args.compare_kmock:
        k = asyncio.run(compare_kmock(args.compare_kmock))
        print(f"per-GET latency after {k['requests']} requests: kmock {k['kmock_first50_ms']:.2f} -> "
              f"{k['kmock_last50_ms']:.2f} ms, fake server {k['fake_first50_ms']:.2f} -> {k['fake_last50_ms']:.2f} ms "
              f"(kmock/fake at the end: {k['kmock_last50_ms'] / k['fake_last50_ms']:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
