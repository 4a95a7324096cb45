"""NodeState: what /health reports on each rank."""

import pytest

from mtp_runtime.multinode.node_state import NodeState


def test_health_is_503_until_ready_then_200():
    state = NodeState(rank=1, nnodes=4)
    code, body = state.health()
    assert (code, body["state"], body["rank"], body["nnodes"]) == (503, "waiting_for_master", 1, 4)
    state.waiting_for_master("master address not resolving yet")
    state.loading()
    assert state.health()[0] == 503 and state.health()[1]["state"] == "loading"
    state.ready()
    assert state.health()[0] == 200


def test_failed_is_terminal():
    state = NodeState()
    state.loading()
    state.failed("rank 2 lost")
    with pytest.raises(ValueError, match="from 'failed' to 'ready'"):
        state.ready()
    code, body = state.health()
    assert (code, body["state"], body["detail"]) == (503, "failed", "rank 2 lost")


def test_cannot_skip_loading_or_use_unknown_states():
    with pytest.raises(ValueError, match="from 'waiting_for_master' to 'ready'"):
        NodeState().ready()
    with pytest.raises(ValueError, match="unknown node state 'starting'"):
        NodeState().set("starting")
