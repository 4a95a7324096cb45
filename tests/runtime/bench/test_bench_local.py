"""`mtp bench --model`: one command starts a baseline and an MTP server and compares them."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts real server processes

# Same training arguments as the server tests, so make-tiny's cache serves both.
TRAINING = ("--train-steps", "120", "--train-batch", "8", "--train-seq-len", "64")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def mtp(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtp_runtime", *argv], capture_output=True, text=True,
                          env={**os.environ, **ONE_THREAD}, timeout=timeout)


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-model")
    done = mtp("make-tiny", "--arch", "deepseek_v3", "--out", str(root / "tiny"), *TRAINING)
    assert done.returncode == 0, done.stderr
    done = mtp("export", "--input-dir", str(root / "tiny"), "--output-dir", str(root / "tiny-mtp"))
    assert done.returncode == 0, done.stderr
    return str(root / "tiny"), str(root / "tiny-mtp")


def test_local_comparison_writes_table_json_and_plot(trained_tiny, tmp_path):
    main, draft = trained_tiny
    out = tmp_path / "results"
    done = mtp("bench", "--model", main, "--draft_model", draft, "--num-speculative-tokens", "2",
               "--concurrency", "1,2", "--input-len", "16", "--output-len", "12", "--requests-per-level", "3",
               "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((out / "bench.json").read_text())
    base, spec = doc["runs"]["baseline"], doc["runs"]["mtp"]
    assert [r["concurrency"] for r in base] == [r["concurrency"] for r in spec] == [1, 2]
    for level in base + spec:
        assert level["failed"] == 0 and level["requests"] == 3
        assert level["output_tokens"] == 3 * 12 and level["prompt_tokens"] == 3 * 16
        assert level["mean_tpot_ms"] > 0 and level["mean_ttft_ms"] > 0 and level["output_tokens_per_s"] > 0
    assert all(level["acceptance_rate"] is None for level in base)  # no draft, no spec counters moving
    for level in spec:  # read from the server's /metrics, so it is a real fraction of real drafts
        assert 0 < level["acceptance_rate"] <= 1 and set(level["accepted_per_position"]) == {"0", "1"}
    assert set(doc["mtp_over_baseline_output_tokens_per_s"]) == {"1", "2"}
    assert "MTP/base output tokens/s" in (out / "bench.md").read_text()
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "MTP/baseline output tokens/s at concurrency 1" in done.stdout


def test_url_mode_needs_a_tokenizer(tmp_path):
    done = mtp("bench", "--url", "http://127.0.0.1:9", "--out", str(tmp_path))
    assert done.returncode == 2 and "--tokenizer" in done.stderr


def test_output_spread_must_leave_every_request_a_token(tmp_path):
    done = mtp("bench", "--url", "http://127.0.0.1:9", "--tokenizer", str(tmp_path), "--output-len", "12",
               "--output-spread", "12", "--out", str(tmp_path))
    assert done.returncode == 2 and "--output-spread 12 must lie in [0, --output-len 12)" in done.stderr


def test_requests_per_client_must_be_positive(tmp_path):
    done = mtp("bench", "--url", "http://127.0.0.1:9", "--tokenizer", str(tmp_path), "--requests-per-client", "0",
               "--out", str(tmp_path))
    assert done.returncode == 2 and "--requests-per-client" in done.stderr
