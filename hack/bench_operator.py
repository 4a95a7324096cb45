#!/usr/bin/env python3
"""Operator benchmark: reconcile latency, 200-resource steady state, a fleet's rollout, peak memory.

Runs the real `mtp operator` (kopf, a separate process) against an in-memory
API server (hack/fake_apiserver.py) that also plays the Job controller (every
export Job it receives succeeds at once) and, for the fleet part, the
StatefulSet controller (fake_apiserver.StatefulSetController: every group's
pods, Running and Ready at once, recreated from the current template when the
operator deletes them). The operator runs with MTP_OPERATOR_PROBE_PODS=false
(nothing to probe: the pods are not real), and every call of
mtp_operator.reconcile.reconcile in it is timed. Measures, in one run:

  classic (one operator, one group each):
  1. reconcile latency: MtpDeployment created -> its export Job posted, median over N (default 50)
  2. steady state: M (default 200) MtpDeployments created at once -> every one has its
     StatefulSet (export Job done, Services and StatefulSet applied), wall time
  3. the operator's peak RSS (VmHWM) and requests per second once steady
  fleet (a fresh API server and operator per case and round; cases `--fleet-replicas 1,4`):
  4. F (default 50) MtpDeployments of `replicas: R` created at once -> every group's StatefulSet
     exists and the MtpDeployment is Running with R ready groups: wall time, and per resource
  5. a spec change (the image) on all F at once -> every group of every one rolled to the new
     revision (canary with analysisSeconds 0 and minDraftTokens 0, so it is judged at once;
     then maxUnavailable 1 group at a time): wall time, and per resource
  6. reconcile calls while creating and rolling: wall-clock and CPU (the calling thread's) median and
     p95, and how much they overlap (kopf runs sync handlers in threads, so on few cores a call's wall
     time includes waiting for the others); the wall-clock median once idle; API writes per
     MtpDeployment while creating and while rolling; the operator's CPU seconds while rolling; API
     requests per second once everything is rolled and idle (a settled operator should send none)
  7. the operator's peak RSS, and (peak - RSS before the first MtpDeployment) / F
  with --compare-kmock: kmock's per-request cost after K requests vs this server's,
  the reason the benchmark does not go through kmock

    python hack/bench_operator.py [--latency-n 50] [--scale-n 200] [--fleet-n 50] [--fleet-replicas 1,4]
                                  [--rounds 3] [--parts classic,fleet] [--out DIR] [--compare-kmock K]

Figures on a shared machine are noisy: the fleet's are medians over --rounds.
--out DIR writes results.json and results.md.
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
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
sys.path.insert(0, str(REPO / "operator"))

from fake_apiserver import FakeApiServer, StatefulSetController  # noqa: E402

from mtp_operator import constants as c  # noqa: E402

NS = "bench"
CR_KEY = f"{c.GROUP}/{c.VERSION}/{c.PLURAL}"
RESOURCES = {
    CR_KEY: (c.KIND, True), "batch/v1/jobs": ("Job", True), "v1/pods": ("Pod", True),
    "apps/v1/statefulsets": ("StatefulSet", True), "apps/v1/controllerrevisions": ("ControllerRevision", True),
    "v1/services": ("Service", True),
    "v1/events": ("Event", True), "v1/namespaces": ("Namespace", False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
}
TARGETS = {"latency_ms": 200.0, "scale_s": 60.0, "memory_mb": 200.0}


IMAGE, NEW_IMAGE = "example.com/mtp:1", "example.com/mtp:2"


def cr(name: str, replicas: int | None = None) -> dict:
    spec = {"model": {"path": "/models/ds", "modelType": "deepseek_v3", "volume": {"claimName": "models"}},
            "export": {"outputPath": "/models/ds-mtp"}, "nnodes": 2, "image": IMAGE,
            "accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8}}
    if replicas is not None:  # a fleet: the canary is judged at once (no real figures to wait for)
        spec["replicas"] = replicas
        spec["rollout"] = {"canary": {"analysisSeconds": 0, "minDraftTokens": 0}}
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": NS}, "spec": spec}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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

    async def create(self, name: str, replicas: int | None = None) -> float:
        started = time.perf_counter()
        await self.server._create(CR_KEY, NS, cr(name, replicas))
        return started

    def has_statefulset(self, name: str) -> bool:
        return ("apps/v1/statefulsets", NS, name) in self.server.objects


def group_statefulset(name: str, group: int) -> str:
    return name if group == 0 else f"{name}-g{group}"


class FleetWatch:
    """When each MtpDeployment first was Running with every group, and when it first was fully rolled."""

    def __init__(self, server: FakeApiServer, replicas: int):
        self.server, self.replicas = server, replicas
        self.running_at: dict[str, float] = {}
        self.rolled_at: dict[str, float] = {}
        self.old_revision: dict[str, str] = {}  # set when the spec change is sent
        server.on_event.append(self.observe)

    def all_groups_running(self, name: str, status: dict) -> bool:
        groups = status.get("groups") or []
        return (status.get("phase") == "Running" and status.get("readyReplicas") == self.replicas
                and len(groups) == self.replicas and all(g.get("phase") == "Running" for g in groups)
                and all(("apps/v1/statefulsets", NS, group_statefulset(name, g)) in self.server.objects
                        for g in range(self.replicas)))

    def observe(self, key: str, kind: str, obj: dict) -> None:
        if key != CR_KEY or kind == "DELETED":
            return
        name, status = obj["metadata"]["name"], obj.get("status") or {}
        if name not in self.running_at and self.all_groups_running(name, status):
            self.running_at[name] = time.perf_counter()
        old = self.old_revision.get(name)
        if old is not None and name not in self.rolled_at and status.get("updateRevision") not in (None, old) \
                and status.get("currentRevision") == status.get("updateRevision") \
                and status.get("updatedReplicas") == self.replicas and self.all_groups_running(name, status):
            self.rolled_at[name] = time.perf_counter()

    def stale_pods(self, names: list[str]) -> int:
        """Pods not on their StatefulSet's template, or StatefulSets not on the new revision (want 0)."""
        stale = 0
        for name in names:
            revision = (self.server.objects[(CR_KEY, NS, name)].get("status") or {}).get("updateRevision")
            for g in range(self.replicas):
                sts = self.server.objects[("apps/v1/statefulsets", NS, group_statefulset(name, g))]
                template_hash = sts["spec"]["template"]["metadata"]["labels"][c.LABEL_TEMPLATE_HASH]
                stale += (sts["metadata"].get("annotations") or {}).get(c.ANNOTATION_REVISION) != revision
                stale += sts["spec"]["template"]["spec"]["containers"][0]["image"] != NEW_IMAGE
                for rank in range(sts["spec"]["replicas"]):
                    pod = self.server.objects.get(("v1/pods", NS, f"{sts['metadata']['name']}-{rank}"))
                    stale += pod is None or pod["metadata"]["labels"].get(c.LABEL_TEMPLATE_HASH) != template_hash
        return stale


