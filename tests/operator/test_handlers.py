"""kopf wiring (registration) and rank-0 scraping into the per-object memo."""

from __future__ import annotations

import http.server

import pytest

from mtp_operator.handlers import build_registry, scrape_rank0
from mtp_operator.settings import OperatorSettings


class Metrics(http.server.BaseHTTPRequestHandler):
    draft, accepted = 100, 80

    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = (f"mtp_spec_decode_draft_tokens_total {Metrics.draft}\n"
                f"mtp_spec_decode_accepted_tokens_total {Metrics.accepted}\n").encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)



@pytest.fixture
def port(serve_http):
    with serve_http(Metrics) as port:
        yield port


def test_registry_has_the_handlers_and_indices():
    registry = build_registry(OperatorSettings(reconcile_interval=3, metrics_interval=7))
    ids = {h.id for reg in (registry._changing, registry._spawning, registry._indexing)
           for h in reg.get_all_handlers()}
    assert {"created", "updated", "resumed", "level", "scrape", "mtp_jobs", "mtp_pods", "mtp_statefulsets"} <= ids
    timers = {h.id: h.interval for h in registry._spawning.get_all_handlers()}
    assert timers == {"level": 3, "scrape": 7}


def test_scrape_uses_deltas_and_resets_on_a_new_rank0_pod(make_cr, port):
    cr = make_cr(changes={"ports": {"http": port}})
    cr["status"] = {"phase": "Running"}
    pods = {("default", "ds"): [{"component": "server", "rank": 0, "podIP": "127.0.0.1", "uid": "a",
                                 "terminating": False, "ready": True, "group": 0}]}
    memo: dict = {}
    settings = OperatorSettings()
    Metrics.draft, Metrics.accepted = 100, 80
    assert scrape_rank0(cr, memo, pods, settings)
    assert memo["fresh_stats"][0].acceptance_rate == pytest.approx(0.8)  # since start
    Metrics.draft, Metrics.accepted = 200, 130
    scrape_rank0(cr, memo, pods, settings)
    assert memo["fresh_stats"][0].acceptance_rate == pytest.approx(0.5)  # the last interval only
    pods[("default", "ds")][0]["uid"] = "b"  # rank 0 replaced: its counters restarted
    Metrics.draft, Metrics.accepted = 40, 30
    scrape_rank0(cr, memo, pods, settings)
    assert memo["fresh_stats"][0].acceptance_rate == pytest.approx(0.75)


def test_scrape_skips_groups_that_are_not_running(make_cr, port):
    cr = make_cr(changes={"ports": {"http": port}})
    cr["status"] = {"phase": "Starting"}
    assert not scrape_rank0(cr, {}, {}, OperatorSettings())
    cr["status"] = {"phase": "Running"}
    assert not scrape_rank0(cr, {}, {}, OperatorSettings())  # no rank-0 pod known yet


class Accepting(http.server.BaseHTTPRequestHandler):
    """An API server that takes whatever it is sent (the handler's events)."""

    def do_POST(self):  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")


def test_a_change_of_conditions_becomes_one_status_update_of_the_newest_copy(make_cr, serve_http):
    # A merge patch would replace the whole list with `body`'s copy of another writer's condition;
    # the handler hands kopf a transformation instead, and a second run (kopf re-applying a patch
    # whose resourceVersion test failed) replaces the pending one rather than adding another.
    import kopf
    from kubernetes import client

    from mtp_operator.status import StatusUpdate

    with serve_http(Accepting) as api_port:
        registry = build_registry(OperatorSettings(), api_client_factory=lambda: client.ApiClient(
            client.Configuration(host=f"http://127.0.0.1:{api_port}")))
        startup = next(h for h in registry._activities.get_all_handlers() if h.id.endswith("configure"))
        startup.fn(settings=kopf.OperatorSettings())
        level = next(h for h in registry._spawning.get_all_handlers() if h.id == "level")
        theirs = {"type": "ExternalCheck", "status": "True", "reason": "Checked", "message": "round 3"}
        cr = make_cr(changes={"nnodes": 0})  # refused: the reconcile needs no children to decide
        cr["metadata"]["resourceVersion"] = "7"
        cr["status"] = {"conditions": [theirs]}
        body, memo = kopf.Body(cr), kopf.Memo()
        patch = kopf.Patch(body=body)
        indices = {"mtp_jobs": {}, "mtp_pods": {}, "mtp_statefulsets": {}, "mtp_revisions": {}}
        for _ in range(2):
            level.fn(body=body, patch=patch, memo=memo, **indices)
        assert "status" not in patch  # nothing merge-patched: all of it is in the one transformation
        [update] = patch.fns
        assert isinstance(update, StatusUpdate)
        newest = {**cr, "status": {"conditions": [{**theirs, "message": "round 4"}]}}
        update(newest)
        assert newest["status"]["phase"] == "Failed"
        assert [x["type"] for x in newest["status"]["conditions"]] == [
            "DraftReady", "Ready", "Progressing", "Degraded", "ExternalCheck"]
        assert newest["status"]["conditions"][-1]["message"] == "round 4"
        # Conditions unchanged: the figures go by merge patch, which no other writer's field is in.
        settled = kopf.Body({**cr, "status": newest["status"]})
        plain = kopf.Patch(body=settled)
        level.fn(body=settled, patch=plain, memo=memo, **indices)
        assert not plain.fns
