"""Who is at the other end of a loopback connection, and a socket filter that lets only chosen local ports
through: what keeps relayrl.parallel.rendezvous's store closed to other local processes (its docstring says how).

Linux only: /proc/net/tcp(6) gives each TCP socket's endpoints and inode, /proc/self/fd this process's sockets;
SO_ATTACH_FILTER takes a classic BPF program. It imports the standard library only.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading

LOCALHOST = "127.0.0.1"
_LINUX = sys.platform.startswith("linux")
_MAX_UPSTREAM = 1000  # connections the gate holds to the store at once (the filter lists their ports)
_CLOSED_STATES = {0x06, 0x07}  # TIME_WAIT, CLOSE in /proc/net/tcp


def sees_sockets() -> bool:
    """Whether this process can tell who owns a loopback connection (Linux, /proc/net/tcp readable)."""
    return _LINUX and os.access("/proc/net/tcp", os.R_OK) and os.access("/proc/self/fd", os.R_OK)


def _tcp_rows() -> list[tuple[tuple[str, int], tuple[str, int], int, int]]:
    """(local (ip, port), remote (ip, port), state, inode) of every TCP socket of this network namespace, IPv4
    and IPv6 (an IPv4-mapped IPv6 address reads as its IPv4 form: torch's clients use such sockets)."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            rows.append((_endpoint(cols[1]), _endpoint(cols[2]), int(cols[3], 16), int(cols[9])))
    return rows


def _endpoint(hexed: str) -> tuple[str, int]:
    addr, port = hexed.rsplit(":", 1)
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])  # the kernel writes one little-endian word
    else:  # four little-endian words
        raw = b"".join(raw[k:k + 4][::-1] for k in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, raw)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[len("::ffff:"):]
    return ip, int(port, 16)


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def peer_is_own(conn: socket.socket) -> bool:
    """Whether the socket at the other end of the loopback connection `conn` belongs to this process."""
    try:
        peer, local = conn.getpeername()[:2], conn.getsockname()[:2]
    except OSError:
        return False
    inodes = {inode for lo, re, _, inode in _tcp_rows() if lo == peer and re == local and inode}
    return bool(inodes) and bool(inodes & _own_socket_inodes())


def foreign_peers(port: int) -> int:
    """How many connections to this process's listener on 127.0.0.1:`port` come from sockets of other
    processes (or are still half open, so that their owner cannot be known). Closed ones (TIME_WAIT and
    after) read nothing more and do not count."""
    rows = _tcp_rows()
    own = _own_socket_inodes()
    foreign = 0
    for lo, re, state, _ in rows:
        if lo == (LOCALHOST, port) and re[1] != 0 and state not in _CLOSED_STATES:
            clients = [inode for lo2, re2, _, inode in rows if lo2 == re and re2 == lo]
            if not any(inode in own for inode in clients):
                foreign += 1
    return foreign


class StoreFilter:
    """A classic BPF socket filter on the store's listening socket: a packet passes only when it comes
    from 127.0.0.1 and from a source port in `ports` (the gate's upstream sockets, bound before they
    connect). Children of the listener keep the filter they were accepted under."""

    SO_ATTACH_FILTER = 26
    SKF_NET_OFF = -0x100000

    def __init__(self, listener: socket.socket):
        self._sock = listener  # a duplicate of the store's listening socket: setsockopt reaches the same socket
        self._ports: list[int] = []
        self._lock = threading.Lock()
        self._apply()

    def _apply(self) -> None:
        n = len(self._ports)
        ins = [(0x20, 0, 0, self.SKF_NET_OFF + 12),  # ld  [ip source address]
               (0x15, 0, n + 1, 0x7F000001),          # jeq 127.0.0.1, else drop (jumps count from the next)
               (0x28, 0, 0, 0)]                       # ldh [tcp source port]
        ins += [(0x15, n - k, 0, port) for k, port in enumerate(self._ports)]  # jeq port -> accept
        ins += [(0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF)]  # drop, accept
        code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", c, jt, jf, k & 0xFFFFFFFF)
                                                    for c, jt, jf, k in ins))
        prog = struct.pack("HL", len(ins), ctypes.addressof(code))
        self._sock.setsockopt(socket.SOL_SOCKET, self.SO_ATTACH_FILTER, prog)  # the kernel copies the program

    def connect(self, port: int) -> socket.socket:
        """A connection to the store at 127.0.0.1:`port` from a source port the filter admits."""
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            up.bind((LOCALHOST, 0))  # no SO_REUSEADDR: no other socket may take this port while we hold it
            src = up.getsockname()[1]
            with self._lock:
                if len(self._ports) >= _MAX_UPSTREAM:
                    raise OSError(f"more than {_MAX_UPSTREAM} connections to one rendezvous store")
                self._ports.append(src)
                self._apply()
        except BaseException:
            up.close()
            raise
        try:
            up.connect((LOCALHOST, port))
        except BaseException:
            self.release(up, src)
            raise
        return up

    def release(self, up: socket.socket, src: int) -> None:
        """Take `src` off the list, then close the socket that held it."""
        with self._lock:
            if src in self._ports:
                self._ports.remove(src)
                try:
                    self._apply()
                except OSError:
                    pass
        up.close()

    def close(self) -> None:
        self._sock.close()