async def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.perf_counter() + timeout
    while not check():
        if time.perf_counter() > deadline:
            raise SystemExit(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.002)


class Operator:
    """`mtp operator` in its own process against `url`, each reconcile call timed into a file."""

    def __init__(self, url: str, tmp: Path, reconcile_interval: float, extra_env: dict[str, str] | None = None):
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "bench",
            "clusters": [{"name": "bench", "cluster": {"server": url}}],
            "users": [{"name": "bench", "user": {"token": "bench"}}],
            "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}]}))
        self.health_port = free_port()
        self.timings = tmp / "reconcile-timings.txt"
        self.log_path = tmp / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "MTP_OPERATOR_HEALTH_PORT": str(self.health_port),
               "MTP_OPERATOR_RECONCILE_INTERVAL": str(reconcile_interval), "PYTHONUNBUFFERED": "1",
               "MTP_OPERATOR_PROBE_PODS": "false", **(extra_env or {})}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "operator"), env.get("PYTHONPATH")]))
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--operator-child",
                                         str(self.timings), "--namespace", NS],
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def ready(self, server: FakeApiServer) -> None:
        # The operator is up once it watches MtpDeployments (after its indices are listed).
        await wait_for(lambda: server.changed.get(CR_KEY) is not None and server.requests > 8, 60, "operator start")
        await asyncio.sleep(1.0)
        if self.process.poll() is not None:
            raise SystemExit(f"the operator exited ({self.process.returncode}); see {self.log_path}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def reconciles(self) -> list[tuple[float, float, float, str]]:
        """(wall time at the end, milliseconds, CPU milliseconds of its thread, MtpDeployment) of every
        reconcile call so far."""
        if not self.timings.exists():
            return []
        rows = []
        for line in self.timings.read_text().splitlines():
            end, ms, cpu_ms, name = line.split(" ", 3)
            rows.append((float(end), float(ms), float(cpu_ms), name))
        return rows


def operator_child(timings: str, argv: list[str]) -> int:
    """The operator process: `mtp operator` with mtp_operator.reconcile.reconcile timed (handlers.py
    calls it by its module-level name, so replacing that name times every handler's reconcile)."""
    from mtp_operator import handlers
    from mtp_operator.commands import operator as command

    inner, out, lock = handlers.reconcile, open(timings, "a", buffering=1), threading.Lock()

    def timed_reconcile(body, *args, **kwargs):
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            return inner(body, *args, **kwargs)
        finally:
            ms, cpu_ms = (time.perf_counter() - started) * 1000, (time.thread_time() - cpu_started) * 1000
            with lock:
                out.write(f"{time.time():.6f} {ms:.3f} {cpu_ms:.3f} {body['metadata']['name']}\n")

    handlers.reconcile = timed_reconcile
    parser = argparse.ArgumentParser(prog="mtp operator")
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def run(args: argparse.Namespace) -> dict:
    server = FakeApiServer(RESOURCES)
    bench = Bench(server)
    url = await server.start()
    tmp = Path(tempfile.mkdtemp(prefix="mtp-bench-"))
    operator = Operator(url, tmp, args.reconcile_interval)
    try:
        await operator.ready(server)
        liveness = await asyncio.to_thread(http_status, f"http://127.0.0.1:{operator.health_port}/healthz")
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
        operator.stop()
        await server.stop()
    return {
        "latency_ms_median": statistics.median(latencies), "latency_ms_p90": statistics.quantiles(latencies, n=10)[8],
        "latency_n": len(latencies), "scale_n": args.scale_n, "scale_s": scale_s,
        "resources_total": args.scale_n + args.latency_n,
        "peak_rss_mb": peak_kib / 1024, "rss_mb": rss_kib / 1024, "idle_requests_per_s": idle_rps,
        "reconcile_interval_s": args.reconcile_interval, "liveness_status": liveness, "operator_log": str(tmp / "operator.log"),
    }


async def fleet_case(n: int, replicas: int, reconcile_interval: float, idle_window: float,
                     timeout: float = 600.0) -> dict:
    """One fresh API server and operator: n MtpDeployments of `replicas` groups created, then rolled."""
    server = FakeApiServer(RESOURCES)
    bench = Bench(server)
    controller = StatefulSetController(server)
    watch = FleetWatch(server, replicas)
    url = await server.start()
    tmp = Path(tempfile.mkdtemp(prefix="mtp-bench-fleet-"))
    operator = Operator(url, tmp, reconcile_interval)
    names = [f"fleet-{i:03d}" for i in range(n)]
    try:
        await operator.ready(server)
        base_kib = vm_kib(operator.pid, "VmRSS")
        created: dict[str, float] = {}
        create_wall, started, cpu_at_create = time.time(), time.perf_counter(), cpu_seconds(operator.pid)
        for name in names:
            created[name] = await bench.create(name, replicas)
        await wait_for(lambda: len(watch.running_at) == n, timeout, f"{n} fleets of {replicas} Running")
        create_s = max(watch.running_at.values()) - started
        running_wall = time.time()
        await asyncio.sleep(2 * reconcile_interval)  # the last status patches land; nothing is rolling
        changed: dict[str, float] = {}
        create_counts, cpu_at_roll = server.request_counts.copy(), cpu_seconds(operator.pid)
        roll_wall, started = time.time(), time.perf_counter()
        for name in names:
            watch.old_revision[name] = (server.objects[(CR_KEY, NS, name)].get("status") or {})["updateRevision"]
            changed[name] = time.perf_counter()
            await server._patch(CR_KEY, NS, name, None, {"spec": {"image": NEW_IMAGE}})
        await wait_for(lambda: len(watch.rolled_at) == n, timeout, f"{n} fleets of {replicas} rolled")
        roll_s = max(watch.rolled_at.values()) - started
        rolled_wall = time.time()
        roll_counts = server.request_counts - create_counts
        cpu_at_rolled = cpu_seconds(operator.pid)
        await asyncio.sleep(reconcile_interval)
        idle_from, idle_requests = time.time(), server.requests
        await asyncio.sleep(idle_window)
        idle_rps = (server.requests - idle_requests) / idle_window
        peak_kib, rss_kib = vm_kib(operator.pid, "VmHWM"), vm_kib(operator.pid, "VmRSS")
        stale = watch.stale_pods(names)
    finally:
        operator.stop()
        await server.stop()
    calls = operator.reconciles()
    busy = [ms for end, ms, _, _ in calls if create_wall <= end <= rolled_wall]
    busy_cpu = [cpu for end, _, cpu, _ in calls if create_wall <= end <= rolled_wall]
    writes = ("post", "patch", "delete", "deletecollection")
    idle = [ms for end, ms, _, _ in calls if end >= idle_from]
    create_latency = [watch.running_at[m] - created[m] for m in names]
    roll_latency = [watch.rolled_at[m] - changed[m] for m in names]
    return {
        "n": n, "replicas": replicas, "statefulsets": n * replicas, "pods_created": controller.pods_created,
        "create_s": create_s, "create_per_resource_s_median": statistics.median(create_latency),
        "roll_s": roll_s, "roll_per_resource_s_median": statistics.median(roll_latency),
        "reconcile_ms_median": percentile(busy, 50), "reconcile_ms_p95": percentile(busy, 95),
        "reconcile_cpu_ms_median": percentile(busy_cpu, 50), "reconcile_cpu_ms_p95": percentile(busy_cpu, 95),
        "reconcile_calls": len(busy), "idle_reconcile_ms_median": percentile(idle, 50),
        # Summed reconcile time over wall time: above 1, calls overlap (kopf runs them in threads).
        "reconcile_overlap": sum(busy) / 1000 / (rolled_wall - create_wall),
        "create_writes_per_resource": sum(v for k, v in create_counts.items() if k.split()[0] in writes) / n,
        "roll_writes_per_resource": sum(v for k, v in roll_counts.items() if k.split()[0] in writes) / n,
        "roll_requests": dict(sorted(roll_counts.items())),
        "idle_requests_per_s": idle_rps, "create_cpu_s": cpu_at_roll - cpu_at_create,
        "roll_cpu_s": cpu_at_rolled - cpu_at_roll, "roll_cpu_fraction": (cpu_at_rolled - cpu_at_roll) / roll_s,
        "base_rss_mb": base_kib / 1024, "peak_rss_mb": peak_kib / 1024,
        "rss_mb": rss_kib / 1024, "rss_per_resource_kb": (peak_kib - base_kib) / n,
        "create_ticks": create_s / reconcile_interval, "roll_ticks": roll_s / reconcile_interval,
        "running_to_change_s": roll_wall - running_wall, "stale_after_roll": stale,
        "reconcile_interval_s": reconcile_interval, "operator_log": str(operator.log_path),
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


_CASE = (("groups each", "replicas", "{:.0f}"), ("StatefulSets", "statefulsets", "{:.0f}"))
TIME_COLUMNS = _CASE + (  # (heading, result key, format)
    ("create -> all Running (s)", "create_s", "{:.1f}"),
    ("per resource, median (s)", "create_per_resource_s_median", "{:.1f}"),
    ("spec change -> all rolled (s)", "roll_s", "{:.1f}"),
    ("per resource, median (s)", "roll_per_resource_s_median", "{:.1f}"),
    ("in reconcile ticks", "roll_ticks", "{:.1f}"), ("stale after roll", "stale_after_roll", "{:.0f}"),
)
COST_COLUMNS = _CASE + (
    ("reconcile median (ms)", "reconcile_ms_median", "{:.1f}"), ("p95 (ms)", "reconcile_ms_p95", "{:.1f}"),
    ("CPU median (ms)", "reconcile_cpu_ms_median", "{:.1f}"), ("CPU p95 (ms)", "reconcile_cpu_ms_p95", "{:.1f}"),
    ("overlap", "reconcile_overlap", "{:.1f}"), ("idle median (ms)", "idle_reconcile_ms_median", "{:.1f}"),
    ("peak RSS (MB)", "peak_rss_mb", "{:.1f}"), ("RSS per MtpDeployment (KB)", "rss_per_resource_kb", "{:.0f}"),
    ("writes per create", "create_writes_per_resource", "{:.0f}"),
    ("writes per rollout", "roll_writes_per_resource", "{:.0f}"),
    ("operator CPU while rolling (s)", "roll_cpu_s", "{:.1f}"),
    ("idle API requests/s", "idle_requests_per_s", "{:.1f}"),
)


def median_case(rounds: list[dict]) -> dict:
    """Each numeric figure's median over the rounds of one case (the worst for stale_after_roll)."""
    out = {k: v for k, v in rounds[0].items() if not isinstance(v, (int, float))}
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rounds]
            out[key] = max(values) if key == "stale_after_roll" else statistics.median(values)
    out["rounds"] = len(rounds)
    return out


def fleet_table(cases: list[dict], columns: tuple = COST_COLUMNS) -> list[str]:
    """Markdown rows: one per case, then the ratio of the largest case to the smallest."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for case in cases:
        lines.append("| " + " | ".join(fmt.format(case[key]) for _, key, fmt in columns) + " |")
    if len(cases) > 1:
        small, large = cases[0], cases[-1]
        scale = large["replicas"] / small["replicas"]
        ratios = []
        for _, key, _ in columns:
            if key in ("replicas", "statefulsets", "stale_after_roll") or not small[key]:
                ratios.append(f"{large[key] / small[key]:.1f}x" if small[key] else "-")
            else:
                ratios.append(f"{large[key] / small[key]:.2f}x")
        lines.append(f"| {large['replicas']} vs {small['replicas']} (groups x{scale:.0f}) | " +
                     " | ".join(ratios[1:]) + " |")
    return lines


def main() -> int:
    if sys.argv[1:2] == ["--operator-child"]:
        return operator_child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="classic,fleet", help="comma-separated: classic, fleet")
    parser.add_argument("--latency-n", type=int, default=50)
    parser.add_argument("--scale-n", type=int, default=200)
    parser.add_argument("--reconcile-interval", type=float, default=5.0, help="MTP_OPERATOR_RECONCILE_INTERVAL")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait after steady state")
    parser.add_argument("--idle-window", type=float, default=10.0, help="seconds to count requests once settled")
    parser.add_argument("--fleet-n", type=int, default=50, help="MtpDeployments per fleet case")
    parser.add_argument("--fleet-replicas", default="1,4", help="comma-separated spec.replicas, one case each")
    parser.add_argument("--fleet-reconcile-interval", type=float, default=1.0,
                        help="MTP_OPERATOR_RECONCILE_INTERVAL for the fleet part (each rollout step waits a tick)")
    parser.add_argument("--rounds", type=int, default=3, help="fleet rounds (each case once per round)")
    parser.add_argument("--out", type=Path, help="write results.json and results.md here")
    parser.add_argument("--compare-kmock", type=int, default=0, metavar="K",
                        help="also time K sequential GETs on kmock and on the fake server")
    args = parser.parse_args()
    parts = set(filter(None, args.parts.split(",")))
    if parts - {"classic", "fleet"}:
        parser.error(f"--parts: unknown {sorted(parts - {'classic', 'fleet'})}; use classic and/or fleet")
    report: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    md = ["# Operator benchmark", "", "`python hack/bench_operator.py " + " ".join(sys.argv[1:]) + "`", ""]
    if "classic" in parts:
        result = asyncio.run(run(args))
        report["classic"] = result
        lines = [
            f"reconcile latency (create -> Job posted), median of {result['latency_n']}: "
            f"{result['latency_ms_median']:.1f} ms (p90 {result['latency_ms_p90']:.1f} ms; "
            f"target < {TARGETS['latency_ms']:.0f} ms, ratio {result['latency_ms_median'] / TARGETS['latency_ms']:.2f})",
            f"{result['scale_n']} MtpDeployments -> Job done + StatefulSet each: {result['scale_s']:.1f} s "
            f"(target < {TARGETS['scale_s']:.0f} s, ratio {result['scale_s'] / TARGETS['scale_s']:.2f}; "
            f"{result['resources_total']} resources live, reconcile timer {result['reconcile_interval_s']} s)",
            f"operator peak RSS: {result['peak_rss_mb']:.1f} MB (now {result['rss_mb']:.1f} MB; target < "
            f"{TARGETS['memory_mb']:.0f} MB, ratio {result['peak_rss_mb'] / TARGETS['memory_mb']:.2f})",
            f"operator liveness endpoint /healthz: HTTP {result['liveness_status']}",
            f"API requests/s once settled ({args.settle:.0f} s after steady state, over {args.idle_window:.0f} s): "
            f"{result['idle_requests_per_s']:.1f}",
        ]
        print("\n".join(lines))
        md += ["## One group each", ""] + [f"- {line}" for line in lines] + [""]
    if "fleet" in parts:
        replicas = [int(r) for r in args.fleet_replicas.split(",") if r]
        rounds: dict[int, list[dict]] = {r: [] for r in replicas}
        for i in range(args.rounds):
            for r in replicas:
                result = asyncio.run(fleet_case(args.fleet_n, r, args.fleet_reconcile_interval, args.idle_window))
                rounds[r].append(result)
                print(f"round {i + 1}/{args.rounds}, {args.fleet_n} x replicas {r}: create {result['create_s']:.1f} s, "
                      f"roll {result['roll_s']:.1f} s, reconcile median {result['reconcile_ms_median']:.1f} ms "
                      f"p95 {result['reconcile_ms_p95']:.1f} ms, peak RSS {result['peak_rss_mb']:.1f} MB",
                      flush=True)
        cases = [median_case(rounds[r]) for r in replicas]
        report["fleet"] = {"cases": cases, "rounds": {str(r): v for r, v in rounds.items()}}
        heading = (f"{args.fleet_n} MtpDeployments (nnodes 2) per case, fresh API server and operator per case "
                   f"and round, medians of {args.rounds} round(s); reconcile timer "
                   f"{args.fleet_reconcile_interval} s, pods Ready at once, probes off; canary analysisSeconds 0, "
                   f"minDraftTokens 0, maxUnavailable 1")
        table = fleet_table(cases, TIME_COLUMNS) + [""] + fleet_table(cases, COST_COLUMNS)
        print("\n" + heading + "\n" + "\n".join(table))
        md += ["## Fleets", "", heading + ".", ""] + table + [""]
    if args.compare_kmock:
        k = asyncio.run(compare_kmock(args.compare_kmock))
        report["kmock"] = k
        line = (f"per-GET latency after {k['requests']} requests: kmock {k['kmock_first50_ms']:.2f} -> "
                f"{k['kmock_last50_ms']:.2f} ms, fake server {k['fake_first50_ms']:.2f} -> {k['fake_last50_ms']:.2f} ms "
                f"(kmock/fake at the end: {k['kmock_last50_ms'] / k['fake_last50_ms']:.1f}x)")
        print(line)
        md += [f"- {line}", ""]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=2))
        (args.out / "results.md").write_text("\n".join(md))
        print(f"wrote {args.out}/results.json, results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
