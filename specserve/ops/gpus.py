"""`specserve gpus`: memory of every GPU and the processes holding each device.

    specserve gpus [--json] [--devices 0,1]
    specserve gpus --wait-free [--timeout S] [--threshold-mib M] [--interval S]

Processes come from NVML (compute and graphics processes, with their memory) and from
/proc: any process of this PID namespace with /dev/nvidia<minor> open is listed too
(marked "device file"), which matters inside containers where NVML reports host PIDs.

`--wait-free` polls until every selected GPU is free: used memory at most
--threshold-mib (default 1024: an idle GPU is never at 0) and no compute process
listed. The caller's own processes (this command's parent chain, e.g. a Python
script that used CUDA and now waits for its workers' memory to go) are not
waited for: their memory is subtracted and they are not counted as holders.
Without NVML (no NVIDIA GPU or driver) the command says so and exits 0.

Exit codes: 0 shown / all free (or no GPU to look at), 1 --wait-free timed out (what
still holds memory is printed), 2 usage error.
Does not import torch (creating a CUDA context would itself use GPU memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import psutil

from specserve.ops import nvml
from specserve.ops.process_tree import device_holders

EXIT_OK = 0
EXIT_TIMEOUT = 1
EXIT_USAGE = 2


def collect(device_files: bool = True) -> nvml.GpuQuery:
    """NVML's view, plus the processes of this PID namespace that hold a GPU's device file."""
    q = nvml.query(processes=True)
    if not q.available or not device_files:
        return q
    try:
        holders = device_holders()
    except Exception:
        holders = {}
    for g in q.gpus:
        if g.minor is None:
            continue
        dev = f"/dev/nvidia{g.minor}"
        listed = {p.pid for p in g.processes}
        for pid, paths in sorted(holders.items()):
            if dev in paths and pid not in listed:
                visible, name, cmd = nvml.describe_pid(pid)
                if visible:
                    g.processes.append(nvml.GpuProcess(pid=pid, name=name, cmdline=cmd, kind="device-file"))
    return q


def _fmt_mib(x: float) -> str:
    return "?" if x != x else f"{x:.0f}"  # NaN when the device did not answer


def format_table(q: nvml.GpuQuery, width: int = 80) -> str:
    if not q.available:
        return f"{q.reason}: no GPU to show"
    if not q.gpus:
        return "NVML found no GPU"
    head = f"{'GPU':>3}  {'NAME':<24} {'USED / TOTAL MiB':>19} {'UTIL':>5}  PROCESSES (pid, MiB, command)"
    lines = [head]
    for g in q.gpus:
        mem = f"{_fmt_mib(g.memory_used_mib)} / {_fmt_mib(g.memory_total_mib)}"
        util = f"{g.utilization_pct}%" if g.utilization_pct is not None else "-"
        prefix = f"{g.index:>3}  {g.name[:24]:<24} {mem:>19} {util:>5}  "
        procs = g.processes
        if not procs:
            lines.append(prefix + "-")
            continue
        for k, p in enumerate(procs):
            tag = " (device file)" if p.kind == "device-file" else ""
            text = p.describe(width) + tag
            lines.append((prefix if k == 0 else " " * len(prefix)) + text)
    if q.driver_version:
        lines.append(f"driver {q.driver_version}")
    return "\n".join(lines)


def caller_pids() -> set[int]:
    """This process and its ancestors: a caller cannot wait for its own GPU memory to go."""
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def busy(
    q: nvml.GpuQuery, threshold_mib: float, devices: set[int] | None = None, ignore: set[int] = frozenset()
) -> list[str]:
    """One line per selected GPU that is not free (empty list: all free). Processes in `ignore`
    neither count as holders nor count their memory."""
    out = []
    for g in q.gpus:
        if devices is not None and g.index not in devices:
            continue
        others = [p for p in g.processes if p.pid not in ignore]
        compute = [p for p in others if p.kind != "device-file"]
        used = g.memory_used_mib - sum(p.used_mib or 0.0 for p in g.processes if p.pid in ignore)
        if used > threshold_mib or compute or used != used:
            who = "; ".join(p.describe(60) for p in others) or "no process listed"
            out.append(f"GPU {g.index}: {_fmt_mib(used)} MiB used ({who})")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "exit codes: 0 shown / all free (or no GPU), 1 --wait-free timed out, 2 usage error"
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--devices", metavar="LIST", help="comma-separated GPU indices to consider (default: all)")
    parser.add_argument("--wait-free", action="store_true", help="wait until every selected GPU is free")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --wait-free: give up after S seconds (default 300, 0 = never)",
    )
    parser.add_argument(
        "--threshold-mib",
        type=float,
        default=1024.0,
        metavar="M",
        help="with --wait-free: a GPU using at most M MiB and running no compute process is free (default 1024)",
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="with --wait-free: seconds between polls (default 1)"
    )


def run(args: argparse.Namespace) -> int:
    devices: set[int] | None = None
    if args.devices:
        try:
            devices = {int(x) for x in args.devices.split(",") if x.strip()}
        except ValueError:
            print(f"specserve gpus: error: --devices: not a list of integers: {args.devices!r}", file=sys.stderr)
            return EXIT_USAGE
    if args.timeout < 0 or args.interval <= 0 or args.threshold_mib < 0:
        print("specserve gpus: error: --timeout and --threshold-mib must be >= 0, --interval > 0", file=sys.stderr)
        return EXIT_USAGE

    def select(q: nvml.GpuQuery) -> nvml.GpuQuery:
        if devices is not None:
            q.gpus = [g for g in q.gpus if g.index in devices]
        return q

    q = select(collect())
    if not args.wait_free:
        print(json.dumps(q.to_dict(), indent=2) if args.json else format_table(q))
        return EXIT_OK

    def report(state: str, code: int, held: list[str], waited: float) -> int:
        if args.json:
            d = q.to_dict()
            d.update(state=state, waited_s=round(waited, 1), busy=held)
            print(json.dumps(d, indent=2))
        return code

    if not q.available:
        if not args.json:
            print(f"{q.reason}: nothing to wait for")
        return report("no-nvml", EXIT_OK, [], 0.0)
    t0 = time.monotonic()
    last_said = 0.0
    mine = caller_pids()
    while True:
        held = busy(q, args.threshold_mib, ignore=mine)
        waited = time.monotonic() - t0
        if not held:
            if not args.json:
                print(
                    f"all {len(q.gpus)} GPU(s) free (<= {args.threshold_mib:g} MiB, no compute "
                    f"process) after {waited:.1f} s"
                )
            return report("free", EXIT_OK, [], waited)
        if args.timeout and waited >= args.timeout:
            if not args.json:
                print(f"still busy after {args.timeout:g} s:")
                for line in held:
                    print(f"  {line}")
            return report("timeout", EXIT_TIMEOUT, held, waited)
        if not args.json and (last_said == 0.0 or time.monotonic() - last_said >= 10.0):
            last_said = time.monotonic()
            print(f"waiting for {len(held)} GPU(s) to be free: " + "; ".join(held), flush=True)
        time.sleep(args.interval)
        q = select(collect())
