"""Start-up phases of one rank, for the restart timeline: when each part of getting to the first step ended.

`mark(name)` records the wall time a phase ended; `report()` gives each phase's duration in seconds from the
previous mark (the first from the process's start, read from /proc where there is one). Rank 0 puts the
report in its training `start` event; hpctrain.fault.injob.timeline shows it beside the driver's own times
(detection, step stopped, next step launched), so a restart's seconds are accounted for part by part. Stdlib.
"""

from __future__ import annotations

import os
import time

_MARKS: list[tuple[str, float]] = []
_NOTES: dict[str, object] = {}


def process_start() -> float:
    """This process's start (wall time): /proc/self/stat's start tick after boot, else the first mark's time."""
    try:
        with open("/proc/self/stat") as f:
            ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _MARKS[0][1] if _MARKS else time.time()


def mark(name: str) -> None:
    _MARKS.append((name, time.time()))


def note(name: str, value: object) -> None:
    """A fact of this start-up that is no duration, carried by report() under `name`: a rank forked by its node's
    zygote (hpctrain.node.launch.zygote) notes which, when it was ready and when it forked (no imports here)."""
    _NOTES[name] = value


def report() -> dict[str, object]:
    """{phase: seconds since the previous mark}, the first from the process start; plus `total_s` and the notes."""
    out: dict[str, object] = {}
    prev = t0 = process_start()
    for name, t in _MARKS:
        out[f"{name}_s"] = round(max(0.0, t - prev), 3)
        prev = t
    out["total_s"] = round(max(0.0, prev - t0), 3)
    out["process_start"] = round(t0, 3)
    out.update(_NOTES)
    return out
