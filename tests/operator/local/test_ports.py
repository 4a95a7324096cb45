"""Port checks: a port in TIME_WAIT is free for a server, a listening one is not."""

import socket
import time
from pathlib import Path

import yaml

from mtp_operator.local.launch import choose_ports, port_block_is_free
from mtp_operator.local.ports import free_ports, port_is_free
from mtp_operator.spec import parse_spec

SAMPLE = Path(__file__).resolve().parents[3] / "crds" / "samples" / "tiny-cpu.yaml"


def leave_in_time_wait() -> int:
    """A loopback port whose server side closed a connection first: it sits in TIME_WAIT for a minute,
    as rank 0's HTTP port does right after `mtp up` is stopped with Ctrl-C."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server closes first: its end goes to TIME_WAIT once the client closes too
    assert client.recv(1) == b""
    client.close()
    listener.close()
    deadline = time.monotonic() + 5
    while not _bind_without_reuse_fails(port):
        assert time.monotonic() < deadline, "the kernel did not keep the port in TIME_WAIT"
        time.sleep(0.05)
    return port


def _bind_without_reuse_fails(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_a_port_in_time_wait_is_free():
    port = leave_in_time_wait()
    assert port_is_free(port)
    assert port_block_is_free(port, 1)


def test_a_listening_port_is_busy():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert not port_is_free(port)
        assert not port_block_is_free(port, 1)


def test_out_of_range_ports_are_not_free():
    assert not port_is_free(0) and not port_is_free(65536)


def test_restarting_soon_after_ctrl_c_keeps_the_spec_ports():
    # Before: the check bound without SO_REUSEADDR, so `mtp up` moved off port 8000 for a minute.
    http = leave_in_time_wait()
    master = free_ports(1)[0]
    data = yaml.safe_load(SAMPLE.read_text())["spec"]
    spec = parse_spec({**data, "ports": {"http": http, "master": master}})
    assert choose_ports(spec, None, None) == [(http, master)]
