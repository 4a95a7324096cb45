"""`mtp serve --nnodes 2|4` on loopback: rank 0's HTTP API gives the single-process
greedy outputs (tensor and expert parallel, k = 1 and 2), also with a trained draft
that the group accepts as often as the single process does; a killed worker takes
the group down and fails the in-flight request."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from mtp_runtime.bench.server_metrics import parse_spec_counters
from mtp_runtime.engine.llm import LLM
from mtp_runtime.engine.llm_engine import RequestOutput
from mtp_runtime.multinode.liveness import RANK_LOST_EXIT_CODE
from mtp_runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[5, 17, 300, 42, 7], [99, 123, 8, 64, 250, 3, 11]]
MAX_TOKENS = 10
# Python source like the training corpus, so the trained draft gets accepted: with k = 2 the single
# process has steps that accept both drafts (plus the bonus token), only the first, and none.
TEXT_PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass ",
                "    for i in range(len(items)):\n        "]
TEXT_MAX_TOKENS = 16
HEARTBEAT_S = 3.0
ENV = {"MTP_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S), "MTP_STARTUP_TIMEOUT_S": "120"}


def start_group(start_rank, free_ports, model, k, ep_size, nnodes=2, extra=()):
    """Workers first (reverse order), rank 0 last; returns (ranks, http ports)."""
    master, *http = free_ports(nnodes + 1)
    ranks = {}
    for rank in reversed(range(nnodes)):
        ranks[rank] = start_rank(
            "serve", "--model", model, "--draft_model", model, "--num_speculative_tokens", k,
            "--devices", "cpu", "--port", http[rank], "--master_node_addr", f"127.0.0.1:{master}",
            "--nnodes", nnodes, "--node_rank", rank, "--ep_size", ep_size, "--max_seqs_per_batch", 4, *extra,
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


def stop_group(ranks) -> None:
    ranks[0].proc.send_signal(signal.SIGTERM)
    codes = [rank.wait(30) for rank in ranks]
    assert codes == [0] * len(ranks), "\n---\n".join(r.output for r in ranks)


def complete(port, prompt, max_tokens=MAX_TOKENS, timeout=60.0, model="tiny-dsv3") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout)


def single_process_outputs(model, prompts, k, max_tokens) -> list[RequestOutput]:
    llm = LLM(str(model), draft_model=str(model), num_speculative_tokens=k, device="cpu", dtype="float32",
              max_seqs_per_batch=4)
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def single_process(tiny_dsv3) -> dict[int, list[str]]:
    return {k: [out.text for out in single_process_outputs(tiny_dsv3, PROMPTS, k, MAX_TOKENS)] for k in (1, 2)}


@pytest.mark.parametrize("nnodes, k, ep_size", [(2, 1, 1), (2, 2, 2), (4, 2, 1), (4, 1, 4)])
def test_group_serves_the_single_process_outputs(start_rank, free_ports, tiny_dsv3, single_process,
                                                 nnodes, k, ep_size):
    ranks, ports = start_group(start_rank, free_ports, tiny_dsv3, k, ep_size, nnodes)
    bodies = wait_healthy(ranks, ports)
    assert [b["state"] for b in bodies] == ["ready"] * nnodes
    for prompt, expected in zip(PROMPTS, single_process[k]):
        reply = complete(ports[0], prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
    for port in ports[1:]:
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={}).status_code == 404
        worker_metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'mtp_node_state{state="ready"} 1.0' in worker_metrics
        assert float(re.search(r"^mtp_worker_model_calls (\S+)$", worker_metrics, re.M).group(1)) > 0
    stop_group(ranks)


@pytest.fixture(scope="module")
def trained_single_process(trained_dsv3) -> list[RequestOutput]:
    return single_process_outputs(trained_dsv3, TEXT_PROMPTS, 2, TEXT_MAX_TOKENS)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_two_ranks_accept_the_drafts_the_single_process_accepts(start_rank, free_ports, trained_dsv3,
                                                                 trained_single_process, ep_size):
    expected = trained_single_process
    steps = sum(out.verify_steps for out in expected)
    per_position = [sum(out.accepted_per_position[p] for out in expected) for p in (0, 1)]
    # So that equal outputs below mean the accept path ran across ranks: the single process took
    # steps that accepted both drafts (and the bonus token), only the first (the second's cache
    # position rolled back), and none.
    assert steps > per_position[0] > per_position[1] > 0, [out.accepted_per_position for out in expected]
    ranks, ports = start_group(start_rank, free_ports, trained_dsv3, 2, ep_size)
    wait_healthy(ranks, ports)
    for prompt, out in zip(TEXT_PROMPTS, expected):
        reply = complete(ports[0], prompt, TEXT_MAX_TOKENS, model=trained_dsv3.name)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == out.text
    counters = parse_spec_counters(httpx.get(f"http://127.0.0.1:{ports[0]}/metrics").text)
    assert counters.accepted > 0
    # The sharded draft proposes what the unsharded one does, step for step.
    assert (counters.steps, counters.accepted) == (steps, sum(out.accepted_tokens for out in expected))
    assert counters.per_position == {0: per_position[0], 1: per_position[1]}
    stop_group(ranks)


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


def test_two_ranks_run_the_k_rank_0_chooses_every_step(start_rank, free_ports, trained_dsv3):
    """Adaptive depth across ranks: rank 0's policy picks each step's k and its plans carry it; the
    worker follows the same steps at the same k, and the text is plain greedy decoding's."""
    prompts = [prompt * 2 for prompt in TEXT_PROMPTS] + ["def main():\n    "]
    max_tokens = 96  # 384 tokens, at most 4 a step: past the policy's first probe of another k
    expected = [out.text for out in single_process_outputs(trained_dsv3, prompts, 0, max_tokens)]
    ranks, ports = start_group(start_rank, free_ports, trained_dsv3, 3, 1, extra=("--speculative_adaptive=true",))
    bodies = wait_healthy(ranks, ports)
    assert bodies[0]["speculative_policy"] == "adaptive" and bodies[0]["num_speculative_tokens"] == 3
    for prompt, text in zip(prompts, expected):
        reply = complete(ports[0], prompt, max_tokens, model=trained_dsv3.name)
        assert reply.status_code == 200, f"{reply.text}\n{ranks[0].output[-4000:]}"
        assert reply.json()["choices"][0]["text"] == text
    leader = httpx.get(f"http://127.0.0.1:{ports[0]}/metrics").text
    cumulative = {int(float(le)): float(n) for le, n in re.findall(
        r'^mtp_spec_decode_num_speculative_tokens_bucket\{le="([0-9.]+)"\} (\S+)$', leader, re.M)}
    steps_by_k = {k: cumulative[k] - cumulative.get(k - 1, 0.0) for k in range(4)}
    worker = httpx.get(f"http://127.0.0.1:{ports[1]}/metrics").text
    followed = {int(k): float(n) for k, n in re.findall(r'^mtp_worker_steps\{k="(\d+)"\} (\S+)$', worker, re.M)}
    assert {k: n for k, n in steps_by_k.items() if n} == followed
    assert sum(followed.values()) >= 96 and len(followed) >= 2, followed
    assert parse_spec_counters(leader).accepted > 0
    # One observation per finished request that drafted at all (a request can run wholly at k = 0).
    observed = float(re.search(r"^mtp_spec_decode_request_acceptance_rate_count (\S+)$", leader, re.M).group(1))
    assert 1 <= observed <= len(prompts), observed
    stop_group(ranks)
