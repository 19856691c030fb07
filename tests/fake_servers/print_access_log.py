"""Fake server whose engine never becomes ready while its HTTP loop answers /health with 503,
logging every request with `print`. Under PYTHONUNBUFFERED=1 (which launch sets) print writes
the text and its newline separately, and the stuck engine thread, spinning in Python, takes
the interpreter between the two: the supervisor sees each access-log line unfinished first.
Prints one loading line, then nothing but access-log lines. `--pidfile F` appends its PID to F."""

import argparse
import http.server
import os
import threading

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--pidfile")
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
        print(f'INFO:     {host}:{port} - "{self.requestline}" {code} Service Unavailable')


server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
server.daemon_threads = True
print(f"loading weights (health: 503 until ready) on port {args.port}")
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:  # the engine, stuck in a loop
    pass
