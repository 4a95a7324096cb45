"""HTTP probes against a real loopback server."""

from __future__ import annotations

import http.server
import socket

import pytest

from mtp_operator.probes import fetch_metrics, probe_health


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path.startswith("/dying"):  # a rank that dies while it answers: headers, then no body
            self.send_response(503 if self.path == "/dying-503" else 200)
            self.send_header("Content-Length", "20")
            self.end_headers()
            self.close_connection = True
            return
        code, body = {"/health": (200, b"{}"), "/loading": (503, b'{"state": "loading"}'),
                      "/metrics": (200, b"mtp_spec_decode_draft_tokens_total 3\n")}.get(self.path, (404, b""))
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)



@pytest.fixture(scope="module")
def port(serve_http):
    with serve_http(Handler) as port:
        yield port


def test_health_results(port):
    assert probe_health("127.0.0.1", port, "/health", 2).healthy
    loading = probe_health("127.0.0.1", port, "/loading", 2)
    assert not loading.healthy and loading.detail.startswith("503") and "loading" in loading.detail
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert not probe_health("127.0.0.1", closed, "/health", 1).healthy


def test_fetch_metrics_and_error_names_the_url(port):
    assert "draft_tokens_total 3" in fetch_metrics("127.0.0.1", port, "/metrics", 2)
    with pytest.raises(OSError, match=f"GET http://127.0.0.1:{port}/nothing"):
        fetch_metrics("127.0.0.1", port, "/nothing", 2)


def test_an_answer_that_breaks_off_is_a_failed_probe_not_an_exception(port):
    import mtp_operator.local.probe as local

    dying = probe_health("127.0.0.1", port, "/dying-503", 2)
    assert not dying.healthy and dying.detail == "503"
    for path in ("/dying-503", "/dying-200"):
        with pytest.raises(OSError, match=f"GET http://127.0.0.1:{port}{path}"):
            fetch_metrics("127.0.0.1", port, path, 2)
        # the local runner's (mtp up) probes and scrapes read every body: the same answer is no answer
        with pytest.raises(OSError, match=f"GET http://127.0.0.1:{port}{path}: the answer broke off"):
            local.get(f"http://127.0.0.1:{port}{path}", 2)
