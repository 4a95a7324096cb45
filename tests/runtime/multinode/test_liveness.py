"""Failing together: ranks that die or hang take the whole group down, fast."""

from __future__ import annotations

import os
import signal
import threading
import time

from mtp_runtime.multinode.liveness import RANK_LOST_EXIT_CODE

TIMEOUT_S = 3.0
# Heartbeat timeout, plus an interval and process exit, plus slack for two
# shared CPU cores: well under the 30 s the product default would take.
BOUND_S = TIMEOUT_S + 7.0


def start_group(start_rank, port, nnodes, mode="lockstep"):
    ranks = [start_rank(mode, r, nnodes, port, "--timeout", TIMEOUT_S) for r in range(nnodes)]
    for rank in ranks:
        rank.wait_for_line("LOCKSTEP" if mode == "lockstep" else "STATE ready", 60)
    return ranks


def wait_exits(ranks, bound_s):
    started = time.monotonic()
    codes = [rank.wait(bound_s - (time.monotonic() - started)) for rank in ranks]
    return codes, time.monotonic() - started


def test_killed_worker_takes_the_group_down(start_rank, free_port):
    ranks = start_group(start_rank, free_port, 3)
    ranks[1].proc.send_signal(signal.SIGKILL)
    codes, elapsed = wait_exits([ranks[0], ranks[2]], BOUND_S)
    outputs = "\n---\n".join(r.output for r in ranks)
    assert codes == [RANK_LOST_EXIT_CODE] * 2, outputs
    assert elapsed < BOUND_S
    for survivor in (ranks[0], ranks[2]):
        assert "rank 1 lost" in survivor.output, outputs
    assert "HOOK failing in-flight requests" in ranks[0].output


def test_hung_worker_is_noticed_within_the_timeout(start_rank, free_port):
    # SIGSTOP keeps the sockets open: the collective alone would wait forever.
    ranks = start_group(start_rank, free_port, 2)
    os.kill(ranks[1].proc.pid, signal.SIGSTOP)
    try:
        codes, elapsed = wait_exits([ranks[0]], BOUND_S)
    finally:
        os.kill(ranks[1].proc.pid, signal.SIGCONT)
    assert codes == [RANK_LOST_EXIT_CODE], ranks[0].output
    assert "rank 1 lost: no heartbeat for" in ranks[0].output
    assert "HOOK failing in-flight requests" in ranks[0].output


def test_killed_master_takes_workers_down(start_rank, free_port):
    ranks = start_group(start_rank, free_port, 2)
    ranks[0].proc.send_signal(signal.SIGKILL)
    codes, _ = wait_exits([ranks[1]], BOUND_S)
    assert codes == [RANK_LOST_EXIT_CODE], ranks[1].output
    assert "rank 0 lost" in ranks[1].output


def test_announced_shutdown_exits_cleanly(start_rank, free_port):
    ranks = start_group(start_rank, free_port, 2, mode="shutdown")
    codes, _ = wait_exits(ranks, BOUND_S + 5)
    assert codes == [0, 0], "\n---\n".join(r.output for r in ranks)
    assert "master announced shutdown" in ranks[1].output


def test_every_survivor_names_the_rank_that_rank_0_found_lost(free_port):
    """The verdict travels through the store: a survivor that only sees the
    collective break still names rank 1, not rank 0 (whose store goes away)."""
    from datetime import timedelta

    import torch.distributed as dist

    from mtp_runtime.multinode.liveness import Heartbeat

    store = dist.TCPStore("127.0.0.1", free_port, 3, True, timedelta(seconds=10), wait_for_workers=False)
    exits: dict[int, int] = {}
    done = {r: threading.Event() for r in (0, 2)}

    def exit_for(rank):
        def record(code):
            exits[rank] = code
            done[rank].set()
        return record

    beats = {r: Heartbeat(store, r, 3, timeout_s=60.0, interval_s=0.05, exit_fn=exit_for(r)) for r in (0, 2)}
    reasons: list[str] = []
    beats[2].add_failure_hook(reasons.append)
    for beat in beats.values():
        beat.start()
    beats[0].fail("no heartbeat for 3.1s (timeout 3s, last beat #7)", lost_rank=1)
    assert done[2].wait(5) and done[0].wait(5)
    assert exits == {0: RANK_LOST_EXIT_CODE, 2: RANK_LOST_EXIT_CODE}
    assert reasons and reasons[0].startswith("rank 2: rank 1 lost: no heartbeat for 3.1s")
    assert "noticed by rank 0" in reasons[0]
