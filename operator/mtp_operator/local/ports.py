"""Free TCP ports on loopback for the ranks' HTTP and rendezvous sockets.

Checks bind with SO_REUSEADDR, as the servers themselves do (uvicorn, torch's
TCPStore): a port whose last connection is in TIME_WAIT, as after a Ctrl-C,
is free for them, and a port another process listens on is still busy.
"""

from __future__ import annotations

import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago.

    All sockets are held open until every port is chosen, so the kernel
    cannot hand out the same port twice.
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if a server could listen on `port` now."""
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
