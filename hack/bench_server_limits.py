#!/usr/bin/env python3
"""Large request bodies against a real `mtp serve`: does /health keep answering, does a
running stream keep flowing, and how much memory does the server take for a body?

    python hack/bench_server_limits.py [--model DIR] [--sizes-mb 10,50] [--repeats 3]

Without --model it builds an untrained `mtp make-tiny` model in a temporary
folder (only the HTTP layer is measured). Two servers, one after the other:
the default --max_request_bytes (8 MiB: such bodies get 413 while they stream
in) and a limit raised to 64 MiB (the bodies are read and parsed, and the
prompt is refused by its length before it is tokenised). Each body is sent
with a Content-Length and chunked (no length), while another thread polls
/health every 20 ms and a streamed completion runs. Printed per case: the
answer's status and time, /health latency (median, max), the longest gap
between the stream's events, and the server's peak RSS growth over its RSS
just before the request, as a ratio to the body size (the worst of the runs).

Targets (issue 25): /health under 0.2 s; RSS growth under 2x the body.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from mtp_runtime.bench.local_server import LocalServer

MIB = 1024 * 1024
RAISED_LIMIT = 64 * MIB
HEALTH_TARGET_S = 0.2
RSS_TARGET_RATIO = 2.0
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class Case:
    config: str
    size_mb: int
    mode: str
    status: int
    answer_s: float
    health_median_s: float
    health_max_s: float
    stream_max_gap_s: float
    rss_growth_mb: float

    @property
    def rss_ratio(self) -> float:
        return self.rss_growth_mb * MIB / (self.size_mb * 1e6)


def poll_health(base_url: str, polling, stop, results, interval_s: float = 0.02) -> None:
    """GET /health every `interval_s` until `stop`; puts (latencies, failures) on `results`."""
    latencies, failures = [], 0
    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start)
            failures += not ok
            polling.set()
            stop.wait(interval_s)
    results.put((latencies, failures))


def stream_gaps(base_url: str, started, stop, results) -> None:
    """A streamed completion running through the big request: puts the gaps between its events."""
    body = {"prompt": "def main(", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    gaps, last = [], None
    with httpx.Client(base_url=base_url, timeout=300.0) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                started.set()
                if stop.is_set():
                    break
    results.put(gaps)


class PeakRss(threading.Thread):
    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.process, self.interval_s = psutil.Process(pid), interval_s
        self.peak = self.process.memory_info().rss
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)


def prompt_body(size_mb: int) -> bytes:
    head, tail = b'{"prompt": "', b'", "max_tokens": 4}'
    return head + b"x" * (size_mb * 1_000_000 - len(head) - len(tail)) + tail


def chunks(body: bytes, size: int = MIB):
    for start in range(0, len(body), size):
        yield body[start:start + size]


def run_case(server: LocalServer, config: str, size_mb: int, mode: str) -> Case:
    """One big request while /health is polled and a stream runs, both from processes of their own
    (so this process's sending and sampling never delay what they measure)."""
    body = prompt_body(size_mb)
    ctx = multiprocessing.get_context("spawn")
    stop, started, polling = ctx.Event(), ctx.Event(), ctx.Event()
    results, gap_results = ctx.Queue(), ctx.Queue()
    stream = ctx.Process(target=stream_gaps, args=(server.base_url, started, stop, gap_results))
    stream.start()
    if not started.wait(120):
        raise RuntimeError("the background stream did not start")
    health = ctx.Process(target=poll_health, args=(server.base_url, polling, stop, results))
    health.start()
    if not polling.wait(120):
        raise RuntimeError("the /health poller did not start")
    rss = PeakRss(server.process.pid)
    rss.start()
    time.sleep(0.5)  # a few idle polls first
    before = rss.peak
    start = time.perf_counter()
    with httpx.Client(base_url=server.base_url, timeout=600.0) as client:
        content = body if mode == "content-length" else chunks(body)
        resp = client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    answer_s = time.perf_counter() - start
    time.sleep(0.3)
    stop.set()
    rss.stop.set()
    rss.join()
    latencies, failures = results.get(timeout=60)
    gaps = gap_results.get(timeout=60)
    health.join()
    stream.join()
    if failures:
        raise RuntimeError(f"/health failed {failures} times during the {size_mb} MB {mode} request")
    return Case(config, size_mb, mode, resp.status_code, answer_s, statistics.median(latencies), max(latencies),
                max(gaps) if gaps else float("nan"), (rss.peak - before) / MIB)


def make_model(root: Path) -> Path:
    model = root / "tiny"
    subprocess.run([sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3", "--out", str(model),
                    "--num-hidden-layers", "1", "--shards", "1"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, **ONE_THREAD})
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: a make-tiny model)")
    parser.add_argument("--sizes-mb", default="10,50", help="body sizes in MB (default 10,50)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case (the medians are printed)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp:
        model = args.model or make_model(Path(tmp))
        configs = [("default 8 MiB", []), ("64 MiB limit", ["--max_request_bytes", str(RAISED_LIMIT)])]
        results: list[Case] = []
        for config, flags in configs:
            with LocalServer(["--model", str(model), "--served_model_name", "tiny", *flags],
                             startup_timeout_s=300.0, env=ONE_THREAD) as server:
                httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
                for size_mb in sizes:
                    for mode in ("content-length", "chunked"):
                        runs = [run_case(server, config, size_mb, mode) for _ in range(args.repeats)]
                        results.append(median_case(runs))
    print_table(results)
    return 0 if all(ok(c) for c in results) else 1


def median_case(runs: list[Case]) -> Case:
    first = runs[0]
    med = lambda f: statistics.median(getattr(r, f) for r in runs)  # noqa: E731
    statuses = {r.status for r in runs}
    if len(statuses) != 1:
        raise RuntimeError(f"{first.config} {first.size_mb} MB {first.mode}: statuses differ between runs: {statuses}")
    worst = lambda f: max(getattr(r, f) for r in runs)  # noqa: E731
    return Case(first.config, first.size_mb, first.mode, first.status, med("answer_s"), med("health_median_s"),
                worst("health_max_s"), worst("stream_max_gap_s"), worst("rss_growth_mb"))


def ok(case: Case) -> bool:
    return case.health_max_s < HEALTH_TARGET_S and case.rss_ratio < RSS_TARGET_RATIO


def print_table(results: list[Case]) -> None:
    header = ("server", "body", "sent as", "status", "answer s", "/health median s", "/health max s",
              "stream max gap s", "RSS growth MB", "RSS / body", "targets")
    rows = [(c.config, f"{c.size_mb} MB", c.mode, str(c.status), f"{c.answer_s:.2f}", f"{c.health_median_s:.4f}",
             f"{c.health_max_s:.3f}", f"{c.stream_max_gap_s:.3f}", f"{c.rss_growth_mb:.1f}", f"{c.rss_ratio:.2f}",
             "ok" if ok(c) else "MISSED") for c in results]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"targets: /health max < {HEALTH_TARGET_S} s, RSS growth < {RSS_TARGET_RATIO}x the body "
          "(answer time and /health median: medians of the runs; maxima, stream gap and RSS: the worst run)")
    print(json.dumps([c.__dict__ | {"rss_ratio": round(c.rss_ratio, 3)} for c in results]))


if __name__ == "__main__":
    sys.exit(main())
