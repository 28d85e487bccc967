"""The exceptions a program's output holds, and which one caused its failure: one reader for both sides.

The node reads its user's program's stderr tail (hpctrain.node.launch.script.failure: the failure event) and the
collector reads the rank logs (hpctrain.collect.classify: the failure class); both call `cause`, so that the two
never disagree on which exception failed a run.

Under a per-node launcher (DeepSpeed's, torchrun, accelerate) one log holds every local rank's output, and a run
that failed on one rank shows several tracebacks: the failing rank's own exception first, then its healthy peers'
errors from the collective it left (gloo's "Connection closed by peer", NCCL's remote error, a timeout), then the
launcher's own (torchrun's ChildFailedError, accelerate's CalledProcessError). The cause is the first exception
that is neither a peer's complaint nor a launcher's; a peer error is the cause only where nothing else was raised
(a node that died prints nothing). A chained exception ("The above exception was the direct cause of...") counts
as the last one of its chain. Lines may carry the rank log's stamp ("2026-12-03T15:17:53 rank0 STDERR ") and a
launcher's rank tag ("[rank1]: ", "[default1]:", srun --label's "1: "): each exception keeps its rank tag.

Stdlib only: the node imports it before torch, the CLI on the login node.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# A collective failed because a peer's connection went away (gloo's TCP pair, NCCL's remote error): the peer's
# process or node died. Read in an exception's text here, by the collector, and by the hang watchdog
# (fault.watchdog) in a rank's failure record, so all of them call the same failure a lost peer. Too loose for
# every log line ("Connection refused" from sacct, "Broken pipe" from a pipe): the scan of whole logs uses COMM.
PEER_LOST = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Read error \[|Write error \[|"
                       r"ncclRemoteError|remote process exited|Socket closed|Connection refused")
# A collective that failed or timed out (what a surviving rank prints when its peer or node is gone).
COMM = re.compile(r"Watchdog caught collective operation timeout|Connection closed by peer|"
                  r"Timed out waiting \d+ ?ms|gloo.*timed? ?out|NCCL (?:error|WARN).*(?:timeout|timed out)|"
                  r"ProcessGroupNCCL.*[Tt]imeout|DistBackendError|Connection reset by peer|"
                  r"ncclRemoteError|ncclSystemError|Socket Timeout|collective operation timeout")
# What a launcher raises when one of its ranks failed: it only says that a rank failed.
LAUNCHER = re.compile(r"(?:^|\.)(?:ChildFailedError|CalledProcessError)\b")

HEAD = "Traceback (most recent call last):"
# The line that ends a traceback: `pkg.module.Name: message` or a bare `Name`, not indented.
EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed|Failure|Requested|"
                      r"Timeout|Warning|Fault|Abort)|[A-Za-z_][\w.]*\.[A-Z]\w*)(?::\s?(.*))?$")
# hpctrain's rank log stamp (node.launch.script.RankLog, the node's logger), then a launcher's rank tag.
_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S* rank\d+ (?:STDOUT|STDERR) ")
_TAG = re.compile(r"^(?:\[(?:rank|default)(\d+)\]:|(\d+): )\s?")
_CHAINED = ("The above exception was the direct cause of the following exception:",
            "During handling of the above exception, another exception occurred:")


def peer_error(text: str) -> bool:
    """A line that reports a lost peer or a failed collective (what a surviving rank prints when a node dies)."""
    return bool(PEER_LOST.search(text) or COMM.search(text))


@dataclass(frozen=True)
class Raised:
    """One exception that ended a traceback in a program's output."""

    exception: str  # "ValueError: boom" (the message as printed, the launcher's rank tag removed)
    start: int  # index of its "Traceback (most recent call last):" line
    end: int  # index of its exception line
    rank: int | None = None  # the launcher's rank tag of its lines ("[rank1]:"), when there is one

    @property
    def peer(self) -> bool:
        """A complaint about a peer or a collective: the consequence of another rank's failure."""
        return peer_error(self.exception)

    @property
    def launcher(self) -> bool:
        return bool(LAUNCHER.search(self.exception.split(":", 1)[0]))


def split(line: str) -> tuple[int | None, str]:
    """(the launcher's rank tag or None, the line without the stamp and the tag)."""
    text = _STAMP.sub("", line.rstrip("\n"), count=1)
    m = _TAG.match(text)
    if not m:
        return None, text
    return int(m.group(1) or m.group(2)), text[m.end():]


def raised(lines: Sequence[str]) -> list[Raised]:
    """Every exception that ended a traceback, in the order they were printed; the lines of other ranks (another
    rank tag) interleaved with a traceback are skipped; an exception that a later one of its chain replaced is
    left out. A traceback cut before its exception line gives none."""
    parsed = [split(ln) for ln in lines]
    out: list[Raised] = []
    taken: set[int] = set()
    for i, (tag, text) in enumerate(parsed):
        if HEAD not in text:
            continue
        for j in range(i + 1, min(len(parsed), i + 400)):
            t2, body = parsed[j]
            if (tag is not None and t2 != tag) or body.startswith((" ", "\t")) or j in taken:
                continue
            if HEAD in body:
                break  # a new traceback of the same rank before this one ended: this one was cut
            m = EXC_LINE.match(body.strip())
            if m:
                taken.add(j)
                if not _chained_after(parsed, j, tag):
                    out.append(Raised(m.group(1) + (f": {m.group(2)}" if m.group(2) else ""), i, j, tag))
                break
    return sorted(out, key=lambda r: r.end)


def _chained_after(parsed: list[tuple[int | None, str]], j: int, tag: int | None) -> bool:
    """The exception at `j` is followed (same rank) by a chain's "... another exception occurred:" line."""
    for t2, body in parsed[j + 1:j + 40]:
        if tag is not None and t2 != tag:
            continue
        if not body.strip():
            continue
        return body.strip() in _CHAINED
    return False


def cause(lines: Sequence[str]) -> Raised | None:
    """The exception that failed the program: the first one of its own (not a peer's complaint, not a launcher's
    "a child failed"), else the first peer error, else the launcher's; None when no traceback ended."""
    found = raised(lines)
    own = [r for r in found if not r.peer and not r.launcher]
    peers = [r for r in found if not r.launcher]
    first = own or peers or found
    return first[0] if first else None


def truncated(lines: Sequence[str]) -> bool:
    """A traceback began but none ended (the log was cut, or the rank killed while printing)."""
    return any(HEAD in ln for ln in lines) and not raised(lines)
