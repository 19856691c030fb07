"""Fake server whose whole tree ignores SIGTERM and SIGINT.

main -> 2 children -> 1 grandchild each, plus a "daemonizer" child that forks, calls
setsid(), forks again and exits, and whose grandchild re-executes itself without the
supervisor's environment marker (so only subreaper/continuous tracking can find it).
Every process appends its PID to --pidfile. When all are up, main prints
"tree up" and then either hangs silently or, with --exit-code K, exits with status K
leaving its descendants running.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

EXPECTED = 1 + 2 + 2 + 1  # main, children, grandchildren, daemon


def ignore_signals():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def record(pidfile):
    fd = os.open(pidfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)


def spawn(role, pidfile):
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--pidfile", pidfile])


def sleep_forever():
    while True:
        time.sleep(3600)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="main")
    p.add_argument("--pidfile", required=True)
    p.add_argument("--exit-code", type=int)
    p.add_argument("--port")
    args = p.parse_args()
    ignore_signals()
    if args.role == "daemon":
        record(args.pidfile)
        sleep_forever()
    record(args.pidfile)
    if args.role == "leaf":
        sleep_forever()
    if args.role == "child":
        spawn("leaf", args.pidfile)
        sleep_forever()
    if args.role == "daemonizer":
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_LAUNCH_ID"}
                os.execve(
                    sys.executable, [sys.executable, __file__, "--role", "daemon", "--pidfile", args.pidfile], env
                )
            os._exit(0)
        os.wait()
        os._exit(0)
    # main
    spawn("child", args.pidfile)
    spawn("child", args.pidfile)
    spawn("daemonizer", args.pidfile).wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        with open(args.pidfile) as f:
            n = len(f.read().split())
        if n >= EXPECTED + 1:  # + the daemonizer itself
            break
        time.sleep(0.05)
    print(f"tree up: {n} processes", flush=True)
    if args.exit_code is not None:
        print(f"main exits with status {args.exit_code}, leaving its workers behind", flush=True)
        os._exit(args.exit_code)
    sleep_forever()


if __name__ == "__main__":
    main()
