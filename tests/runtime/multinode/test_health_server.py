"""A worker rank's /health and /metrics, in process."""

import httpx

from mtp_runtime.multinode.health_server import WorkerHealthServer
from mtp_runtime.multinode.node_state import NodeState


def test_health_follows_the_node_state_and_api_paths_point_to_rank_0():
    state = NodeState(rank=2, nnodes=4)
    server = WorkerHealthServer("127.0.0.1", 0, state, model_calls=lambda: 7).start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        reply = httpx.get(f"{base}/health")
        assert (reply.status_code, reply.json()["state"], reply.json()["rank"]) == (503, "waiting_for_master", 2)
        state.loading()
        assert httpx.get(f"{base}/health").json()["state"] == "loading"
        state.ready()
        assert httpx.get(f"{base}/health").status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        assert 'mtp_node_state{state="ready"} 1.0' in metrics and "mtp_worker_model_calls 7.0" in metrics
        for reply in (httpx.post(f"{base}/v1/completions", json={}), httpx.get(f"{base}/v1/models")):
            assert reply.status_code == 404 and "rank 0" in reply.json()["error"]
        state.failed("rank 1 lost")
        assert httpx.get(f"{base}/health").status_code == 503
    finally:
        server.stop()
