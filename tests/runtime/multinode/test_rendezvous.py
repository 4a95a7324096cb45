"""Rendezvous: node rank, backend, master address, and a real group on loopback."""

from __future__ import annotations

import time

import pytest

from mtp_runtime.multinode.node_rank import (
    POD_INDEX_ENV,
    POD_INDEX_LABEL,
    POD_LABELS_FILE_ENV,
    NodeRankError,
    resolve_node_rank,
)
from mtp_runtime.multinode.rendezvous import (
    RendezvousConfig,
    RendezvousError,
    backend_for_device,
    parse_master_addr,
    rendezvous,
)


def test_node_rank_explicit_and_env():
    assert resolve_node_rank("2", 4, environ={}) == 2
    assert resolve_node_rank(3, 4, environ={}) == 3
    assert resolve_node_rank("auto", 4, environ={POD_INDEX_ENV: "1"}, hostname="x-3") == 1


def test_node_rank_from_labels_file(tmp_path):
    labels = tmp_path / "labels"
    labels.write_text(f'app="mtp"\n{POD_INDEX_LABEL}="2"\n')
    env = {POD_LABELS_FILE_ENV: str(labels)}
    assert resolve_node_rank("auto", 4, environ=env, hostname="x-3") == 2


def test_node_rank_from_hostname():
    assert resolve_node_rank("auto", 8, environ={}, hostname="mtp-deepseek-3") == 3
    assert resolve_node_rank("auto", 8, environ={}, hostname="mtp-7.mtp-headless.ns.svc") == 7


@pytest.mark.parametrize(
    "value, env, host, needle",
    [
        ("auto", {}, "laptop", "does not end in -<ordinal>"),
        ("auto", {POD_INDEX_ENV: "x"}, "a-1", POD_INDEX_ENV),
        ("auto", {}, "mtp-9", "outside 0..3"),
        ("first", {}, "a-1", "--node_rank 'first'"),
        ("4", {}, "a-1", "outside 0..3 for --nnodes 4"),
    ],
)
def test_node_rank_errors_name_the_source(value, env, host, needle):
    with pytest.raises(NodeRankError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        resolve_node_rank(value, 4, environ=env, hostname=host)


def test_backend_for_device():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device("cuda:0") == "nccl"
    assert backend_for_device("npu:0,npu:1") == "hccl"
    with pytest.raises(RendezvousError, match="--devices 'tpu:0'"):
        backend_for_device("tpu:0")


def test_parse_master_addr():
    assert parse_master_addr("mtp-0.mtp:29500") == ("mtp-0.mtp", 29500)
    assert parse_master_addr("[::1]:1234") == ("::1", 1234)
    for bad in ("mtp-0", "mtp-0:", ":29500", "h:99999", "h:port"):
        with pytest.raises(RendezvousError, match="--master_node_addr"):
            parse_master_addr(bad)


def test_gives_up_after_startup_timeout_naming_the_master():
    cfg = RendezvousConfig("never-there:29500", 2, node_rank=1, startup_timeout_s=0.6, backoff_initial_s=0.1)

    def unresolvable(host: str) -> str:
        raise OSError(f"Name or service not known: {host}")

    started = time.monotonic()
    with pytest.raises(RendezvousError, match="'never-there' did not resolve within the startup timeout"):
        rendezvous(cfg, resolve=unresolvable)
    assert time.monotonic() - started < 5


def test_ranks_in_reverse_order_and_late_dns(start_rank, free_port):
    """Rank 2 starts first and sees no DNS for its first seconds; rank 0 last."""
    ranks = []
    for rank, dns_delay, start_delay in ((2, 3.0, 1.0), (1, 0.0, 1.5), (0, 0.0, 0.0)):
        ranks.append(start_rank("rendezvous", rank, 3, free_port, "--resolve-delay", dns_delay))
        time.sleep(start_delay)
    codes = [r.wait(60) for r in ranks]
    outputs = [r.output for r in ranks]
    assert codes == [0, 0, 0], "\n---\n".join(outputs)
    for out in outputs:
        assert "SUM 6" in out and "STATE ready" in out
    worker2, worker1 = outputs[0], outputs[1]
    assert "rank 2 waiting for master address 'mtp-test-0.mtp-test' to resolve" in worker2
    assert "rank 2 waiting for master address 'mtp-test-0.mtp-test' to resolve: done after" in worker2
    assert "to resolve" not in worker1
