"""A checkpoint store on a host of its own, as a shared filesystem would be: files under DIR served
over HTTP, PUT writes one (to a temporary name, then a rename: a writer killed mid-upload leaves the
previous checkpoint), GET reads it, 404 if there is none. The fleet goodput bench runs it on a
store host, so DDP + checkpoint-restart's saves and loads cross a shaped link.

    python -m bench.checkpoint_server DIR HOST PORT
"""
from __future__ import annotations

import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(root: str, host: str, port: int) -> None:
    os.makedirs(root, exist_ok=True)

    class Handler(BaseHTTPRequestHandler):
        def _path(self) -> str | None:
            name = self.path.strip("/")
            return os.path.join(root, name) if name and "/" not in name and not name.startswith(".") else None

        def do_PUT(self) -> None:                      # noqa: N802 - http.server's name
            path, length = self._path(), int(self.headers.get("Content-Length", "-1"))
            if path is None or length < 0:
                self.send_error(400, "PUT /NAME with a Content-Length")
                return
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                left = length
                while left:
                    chunk = self.rfile.read(min(left, 1 << 20))
                    if not chunk:
                        self.send_error(400, "the body ended early")
                        return
                    f.write(chunk)
                    left -= len(chunk)
            os.replace(tmp, path)
            self.send_response(204)
            self.end_headers()

        def do_GET(self) -> None:                      # noqa: N802
            path = self._path()
            if path is None or not os.path.exists(path):
                self.send_error(404, "no such checkpoint")
                return
            with open(path, "rb") as f:
                data = f.read()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
