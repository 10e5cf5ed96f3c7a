"""Serve replicas' inter-deployment gRPC servers on the node's address instead of all interfaces.

Ray Serve 2.60 starts one gRPC server in every replica (``ReplicaBase._on_initialized``,
``serve/_private/replica.py``) and binds it with ``add_port_to_grpc_server(server, "[::]:0")``:
on all interfaces, whatever the node address, and no Ray or Serve setting changes that string.
Every other Ray port follows the node address (127.0.0.1 under ``xema serve``: ``ray_env``), so
these were the app's only listeners reachable from the network (one per replica: Router, Stats,
one per ModelGroup; issue #37). Handles reach a replica at its node's address, so binding the
server there loses nothing: 127.0.0.1 on a loopback cluster, the node's own IP on a cluster
opened for several machines (``XEMA_RAY_OPEN_PORTS=1``), never the wildcard.

``bind_replica_servers_to_node`` makes the replica module bind there. Every deployment of the
app calls it first thing in its constructor, which Serve runs in the replica's process before
``_on_initialized`` starts the server; the rule is installed explicitly, never at import, and it
is checked: a Ray whose replica module no longer has the function says so in the replica's log
(tests/serving/test_hardening.py then finds the listener on all interfaces).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("xema_ray.serving")

#: the addresses Ray Serve binds replica servers to that mean "every interface"
WILDCARD_HOSTS = ("[::]", "0.0.0.0", "")
_MARK = "_xema_bound_to"


def grpc_host(ip: str) -> str:
    """``ip`` as gRPC's address syntax wants it (IPv6 in brackets).

    Example:
        >>> grpc_host("127.0.0.1"), grpc_host("::1")
        ('127.0.0.1', '[::1]')
    """
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:  # a host name: gRPC resolves it
        return ip


def node_bound(add_port: Callable[[Any, str], int], host: str) -> Callable[[Any, str], int]:
    """``add_port`` with a wildcard host replaced by ``host`` (other addresses pass unchanged).

    Example:
        >>> seen = []
        >>> bound = node_bound(lambda server, address: seen.append(address) or 1, "127.0.0.1")
        >>> bound(None, "[::]:0"), seen
        (1, ['127.0.0.1:0'])
    """

    def add_port_to_grpc_server(server: Any, address: str) -> int:
        where, _, port = address.rpartition(":")
        if where in WILDCARD_HOSTS:
            address = f"{grpc_host(host)}:{port}"
        return add_port(server, address)

    setattr(add_port_to_grpc_server, _MARK, host)
    return add_port_to_grpc_server


def bind_replica_servers_to_node() -> str | None:
    """Make this process's Serve replica bind its inter-deployment gRPC server to the node's
    address (idempotent). Returns that address, or None where Ray's replica module is not the
    one this was written against (logged: the server then listens where Ray puts it)."""
    import ray

    try:
        from ray.serve._private import replica
    except ImportError:  # pragma: no cover - Serve is a dependency
        return None
    current = getattr(replica, "add_port_to_grpc_server", None)
    if current is None:
        logger.warning("ray.serve._private.replica has no add_port_to_grpc_server (Ray %s): the replica's "
                       "gRPC server binds where Ray puts it (docs/serving.md \"Ports\")", ray.__version__)
        return None
    bound_to = getattr(current, _MARK, None)
    if bound_to is not None:
        return str(bound_to)
    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    replica.add_port_to_grpc_server = node_bound(current, host)
    return host
