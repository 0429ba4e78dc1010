"""Rendezvous stores that only the run's own processes can join.

Every process group relayrl makes (a worker group's, the weight sync's, the test harness's) meets
at a torch TCPStore hosted by the process that starts the others. A plain TCPStore listens on every
interface and lets anyone who connects read and write its keys (`list_keys` included), so a stray
or hostile peer — on the network or on this machine — could join or disturb a run. Here every
connection to the store passes a check, local ones included:

    host process                                              joining process
    TCPStore on 127.0.0.1:<private>  <── gate on  <── tunnel on 127.0.0.1:<ephemeral>  <── TCPStore client
    admits only sockets the gate        <addr>:<port>   admits only this process's own     (same process)
    opened (a socket filter)            checks the      sockets, sends the run's token
                                        token first     first

`serve_store(host)` binds the gate to `host` alone: 127.0.0.1 for processes on this machine (the
local backend, tests), the node's own address for multi-node runs (Ray), never all interfaces.
The token is a fresh random 128-bit value per store; it travels to the joiners with their start
arguments (a pipe, or Ray's task arguments), never over the gate itself. A connection that does not
present it within `HANDSHAKE_S` seconds is closed: it never reaches the store (`Gate.refused` counts
such peers). `join_store(address)` returns an ordinary TCPStore client, so torch code above it
(init_process_group, ProcessGroupGloo) is unchanged.

No port serves the store without the gate (Linux):
- the store's own loopback port carries a classic BPF socket filter that drops every packet except
  those from 127.0.0.1 and a source port the gate holds right now (`StoreFilter`): the gate binds
  its upstream socket first, adds the port, connects, and removes the port before it closes the
  socket — while it is bound no other socket can take that port, so no other process gets through.
  The host's own client (the store object itself) connects while the store is made, before the
  filter; then the store checks that every connection it has came from this process, and a store
  that a stranger reached in that instant is thrown away and made again (`foreign_peers`).
- a joiner's tunnel listens on loopback, and a connection is forwarded (with the token) only when the
  socket at its other end is one of this process's own (/proc/net/tcp gives the peer socket's inode,
  /proc/self/fd the process's sockets): another local process reaches nothing through it
  (`Tunnel.refused` counts them).
A process that can read the run's memory (ptrace: the same user where the kernel's Yama scope
allows it, or root) can read the token too: that is the boundary. Elsewhere than Linux, or where
/proc/net/tcp cannot be read or socket filters are refused, the store port and tunnels are open to
local processes, as before (the gate still guards the network).
Gloo's own data connections are set up through the store (peers learn each other's addresses from
it) and bind the address the host name resolves to; they carry tensors, never the store's keys.

It imports torch and the standard library only; it must never import another relayrl layer (models,
single_controller, the trainer, the engine, ...): they import it.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from relayrl.parallel.loopback import LOCALHOST, StoreFilter, foreign_peers, peer_is_own, sees_sockets

HANDSHAKE_S = 5.0  # how long a new connection has to present the token
_CHUNK = 1 << 16
_STORE_TRIES = 3


@dataclass(frozen=True)
class StoreAddress:
    """What a joining process needs: where the gate listens and the run's token."""

    host: str
    port: int
    token: str

    def __repr__(self) -> str:  # the token stays out of logs and error messages
        return f"StoreAddress({self.host}:{self.port})"


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy bytes src → dst until either side closes; then close both directions."""
    try:
        while True:
            data = src.recv(_CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _splice(a: socket.socket, b: socket.socket, done=None) -> None:
    """Pipe a <-> b in two daemon threads; each closes its sockets when the other side ends. `done()`
    runs once both directions have ended."""
    left = [2]
    lock = threading.Lock()

    def run(src: socket.socket, dst: socket.socket) -> None:
        _pipe(src, dst)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and done is not None:
            done()

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=run, args=(src, dst), daemon=True).start()


class _Listener:
    """A listening socket served by a daemon thread that hands each connection to `handle`."""

    def __init__(self, host: str, handle):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(128)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._handle = handle
        self._closed = False
        threading.Thread(target=self._serve, daemon=True, name=f"relayrl-listener-{self.port}").start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class Gate(_Listener):
    """Accepts a connection, reads the token, and pipes it to the store only when it matches (through
    `upstream()`: a connection the store's filter admits)."""

    def __init__(self, host: str, store_port: int, token: str, upstream=None):
        self.token, self.store_port = token.encode(), store_port
        self.refused = 0
        self._lock = threading.Lock()
        self._upstream = upstream
        super().__init__(host, self._admit)

    def _admit(self, conn: socket.socket) -> None:
        conn.settimeout(HANDSHAKE_S)
        got = b""
        try:
            while len(got) < len(self.token):
                part = conn.recv(len(self.token) - len(got))
                if not part:
                    break
                got += part
        except OSError:
            pass
        if not hmac.compare_digest(got, self.token):
            with self._lock:
                self.refused += 1
            conn.close()
            return
        conn.settimeout(None)
        try:
            if self._upstream is None:
                upstream, done = socket.create_connection((LOCALHOST, self.store_port)), None
            else:
                upstream, done = self._upstream()
        except OSError:
            conn.close()
            return
        _splice(conn, upstream, done)


class Tunnel(_Listener):
    """The joiner's side: a loopback listener whose connections go to the gate, token first — only those
    that come from this process's own sockets (on Linux); any other is closed unanswered."""

    def __init__(self, address: StoreAddress):
        self.address = address
        self.refused = 0
        super().__init__(LOCALHOST, self._forward)

    def _forward(self, conn: socket.socket) -> None:
        if sees_sockets() and not peer_is_own(conn):
            self.refused += 1
            conn.close()
            return
        try:
            upstream = socket.create_connection((self.address.host, self.address.port))
            upstream.sendall(self.address.token.encode())
        except OSError:
            conn.close()
            return
        _splice(conn, upstream)


class HostedStore:
    """The store a starting process hosts, behind its gate. Keep it alive while peers use it."""

    def __init__(self, host: str = LOCALHOST, world_size: int | None = None, timeout_s: float = 300.0):
        for _ in range(_STORE_TRIES):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOCALHOST, 0))  # the store itself: loopback only, never the network
            sock.listen(128)
            port = sock.getsockname()[1]
            mine = sock.dup() if sees_sockets() else None  # for the filter: the same listening socket
            # the store takes the socket over and closes it when it goes: Python must forget it (closing
            # it here too would close whatever file later reuses the descriptor number)
            store = dist.TCPStore(LOCALHOST, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                                  wait_for_workers=False, master_listen_fd=sock.detach())
            if mine is None:
                self.store, self._filter = store, None
                break
            try:
                self._filter = StoreFilter(mine)  # from here on only the gate's sockets get through
            except OSError:  # a kernel (or a sandbox) without socket filters: open to local processes, as before
                mine.close()
                self.store, self._filter = store, None
                break
            if foreign_peers(port) == 0:  # and before it, only the store's own client came
                self.store = store
                break
            self._filter.close()
            del store  # a stranger connected in the instant before the filter: never use this store
        else:
            raise RuntimeError(f"could not make a rendezvous store that only this run reaches in {_STORE_TRIES} "
                               "tries: another local process keeps connecting to new loopback ports")
        self.gate = Gate(host, self.store.port, secrets.token_hex(16), upstream=self._upstream)
        self.address = StoreAddress(host, self.gate.port, self.gate.token.decode())

    def _upstream(self):
        if self._filter is None:
            return socket.create_connection((LOCALHOST, self.store.port)), None
        up = self._filter.connect(self.store.port)
        src = up.getsockname()[1]
        return up, lambda: self._filter.release(up, src)

    @property
    def port(self) -> int:
        """The gate's port (what joiners connect to)."""
        return self.address.port

    def close(self) -> None:
        self.gate.close()
        if self._filter is not None:
            self._filter.close()
        self.store = None  # the store closes its socket


def serve_store(host: str = LOCALHOST, world_size: int | None = None, timeout_s: float = 300.0) -> HostedStore:
    """Host a store reachable at `host` (one interface, never all) by holders of its token."""
    return HostedStore(host, world_size, timeout_s)


_tunnels: dict[StoreAddress, Tunnel] = {}
_tunnels_lock = threading.Lock()


def join_store(address: StoreAddress, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore client of the store at `address`, through a tunnel that presents the token.
    One tunnel per address and process serves every client connection to that store."""
    with _tunnels_lock:
        tunnel = _tunnels.get(address)
        if tunnel is None:
            tunnel = _tunnels[address] = Tunnel(address)
    return dist.TCPStore(LOCALHOST, tunnel.port, is_master=False, timeout=timedelta(seconds=timeout_s))
