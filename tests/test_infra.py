"""The test harness's own port choice (tests/infra.py): a flake of the suite came from it."""

from __future__ import annotations

import socket
from pathlib import Path

from infra import free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_and_nodeport_ranges() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert max(ports) < min(ephemeral_low, 30_000), sorted(ports)[-5:]
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
