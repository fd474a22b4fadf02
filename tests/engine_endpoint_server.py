"""A real HTTP server process on 127.0.0.1 that answers GET requests the way a foreign engine's server does, from a
JSON file of `{path: body}` it re-reads on every request (the test rewrites it between cases): /health 200, each
listed path 200 with its body, anything else 404. The bodies are recorded from the engines' own source (see
tests/data/engine_endpoints/); this stands in for the foreign server's response format, not for harness code.

    python tests/engine_endpoint_server.py PORT ANSWERS.json"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def serve(port: int, answers: Path) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            bodies = json.loads(answers.read_text())
            if self.path == "/health":
                code, out = 200, b""
            elif self.path in bodies:
                code, out = 200, json.dumps(bodies[self.path]).encode()
            else:
                code, out = 404, b'{"detail":"Not Found"}'
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))
