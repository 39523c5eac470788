"""Raw data plane: raftps's design with nothing else (no validation, sessions, HMAC or persistence).

Node ``python -m bench.raw_dataplane NODE BASE`` (NODE 0..2): pysyncobj on BASE+NODE (the same
settings raftps uses, no password, no journal), payloads on BASE+10+NODE, clients on BASE+20+NODE.
The leader takes a push (u32 length, float32 bytes), streams it to both followers over plain
sockets at once, proposes a small entry (payload number, lr) once one follower acknowledged (a
majority with itself), and every node applies it as numpy SGD (``p = p - lr * g``).
"""
from __future__ import annotations

import itertools
import socket
import struct
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np
from pysyncobj import SyncObj, SyncObjConf, replicated

from raftps.codec import recv_exactly

LEN, PUT, VER = struct.Struct("!I"), struct.Struct("!QI"), struct.Struct("!q")


def recv(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exactly(sock, memoryview(buf))
    return buf


class RawNode(SyncObj):
    def __init__(self, node: int, base: int):
        conf = SyncObjConf(appendEntriesUseBatch=False, appendEntriesBatchSizeBytes=4 << 20, appendEntriesPeriod=0.1,
                           raftMinTimeout=0.75, raftMaxTimeout=1.5, sendBufferSize=1 << 20, recvBufferSize=1 << 20)
        super().__init__(f"127.0.0.1:{base + node}", [f"127.0.0.1:{base + i}" for i in range(3) if i != node], conf)
        self.node, self.base, self.ids = node, base, itertools.count(node << 48)
        self.payloads: dict[int, bytearray] = {}
        self.cond = threading.Condition()
        self.params: dict[int, np.ndarray] = {}
        self.version = 0
        for port, handler in ((base + 10 + node, self.serve_peer), (base + 20 + node, self.serve_client)):
            srv = socket.create_server(("127.0.0.1", port), backlog=64)
            threading.Thread(target=self.accept, args=(srv, handler), daemon=True).start()

    def accept(self, srv: socket.socket, handler) -> None:
        while True:
            conn, _ = srv.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    @replicated
    def apply(self, pid: int, lr: float) -> int:
        with self.cond:               # a follower may still be receiving it: wait (prototype)
            self.cond.wait_for(lambda: pid in self.payloads, timeout=5.0)
            blob = self.payloads.pop(pid, None)
        if blob is not None:
            g = np.frombuffer(blob, np.float32)
            p = self.params.get(g.size)
            self.params[g.size] = (np.zeros(g.size, np.float32) if p is None else p) - np.float32(lr) * g
        self.version += 1
        return self.version

    def serve_peer(self, conn: socket.socket) -> None:
        while True:
            pid, n = PUT.unpack(recv(conn, PUT.size))
            blob = recv(conn, n)
            with self.cond:
                self.payloads[pid] = blob
                self.cond.notify_all()
            conn.sendall(b"k")

    def send(self, link: socket.socket, pid: int, blob: bytearray) -> None:
        link.sendall(PUT.pack(pid, len(blob)))
        link.sendall(blob)
        recv(link, 1)

    def serve_client(self, conn: socket.socket) -> None:
        links: list[tuple[socket.socket, ThreadPoolExecutor]] = []   # a sender thread per link: in order
        while True:
            (n,) = LEN.unpack(recv(conn, LEN.size))
            if n == 0:                # status: am I the leader?
                conn.sendall(VER.pack(int(self._isLeader())))
                continue
            if not links:             # one connection to each follower per client connection
                for i in (i for i in range(3) if i != self.node):
                    links.append((socket.create_connection(("127.0.0.1", self.base + 10 + i)), ThreadPoolExecutor(1)))
                    links[-1][0].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            blob, pid = recv(conn, n), next(self.ids)
            sends = [sender.submit(self.send, link, pid, blob) for link, sender in links]
            with self.cond:
                self.payloads[pid] = blob
            wait(sends, return_when=FIRST_COMPLETED)
            conn.sendall(VER.pack(self.apply(pid, 0.01, sync=True, timeout=30.0)))


class RawClient:
    def __init__(self, address: str, timeout: float = 30.0):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def push(self, grad: np.ndarray) -> int:
        self.sock.sendall(LEN.pack(grad.nbytes))
        self.sock.sendall(memoryview(grad).cast("B"))
        return VER.unpack(recv(self.sock, VER.size))[0]

    def is_leader(self) -> bool:
        self.sock.sendall(LEN.pack(0))
        return VER.unpack(recv(self.sock, VER.size))[0] == 1


if __name__ == "__main__":
    RawNode(int(sys.argv[1]), int(sys.argv[2]))
    threading.Event().wait()
