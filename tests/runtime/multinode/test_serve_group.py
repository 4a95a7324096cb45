"""`mtp serve --nnodes 2` on loopback: rank 0's HTTP API gives the single-process
greedy outputs; a killed worker takes the group down and fails the in-flight request."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from mtp_runtime.engine.llm import LLM
from mtp_runtime.multinode.liveness import RANK_LOST_EXIT_CODE
from mtp_runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[5, 17, 300, 42, 7], [99, 123, 8, 64, 250, 3, 11]]
MAX_TOKENS = 10
HEARTBEAT_S = 3.0
ENV = {"MTP_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S), "MTP_STARTUP_TIMEOUT_S": "120"}


def start_group(start_rank, free_ports, model, k, ep_size, nnodes=2):
    """Workers first (reverse order), rank 0 last; returns (ranks, http ports)."""
    master, *http = free_ports(nnodes + 1)
    ranks = {}
    for rank in reversed(range(nnodes)):
        ranks[rank] = start_rank(
            "serve", "--model", model, "--draft_model", model, "--num_speculative_tokens", k,
            "--devices", "cpu", "--port", http[rank], "--master_node_addr", f"127.0.0.1:{master}",
            "--nnodes", nnodes, "--node_rank", rank, "--ep_size", ep_size, "--max_seqs_per_batch", 4,
            module="mtp_runtime", env=ENV)
    return [ranks[r] for r in range(nnodes)], http


def wait_healthy(ranks, ports, timeout_s=150.0) -> list[dict]:
    deadline, bodies = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline and len(bodies) < len(ports):
        for i, port in enumerate(ports):
            if ranks[i].proc.poll() is not None:
                raise AssertionError(f"rank {i} exited early:\n{ranks[i].output}")
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.HTTPError:
                continue
            if reply.status_code == 200:
                bodies[i] = reply.json()
            else:
                assert reply.status_code == 503 and reply.json()["state"] in ("waiting_for_master", "loading")
        time.sleep(0.3)
    assert len(bodies) == len(ports), "\n---\n".join(r.output for r in ranks)
    return [bodies[i] for i in range(len(ports))]


def complete(port, prompt, max_tokens=MAX_TOKENS, timeout=60.0) -> httpx.Response:
    body = {"model": "tiny-dsv3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def single_process(tiny_dsv3) -> dict[int, list[str]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for k in (1, 2):
        llm = LLM(str(tiny_dsv3), draft_model=str(tiny_dsv3), num_speculative_tokens=k, device="cpu",
                  dtype="float32", max_seqs_per_batch=4)
        texts[k] = [out.text for out in llm.generate(PROMPTS, params)]
    return texts


@pytest.mark.parametrize("k, ep_size", [(1, 1), (2, 2)])
def test_two_ranks_serve_the_single_process_outputs(start_rank, free_ports, tiny_dsv3, single_process, k, ep_size):
    ranks, ports = start_group(start_rank, free_ports, tiny_dsv3, k, ep_size)
    bodies = wait_healthy(ranks, ports)
    assert [b["state"] for b in bodies] == ["ready", "ready"]
    for prompt, expected in zip(PROMPTS, single_process[k]):
        reply = complete(ports[0], prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
    assert httpx.post(f"http://127.0.0.1:{ports[1]}/v1/completions", json={}).status_code == 404
    worker_metrics = httpx.get(f"http://127.0.0.1:{ports[1]}/metrics").text
    assert 'mtp_node_state{state="ready"} 1.0' in worker_metrics
    assert float(re.search(r"^mtp_worker_model_calls (\S+)$", worker_metrics, re.M).group(1)) > 0
    ranks[0].proc.send_signal(signal.SIGTERM)
    codes = [rank.wait(30) for rank in ranks]
    assert codes == [0, 0], "\n---\n".join(r.output for r in ranks)


def test_killed_worker_fails_the_request_and_the_group(start_rank, free_ports, tiny_dsv3):
    ranks, ports = start_group(start_rank, free_ports, tiny_dsv3, 1, 1)
    wait_healthy(ranks, ports)
    replies: list[httpx.Response] = []
    request = threading.Thread(target=lambda: replies.append(complete(ports[0], PROMPTS[0], 3000, timeout=90)))
    request.start()
    time.sleep(2.0)  # well into the generation of 3000 tokens
    ranks[1].proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = ranks[0].wait(HEARTBEAT_S + 15)
    request.join(timeout=30)
    assert code == RANK_LOST_EXIT_CODE, ranks[0].output
    assert time.monotonic() - killed < HEARTBEAT_S + 15
    assert "rank 1 lost" in ranks[0].output
    assert replies and replies[0].status_code >= 500, replies and replies[0].text
