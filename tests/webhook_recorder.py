"""A loopback HTTP server that records the JSON bodies POSTed to it (a webhook's receiver).
`fail_first`: that many of the first POSTs are answered 503 (recorded as refused), so a
sender's retries show. `port`: the port to listen on (0: a free one; a server's allowed webhook
prefix names the port exactly). Tests import it as `from webhook_recorder import Recorder`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Recorder:
    def __init__(self, fail_first: int = 0, port: int = 0):
        self.accepted: list[dict] = []         # bodies answered 200, in arrival order
        self.refused: list[dict] = []          # bodies answered 503
        self.keys: list[str] = []              # Idempotency-Key of every accepted body
        self._fail = fail_first
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):                 # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with recorder._lock:
                    refuse = recorder._fail > 0
                    recorder._fail -= refuse
                    (recorder.refused if refuse else recorder.accepted).append(body)
                    if not refuse:
                        recorder.keys.append(self.headers["Idempotency-Key"])
                self.send_response(503 if refuse else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):      # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Recorder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
