"""The OpenAI API of a real `mtp serve` process: results, streams, metrics, errors.

Each server start loads torch and a model, so servers are module-scoped and
the model pair (main + exported draft) from `mtp make-tiny` is built once.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from mtp_runtime.bench.local_server import LocalServer, free_port
from mtp_runtime.bench.prompts import load_tokenizer
from mtp_runtime.bench.server_metrics import parse_spec_counters
from mtp_runtime.bench.suite import BenchPlan, bench_servers

pytestmark = pytest.mark.slow  # starts real server processes

PROMPT = "def fibonacci(n):\n    "
API_KEY = "test-key"
SERVED_NAME = "tiny"
# Half a minute of joint training makes the draft agree with the main model
# about half the time, so acceptance is real; make-tiny caches the result.
TRAINING = ("--train-steps", "120", "--train-batch", "8", "--train-seq-len", "64")
# One torch thread: on a shared 2-core CI box, spinning thread pools make tiny ops 10x slower.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _mtp(*argv: str) -> None:
    done = subprocess.run([sys.executable, "-m", "mtp_runtime", *argv], capture_output=True, text=True,
                          env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, f"mtp {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    main, draft = root / "tiny", root / "tiny-mtp"
    _mtp("make-tiny", "--arch", "deepseek_v3", "--out", str(main), *TRAINING)
    _mtp("export", "--input-dir", str(main), "--output-dir", str(draft))
    return str(main), str(draft)


def start_server(flags: list[str]) -> LocalServer:
    return LocalServer(flags, startup_timeout_s=180.0, env=ONE_THREAD)


@pytest.fixture(scope="module")
def mtp_server(tiny_models):
    main, draft = tiny_models
    with start_server(["--model", main, "--draft_model", draft, "--num_speculative_tokens", "2",
                       "--served_model_name", SERVED_NAME, "--api_key", API_KEY, "--max_model_len", "256",
                       "--max_seqs_per_batch", "4", "--max_waiting_requests", "2"]) as server:
        yield server
        assert server.stop() == 0, server.log_tail()


@pytest.fixture(scope="module")
def base_server(tiny_models):
    main, _ = tiny_models
    with start_server(["--model", main, "--served_model_name", SERVED_NAME, "--shutdown_timeout", "2"]) as server:
        yield server


@pytest.fixture
def mtp_client(mtp_server):
    with httpx.Client(base_url=mtp_server.base_url, timeout=60.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture
def base_client(base_server):
    with httpx.Client(base_url=base_server.base_url, timeout=60.0) as client:
        yield client


def sse_payloads(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


def wait_idle(client: httpx.Client, idle_free_blocks: int, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = client.get("/health").json()
        if health["requests_in_flight"] == 0 and health["free_blocks"] == idle_free_blocks:
            return health
        assert time.monotonic() < deadline, f"blocks not freed: {health}, idle had {idle_free_blocks} free"
        time.sleep(0.1)


def test_health_and_models(mtp_client):
    health = mtp_client.get("/health")
    assert health.status_code == 200
    body = health.json()
    assert body["state"] == "ready" and body["num_speculative_tokens"] == 2
    assert 0 < body["free_blocks"] <= body["total_blocks"]
    models = mtp_client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]


def test_greedy_text_identical_with_and_without_draft(mtp_client, base_client):
    for prompt in (PROMPT, "import os\nimport sys\n\n"):
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        spec = mtp_client.post("/v1/completions", json=body).json()
        plain = base_client.post("/v1/completions", json=body).json()
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert spec["usage"] == plain["usage"]
        assert spec["usage"]["completion_tokens"] <= 40 and spec["usage"]["prompt_tokens"] > 0


def test_completion_stream_matches_non_stream(mtp_client):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    full = mtp_client.post("/v1/completions", json=body).json()
    with mtp_client.stream("POST", "/v1/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(resp)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert events[-2]["usage"] == full["usage"]


def test_chat_stream_and_non_stream(mtp_client):
    body = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "system", "content": "You write Python."},
                         {"role": "user", "content": "A function that adds two numbers."}]}
    full = mtp_client.post("/v1/chat/completions", json=body).json()
    assert full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    with mtp_client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        events = sse_payloads(resp)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == message["content"]
    assert events[-2]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


def test_sampling_with_seed_is_reproducible(mtp_client):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 0.8, "top_p": 0.9,
            "top_k": 50, "seed": 1234}
    first = mtp_client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert mtp_client.post("/v1/completions", json=body).json()["choices"][0]["text"] == first


def test_stop_string_ends_the_text(mtp_client):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    text = mtp_client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = next(c for c in text[3:] if not c.isspace())
    stopped = mtp_client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[:text.index(stop)]
    with mtp_client.stream("POST", "/v1/completions", json={**body, "stop": [stop], "stream": True}) as resp:
        events = sse_payloads(resp)
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == stopped["text"] and chunks[-1]["finish_reason"] == "stop"


def test_metrics_move_after_requests(mtp_client):
    def scrape():
        text = mtp_client.get("/metrics").text
        return text, parse_spec_counters(text)

    text, before = scrape()
    for name in ("mtp_spec_decode_draft_tokens_total", "mtp_spec_decode_accepted_tokens_total",
                 "mtp_spec_decode_steps_total", 'mtp_spec_decode_accepted_tokens_per_position_total{position="1"}',
                 "mtp_generation_tokens_total", "mtp_prompt_tokens_total", "mtp_time_to_first_token_seconds_count",
                 "mtp_time_per_output_token_seconds_count", "mtp_requests_running", "mtp_requests_waiting",
                 "mtp_kv_cache_usage_ratio"):
        assert name in text, name
    usage = mtp_client.post("/v1/completions", json={"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 32,
                                                     "temperature": 0, "ignore_eos": True}).json()["usage"]
    text, after = scrape()
    delta = after.minus(before)
    assert usage["completion_tokens"] == 32
    assert delta.steps > 0 and delta.draft == 2 * delta.steps
    assert 0 < delta.accepted <= delta.draft
    assert sum(delta.per_position.values()) == delta.accepted
    # 1 token from prefill, then each verify step yields its accepted drafts + 1
    assert delta.accepted + delta.steps + 1 >= 32


def test_cancelled_stream_frees_its_blocks(mtp_client):
    idle = mtp_client.get("/health").json()["free_blocks"]
    body = {"model": SERVED_NAME, "prompt": PROMPT * 3, "max_tokens": 150, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with mtp_client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        got = 0
        while got < 3:
            got += next(lines).startswith("data: ")
        busy = mtp_client.get("/health").json()
        assert busy["requests_in_flight"] == 1 and busy["free_blocks"] < idle
    # leaving the block closed the connection mid-stream
    wait_idle(mtp_client, idle)


def test_full_queue_answers_429_and_recovers(mtp_server, mtp_client):
    idle = mtp_client.get("/health").json()["free_blocks"]
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    clients, statuses = [], []
    try:
        for _ in range(8):  # the server admits 4 running + 2 waiting
            client = httpx.Client(base_url=mtp_server.base_url, timeout=60.0, headers=headers)
            clients.append(client)
            resp = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
            statuses.append(resp.status_code)
            if resp.status_code == 429:
                error = json.loads(resp.read())["error"]
                assert error["type"] == "rate_limit_error"
    finally:
        for client in clients:
            client.close()
    assert statuses.count(200) == 6 and statuses.count(429) == 2, statuses
    wait_idle(mtp_client, idle)


def test_bench_client_against_this_server(mtp_server, tiny_models):
    # `mtp bench --url` mode: the model name from /v1/models, the key, acceptance from /metrics
    plan = BenchPlan(concurrency=[2], input_len=12, output_len=10, requests_per_level=4, warmup_requests=1)
    tokenizer = load_tokenizer(tiny_models[0])
    [level] = asyncio.run(bench_servers({"server": mtp_server.base_url}, tokenizer, plan, API_KEY))["server"]
    assert level.failed == 0 and level.output_tokens == 40 and level.prompt_tokens == 48
    assert 0 < level.acceptance_rate <= 1 and level.mean_tpot_ms > 0
    # with an output spread every request asks for its own seeded length, and gets it
    spread = BenchPlan(concurrency=[2], input_len=12, output_len=10, requests_per_level=4, warmup_requests=0,
                       output_spread=6, seed=3)
    lengths = spread.output_lengths(4)
    assert len(set(lengths)) > 1 and sum(lengths) != 40
    [level] = asyncio.run(bench_servers({"server": mtp_server.base_url}, tokenizer, spread, API_KEY))["server"]
    assert level.failed == 0 and level.output_tokens == sum(lengths)


def error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def test_error_cases(mtp_client, mtp_server):
    url = "/v1/completions"
    ok = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 4}
    assert "JSON" in error(mtp_client.post(url, content=b"{not json"), 400)["message"]
    error(mtp_client.post(url, json=[1, 2]), 400)
    assert error(mtp_client.post(url, json={"model": SERVED_NAME}), 400)["param"] == "prompt"
    assert error(mtp_client.post(url, json={**ok, "max_tokens": "4"}), 400)["param"] == "max_tokens"
    assert error(mtp_client.post(url, json={**ok, "temperature": "hot"}), 400)["param"] == "temperature"
    assert error(mtp_client.post(url, json={**ok, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert error(mtp_client.post(url, json={**ok, "max_tokens": 10_000}), 400)["param"] == "max_tokens"
    long_prompt = error(mtp_client.post(url, json={**ok, "prompt": [5] * 300}), 400)
    assert long_prompt["param"] == "prompt" and long_prompt["code"] == "context_length_exceeded"
    assert error(mtp_client.post(url, json={**ok, "prompt": [10**9]}), 400)["param"] == "prompt"
    assert error(mtp_client.post(url, json={**ok, "n": 3}), 400)["param"] == "n"
    assert error(mtp_client.post(url, json={**ok, "model": "gpt-4"}), 404)["code"] == "model_not_found"
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": 7}]}
    assert error(mtp_client.post("/v1/chat/completions", json=chat), 400)["param"] == "messages.0.content"
    error(mtp_client.get("/v1/nothing-here"), 404)
    with httpx.Client(base_url=mtp_server.base_url, timeout=30.0) as anonymous:
        assert error(anonymous.post(url, json=ok), 401)["type"] == "authentication_error"
        error(anonymous.post(url, json=ok, headers={"Authorization": "Bearer wrong"}), 401)
        error(anonymous.get("/v1/models"), 401)
        assert anonymous.get("/health").status_code == 200  # probes need no key
    assert mtp_client.post(url, json=ok).status_code == 200  # and the server is still serving


def test_bad_flag_exits_2_naming_it(tiny_models):
    done = subprocess.run([sys.executable, "-m", "mtp_runtime", "serve", "--model", tiny_models[0],
                           "--block_size", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--block_size" in done.stderr


def test_model_that_fails_to_load_exits_3_naming_the_file(tiny_models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models[0], broken)
    shard = broken / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    done = subprocess.run([sys.executable, "-m", "mtp_runtime", "serve", "--model", str(broken), "--host",
                           "127.0.0.1", "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **ONE_THREAD})
    assert done.returncode == 3 and shard.name in done.stderr, done.stderr[-2000:]


def test_sigterm_during_stream_ends_it_and_exits_0(base_server, base_client):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with base_client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the stream has started
        base_server.process.terminate()  # SIGTERM, as the kubelet sends it
        started = time.monotonic()
        events = [json.loads(l[6:]) if l != "data: [DONE]" else "[DONE]" for l in lines if l.startswith("data: ")]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
    assert base_server.process.wait(timeout=30) == 0
    assert time.monotonic() - started < 15
