#!/usr/bin/env python3
"""Cold start of `hpctrain --help` against a bare `python -c pass`.

The CLI path imports nothing heavy (docs/architecture.md), so `hpctrain --help` must stay within a few tens of
milliseconds of the interpreter's own start. Runs each command N times (interleaved, so both see
the same machine load), prints min/median per command, their difference and ratio.

    python bench/cli_startup.py [-n 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _time_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20, help="runs per command (default 20)")
    args = ap.parse_args()
    py = sys.executable
    commands = {
        "python -c pass": [py, "-c", "pass"],
        "hpctrain --help": [py, "-m", "hpctrain", "--help"],
        "import hpctrain.cli.main": [py, "-c", "import hpctrain.cli.main"],
    }
    # Warm the page cache and .pyc files once: "cold" here means a new process, not a cold disk.
    for argv in commands.values():
        _time_once(argv)
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(args.n):
        for name, argv in commands.items():
            times[name].append(_time_once(argv))
    base = statistics.median(times["python -c pass"])
    print(f"CLI cold start, {args.n} runs each, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{'command':<22}{'min ms':>9}{'median ms':>11}{'+ms vs python':>15}{'ratio':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<22}{min(ts) * 1e3:>9.1f}{med * 1e3:>11.1f}{(med - base) * 1e3:>15.1f}{med / base:>8.2f}")
    heavy = subprocess.run(
        [py, "-c", ("import sys, hpctrain.cli.main; print(','.join(m for m in ('torch','deepspeed','transformers',"
                    "'submitit','datasets','jinja2','rich') if m in sys.modules) or 'none')")],
        capture_output=True, text=True, check=True).stdout.strip()
    print(f"heavy modules imported by hpctrain.cli.main: {heavy}")


if __name__ == "__main__":
    main()
