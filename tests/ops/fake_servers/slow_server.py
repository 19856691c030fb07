"""Fake server that takes a long time to start but logs progress all the while.

Logs a progress line every --line-every seconds for --load-seconds (with --cr, as
\\r-terminated progress-bar updates, like tqdm in a pipe), then serves GET /health -> 200
on 127.0.0.1:--port and stays silent. After --serve-seconds it exits 0; with
--freeze-after S, /health stops answering after S seconds of serving (a server wedged
after becoming ready).
"""

import argparse
import http.server
import os
import sys
import threading
import time

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--load-seconds", type=float, default=6.0)
p.add_argument("--line-every", type=float, default=0.3)
p.add_argument("--serve-seconds", type=float, default=3600.0)
p.add_argument("--freeze-after", type=float)
p.add_argument("--cr", action="store_true")
p.add_argument("--pidfile")
args = p.parse_args()

if args.pidfile:
    with open(args.pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")

frozen = threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if frozen.is_set():
            time.sleep(3600)
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):  # silent, like a real server's access log being off
        pass


t0 = time.time()
i = 0
while time.time() - t0 < args.load_seconds:
    i += 1
    end = "\r" if args.cr and i % 2 else "\n"
    sys.stdout.write(f"loading weights: shard {i} ({time.time() - t0:.1f} s){end}")
    sys.stdout.flush()
    time.sleep(args.line_every)
server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
server.daemon_threads = True
threading.Thread(target=server.serve_forever, daemon=True).start()
print(f"\nserving on 127.0.0.1:{args.port}", flush=True)
t1 = time.time()
while time.time() - t1 < args.serve_seconds:
    if args.freeze_after is not None and time.time() - t1 >= args.freeze_after and not frozen.is_set():
        frozen.set()
    time.sleep(0.1)
print("shutting down cleanly", flush=True)
sys.exit(0)
