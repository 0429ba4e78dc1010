"""Untrusted neighbours and untrusted reward code (issue 36, problems 2 and 6).

The rendezvous store: a local process that does not hold the run's token reads and writes no key
through any port the run's processes listen on (the store's own port, the gate, each worker's
tunnel, gloo's), and the group goes on. Reward workers: see the tests further down."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from relayrl.parallel.rendezvous import join_store, serve_store
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup

pytestmark = pytest.mark.faults

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net and socket filters: Linux")


class Adder(Worker):
    def __init__(self):
        self.init_distributed()

    @dispatch(Dispatch.RANK_ZERO)
    def world_sum(self) -> int:
        import torch

        t = torch.tensor([self.rank + 1])
        dist.all_reduce(t)
        return int(t)


def _hex_ip(hexed: str) -> str:
    raw = bytes.fromhex(hexed)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = b"".join(raw[k:k + 4][::-1] for k in range(0, 16, 4))
    import ipaddress

    ip = ipaddress.IPv6Address(words)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)


def listening_ports(pids: list[int]) -> list[tuple[str, int]]:
    """Every TCP (ip, port) that one of `pids` listens on: its sockets' inodes (/proc/PID/fd) matched
    against the LISTEN rows of /proc/net/tcp and tcp6. A wildcard address is reached at 127.0.0.1."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and int(cols[9]) in inodes:
                addr, port = cols[1].rsplit(":", 1)
                ip = _hex_ip(addr)
                out.add(("127.0.0.1" if ip in ("0.0.0.0", "::") else ("::1" if ip == "::1" else ip), int(port, 16)))
    return sorted(out)


# One thread per port: a TCPStore client without the token tries to read the heartbeat key, to write it,
# and to count the keys, printing each thing it managed at once. A client that reached a port which is
# no store at all (gloo's) may wait there forever: the test stops the attacker after ATTACK_S.
ATTACK = r"""
import datetime, json, sys, threading
import torch.distributed as dist
def attack(host, port):
    try:
        s = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=3))
    except Exception:
        return
    for what, op in (("get", lambda: s.get("relayrl/heartbeat/0")), ("set", lambda: s.set("relayrl/heartbeat/0", b"x")),
                     ("keys", lambda: s.num_keys())):
        try:
            op()
            print(json.dumps([port, what]), flush=True)
        except Exception:
            pass
threads = [threading.Thread(target=attack, args=(h, p), daemon=True) for h, p in json.loads(sys.argv[1])]
[t.start() for t in threads]
print("started", flush=True)
[t.join() for t in threads]
"""
ATTACK_S = 20


def _attack(ports: list[tuple[str, int]]) -> list:
    """What a process without the token managed through `ports` ([port, "get" | "set" | "keys"], ...)."""
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "FATAL", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", ATTACK, json.dumps(ports)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=ATTACK_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = out.strip().splitlines()
    assert lines and lines[0] == "started", err[-2000:]
    return [json.loads(line) for line in lines[1:]]


@linux_only
def test_no_port_of_a_worker_group_serves_the_store_without_the_token():
    with WorkerGroup(ResourcePool([2], name="adder"), Adder) as group:
        assert group.call(Adder.world_sum) == 1 + 2
        hosted = group._hosted
        pids = [os.getpid(), *group._pids.values()]
        assert len(pids) == 3 and None not in pids
        ports = listening_ports(pids)
        # the run's own ports are all there: the gate, the store behind it, and a tunnel in each worker
        assert ("127.0.0.1", hosted.port) in ports and ("127.0.0.1", hosted.store.port) in ports
        assert len([p for p in ports if p[0] == "127.0.0.1"]) >= 4, ports
        assert _attack(ports) == []  # before: the store's own port and every tunnel answered all three
        assert group.call(Adder.world_sum) == 1 + 2  # the group never noticed
        # the token holders' view of the store is intact: the heartbeat is still a counter
        assert int(join_store(hosted.address, 10).add("relayrl/heartbeat/0", 0)) > 0


@linux_only
def test_a_hosted_store_is_closed_to_local_strangers_and_open_to_its_joiners():
    hosted = serve_store("127.0.0.1")
    try:
        client = join_store(hosted.address, 10)  # this process holds the token: its tunnel admits it
        client.set("k", b"v")
        hosted.store.set("owner", b"host")
        ports = listening_ports([os.getpid()])
        assert ("127.0.0.1", hosted.store.port) in ports and ("127.0.0.1", hosted.port) in ports
        assert _attack(ports) == []  # no port of this process serves a stranger
        assert client.get("owner") == b"host" and hosted.store.get("k") == b"v"
        assert hosted.gate.refused >= 1  # the stranger reached the gate and was refused there
        assert hosted.store.num_keys() >= 2
    finally:
        hosted.close()
