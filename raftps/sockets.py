"""Sending large frames on links of any speed: a socket's timeout bounds each ``sendall`` as a
whole, so bytes go in chunks that fit the slowest link, and a send is done when the peer has
acknowledged every byte (the kernel's send queue is empty), not when ``sendall`` returns. Shared by
the client transport (transport.py) and the peers' data plane (dataplane.py)."""
from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
from typing import Callable

# Bytes handed to one sendall: the socket's timeout bounds each sendall as a whole, so a chunk
# must fit the slowest link a client may be on (256 KiB at 5 Mbit/s: 0.4 s) within it.
SEND_CHUNK = 256 << 10

def send_chunked(sock: socket.socket, buffers: list, chunk: int = SEND_CHUNK) -> None:
    """``codec.encode``'s buffers, each sendall at most ``chunk`` bytes (see SEND_CHUNK)."""
    for buf in buffers:
        view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
        for start in range(0, len(view), chunk):
            sock.sendall(view[start:start + chunk])


def unsent(sock: socket.socket) -> int:
    """Bytes this end's kernel still holds for ``sock`` (not yet acknowledged by the peer); 0 where
    the platform cannot tell."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def drain(sock: socket.socket, stall: float, progress: Callable[[int], None] | None = None) -> None:
    """Until the peer has every byte sent on ``sock``: sendall returns once bytes are in the
    kernel's buffer (megabytes, on a slow link tens of seconds of them), so this is when a send
    is done. socket.timeout if none is acknowledged for ``stall`` s; ``progress`` gets each
    decrease."""
    left = unsent(sock)
    last_move = time.monotonic()
    pause = 0.0005
    while left > 0:
        time.sleep(pause)
        pause = min(0.02, pause * 2)
        now_left = unsent(sock)
        if now_left < left:
            if progress is not None:
                progress(left - now_left)
            last_move = time.monotonic()
        elif time.monotonic() - last_move > stall:
            raise socket.timeout(f"no byte acknowledged by the peer in {stall:g} s")
        left = now_left
