"""Rendezvous stores from the network's side: a local worker group's store listens on 127.0.0.1 only
(never all interfaces), and a peer without the run's token is refused at the gate — it reads no key
and joins nothing — while the group goes on working."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from relayrl.parallel.rendezvous import HANDSHAKE_S, StoreAddress, join_store, serve_store
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup

pytestmark = pytest.mark.faults


class Adder(Worker):
    def __init__(self):
        self.init_distributed()

    @dispatch(Dispatch.RANK_ZERO)
    def world_sum(self) -> int:
        import torch

        t = torch.tensor([self.rank + 1])
        dist.all_reduce(t)
        return int(t)


def listening(port: int) -> list[str]:
    """The local addresses a TCP port listens on, from /proc/net/tcp and tcp6 (hex, as the kernel writes)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                out.append(addr)
    return out


LOOPBACK = "0100007F"  # 127.0.0.1 in /proc/net/tcp's little-endian hex


def test_local_stores_listen_on_loopback_only():
    hosted = serve_store("127.0.0.1")
    try:
        assert listening(hosted.port) == [LOOPBACK]  # the gate
        assert listening(hosted.store.port) == [LOOPBACK]  # the store behind it
    finally:
        hosted.close()


def test_a_peer_without_the_token_is_refused_and_the_group_goes_on():
    with WorkerGroup(ResourcePool([2], name="adder"), Adder) as group:
        address = group._hosted.address
        assert address.host == "127.0.0.1" and listening(address.port) == [LOOPBACK]
        refused = group._hosted.gate.refused
        # a raw connection that sends a wrong token is closed without an answer
        with socket.create_connection((address.host, address.port)) as s:
            s.sendall(b"0" * len(address.token))
            s.settimeout(HANDSHAKE_S + 5)
            assert s.recv(16) == b""
        # a TCPStore client that does not know the token cannot read the group's keys (in a process of
        # its own: torch's client retries and logs until its timeout)
        code = ("import sys, datetime, torch.distributed as dist\n"
                f"try:\n    dist.TCPStore('127.0.0.1', {address.port}, is_master=False, "
                "timeout=datetime.timedelta(seconds=3)).get('relayrl/heartbeat/0')\n"
                "except Exception:\n    sys.exit(7)\nsys.exit(0)\n")
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "FATAL"}
        assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 7
        # a joiner with a forged token fares the same
        forged = StoreAddress(address.host, address.port, "f" * len(address.token))
        t0 = time.monotonic()
        code = ("import sys\nfrom relayrl.parallel.rendezvous import StoreAddress, join_store\n"
                f"try:\n    join_store(StoreAddress('127.0.0.1', {address.port}, '{forged.token}'), 3).get('x')\n"
                "except Exception:\n    sys.exit(7)\nsys.exit(0)\n")
        assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 7
        assert time.monotonic() - t0 < 60
        assert group._hosted.gate.refused > refused + 1
        assert group.call(Adder.world_sum) == 1 + 2  # the group never noticed
        # the token holders' own view of the store is intact
        assert int(join_store(address, 10).add("relayrl/heartbeat/0", 0)) > 0
