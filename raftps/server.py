"""The client port of a node: length-prefixed codec frames, one request and one reply at a time
per connection, a thread per connection (bounded). Writes and linearizable reads are served by
the leader; a follower answers them with the leader's address. Bad bytes close the connection
with an error frame and touch nothing else.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
from typing import Any, Callable


from . import codec
from .errors import InvalidRequest, ProtocolError, RaftpsError, error_result
from .machine import check_finite, check_tensors
from .node import Outcome, RaftNode

log = logging.getLogger("raftps.server")
CLIENT_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")
WRITES = ("create", "push", "assign", "delete", "push_sync", "close_step", "ssp_join", "ssp_leave", "ssp_drop")


def _retry(message: str, **extra: Any) -> dict:
    return {"error": "Retry", "retry": True, "message": message, **extra}


class ClientServer:
    def __init__(self, node: RaftNode, host: str, port: int, max_connections: int = 256,
                 frame_timeout: float = 30.0, idle_timeout: float = 600.0):
        self.node = node
        self.limits = node.config.limits
        self.frame_timeout = frame_timeout
        self.idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self.sock = socket.create_server((host, port), backlog=128)
        self._handlers: dict[str, Callable[[dict], dict]] = {
            "status": lambda req: self.node.status(),
            "stats": self._stats,
            "pull": self._pull,
            "wait_step": self._wait_step,
            "ssp_wait": self._ssp_wait,
            "tensors": self._tensors,
            **{op: self._write for op in WRITES},
        }
        threading.Thread(target=self._accept, name="client-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                try:
                    codec.send_frame(conn, _retry("node is at max_connections; try another node"))
                finally:
                    conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="client-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.frame_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    request = codec.recv_frame(conn, self.limits, first_byte_timeout=self.idle_timeout)
                except ProtocolError as exc:
                    codec.send_frame(conn, error_result(ProtocolError, str(exc)))
                    return                        # the stream cannot be resynchronised
                except ConnectionError as exc:
                    if "mid-frame" in str(exc):   # a sender that half-closed may still read
                        codec.send_frame(conn, error_result(ProtocolError, f"truncated frame: {exc}"))
                    return
                codec.send_frame(conn, self.handle(request))
        except (ConnectionError, OSError) as exc:
            log.debug("client connection closed: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    def handle(self, request: Any) -> dict:
        try:
            if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                raise InvalidRequest("a request is a map with an 'op' string")
            handler = self._handlers.get(request["op"])
            if handler is None:
                raise InvalidRequest(f"unknown op {request['op']!r} (known: {sorted(self._handlers)})")
            return handler(request)
        except RaftpsError as exc:
            return error_result(type(exc), str(exc))
        except Exception as exc:     # a bug must cost one request, not the node
            log.exception("request failed")
            return {"error": "Internal", "message": f"internal error: {exc!r}"}

    def _not_leader(self) -> dict | None:
        if self.node.is_leader():
            return None
        leader = self.node.leader_client_address()
        return _retry(f"not the leader; leader is {leader or 'unknown'}", not_leader=True, leader=leader)

    def _write(self, req: dict) -> dict:
        redirect = self._not_leader()
        if redirect:
            return redirect
        client, seq, ack = req.get("client"), req.get("seq"), req.get("ack", req.get("seq"))
        if not isinstance(client, str) or not CLIENT_ID.fullmatch(client):
            raise InvalidRequest("client id must be 1-64 characters from [A-Za-z0-9_-]")
        if type(seq) is not int or type(ack) is not int or not 1 <= ack <= seq:
            raise InvalidRequest("seq and ack must be ints with 1 <= ack <= seq")
        command = {k: v for k, v in req.items() if k not in ("tensors", "id")}
        tensors = req.get("tensors")
        if tensors is not None:
            for name, arr in check_tensors(tensors).items():
                # Refused here so a NaN gradient costs no replication; the state machine checks again.
                check_finite(name, arr, "initial value" if req["op"] == "create" else
                             "value" if req["op"] == "assign" else "gradient")
        try:
            return self.node.submit(command, tensors)
        except Outcome as outcome:
            return _retry(str(outcome), unknown=outcome.applied is None)

    def _pull(self, req: dict) -> dict:
        names = req.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise InvalidRequest("'names' must be a list of tensor names or null")
        if req.get("linearizable", True):
            read = self._leader_read(names)
            if isinstance(read, dict):
                return read
            tensors, version = read
        else:
            min_version = req.get("min_version") or 0
            if type(min_version) is not int:
                raise InvalidRequest("min_version must be an int")
            if not self.node.wait_version(min_version, timeout=min(float(req.get("wait", 2.0)), 10.0)):
                return _retry(f"this node has applied only up to {self.node.machine.version} < {min_version}",
                              behind=True)
            tensors, version = self.node.read(names)
        return {"version": version,
                "tensors": {name: t.data for name, t in tensors.items()},
                "tensor_versions": {name: t.version for name, t in tensors.items()}}

    def _leader_read(self, names: list[str] | None) -> tuple[dict, int] | dict:
        """(tensors, version) read through the leader's log, or the reply that sends the client on."""
        redirect = self._not_leader()
        if redirect:
            return redirect
        try:
            return self.node.linearizable_read(names)
        except Outcome as outcome:
            return _retry(str(outcome))

    def _tensors(self, req: dict) -> dict:
        read = self._leader_read(None)
        if isinstance(read, dict):
            return read
        tensors, version = read
        return {"version": version, "tensors": [
            {"name": n, "dtype": str(t.data.dtype), "shape": list(t.data.shape), "version": t.version,
             "optimizer": t.optimizer} for n, t in tensors.items()]}

    def _stats(self, req: dict) -> dict:
        return self._not_leader() or self.node.stats()

    def _wait_step(self, req: dict) -> dict:
        redirect = self._not_leader()
        if redirect:
            return redirect
        step, timeout = req.get("step"), req.get("timeout", 10.0)
        if type(step) is not int or not isinstance(timeout, (int, float)):
            raise InvalidRequest("wait_step needs step (int) and timeout (seconds)")
        return {"version": self.node.wait_step(step, min(float(timeout), 300.0))}

    def _ssp_wait(self, req: dict) -> dict:
        redirect = self._not_leader()
        if redirect:
            return redirect
        group, worker, timeout = req.get("group"), req.get("worker"), req.get("timeout", 10.0)
        if not isinstance(group, str) or not isinstance(worker, str) or isinstance(timeout, bool) \
                or not isinstance(timeout, (int, float)):
            raise InvalidRequest("ssp_wait needs group (str), worker (str) and timeout (seconds)")
        return self.node.wait_ssp(group, worker, min(max(float(timeout), 0.0), 300.0))

    def close(self) -> None:
        self.sock.close()
