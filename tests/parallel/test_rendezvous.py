"""The worker set's rendezvous store listens where its init method says (127.0.0.1 for a one-node
set), not on every interface as torch's own ``tcp://`` rendezvous does; the set still forms and
its collectives work."""

from __future__ import annotations

import os
import socket
import urllib.parse

from sp_harness import run_worker_set


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket in LISTEN on ``port`` (IPv4 and IPv6, from /proc/net)."""
    found: set[str] = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr_hex, port_hex = local.split(":")
                if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(addr_hex)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, raw))
    return found


def rendezvous_scenario(rank: int, world: int, url: str) -> tuple[set[str], float]:
    import torch
    import torch.distributed as dist

    from xema_ray.parallel.groups import ParallelConfig, SPLayout, init_process_groups

    groups = init_process_groups(ParallelConfig(rank=rank, world_size=world, init_method=url, backend="gloo",
                                                layouts=(SPLayout(ulysses=world),)))
    port = urllib.parse.urlparse(url).port
    assert port is not None
    seen = _listening_addresses(port) if rank == 0 else set()
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t, group=groups.select(world, 1).group)  # type: ignore[union-attr]
    dist.barrier()
    groups.shutdown()
    return seen, float(t.item())


def test_rank_zero_store_listens_on_loopback_only() -> None:
    (seen, total), (_, other) = run_worker_set(rendezvous_scenario, 2)
    assert seen == {"127.0.0.1"}, seen  # torch's tcp:// rendezvous listened on '::' (every interface)
    assert total == other == 3.0
