"""Fake server whose HTTP loop lives while its engine is stuck loading.

Serves GET /health -> 503 "loading" on 127.0.0.1:--port from the first moment and
writes a uvicorn-style access-log line to stderr for every request (so launch's own
health polls keep the log busy), prints two loading lines, then its "engine thread"
blocks forever: the log never shows progress again. `--pidfile F` appends its PID to F.

With --print-log the access log goes out through `print` and the engine thread spins in
Python instead of blocking: under PYTHONUNBUFFERED=1 (which launch sets) print writes the
text and its newline separately, and the spinning engine takes the interpreter between the
two, so the supervisor sees each access-log line unfinished first.
"""

import argparse
import http.server
import os
import sys
import threading

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--pidfile")
p.add_argument("--print-log", action="store_true")
args = p.parse_args()

if args.pidfile:
    with open(args.pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b'{"status":"loading"}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code="-", size="-"):
        host, port = self.client_address[:2]
        line = f'INFO:     {host}:{port} - "{self.requestline}" {code} Service Unavailable'
        if args.print_log:
            print(line)
            return
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
server.daemon_threads = True
threading.Thread(target=server.serve_forever, daemon=True).start()
print(f"listening on http://127.0.0.1:{args.port} (health: 503 until ready)", flush=True)
print("loading weights: file 1/2", flush=True)


def engine() -> None:
    if args.print_log:
        while True:  # stuck in a Python loop
            pass
    threading.Event().wait()  # stuck, like a load blocked in a driver call


t = threading.Thread(target=engine, name="engine")
t.start()
t.join()
