"""SLURM hostlist expansion and the rendezvous port, pure Python (no `scontrol`), for the login node,
the ranks and tests alike.

Grammar handled: top-level comma lists (`a,b`), bracket ranges with comma lists inside
(`node[1-4,7]`), zero padding taken from the low bound (`n[08-10]` -> n08 n09 n10), and several
bracket groups in one name (`r[1-2]n[1-2]`, expanded like SLURM: the last group varies fastest).
"""

from __future__ import annotations

import re

from hpctrain.errors import HpcUsageError

_RANGE = re.compile(r"(\d{1,18})(?:-(\d{1,18}))?")
# No allocation has more hosts (spec.rules.MAX_NODES); the count is checked before anything is
# expanded, so 'n[1-100000000]' is refused at once instead of building gigabytes of names.
MAX_HOSTS = 100_000


def _too_many(whole: str, count: int) -> HpcUsageError:
    return HpcUsageError(f"nodelist = {whole[:80]!r}: expands to {count} hosts, more than the limit of {MAX_HOSTS}. "
                         "Fix: pass the hostlist of a real allocation")

# MASTER_PORT derives from the job id, so every rank computes it alone and two jobs sharing a node differ.
# 20000-31998: below Linux's ephemeral range (32768+), whose ports outgoing connections soon take again;
# the pre-flight binds MASTER_PORT + 1, so both stay under 32000.
PORT_BASE, PORT_SPAN = 20000, 11999


def rendezvous_port(job_id: str) -> int:
    """The job's MASTER_PORT (its digits only: a local job id may carry other characters)."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def rendezvous_port_shell(job_id_var: str = "SLURM_JOB_ID") -> str:
    """rendezvous_port as a bash arithmetic expansion, for the batch script (a SLURM job id is all digits)."""
    return f"$(({PORT_BASE} + {job_id_var} % {PORT_SPAN}))"


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    cur = ""
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HpcUsageError(f"nodelist = {text!r}: nested '[' is not a SLURM hostlist. Fix: "
                                    "write it like 'node[1-4,7],gpu01'")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HpcUsageError(f"nodelist = {text!r}: unbalanced ']'. Fix: write it like 'node[1-4]'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise HpcUsageError(f"nodelist = {text!r}: unbalanced '['. Fix: write it like 'node[1-4]'")
    parts.append(cur)
    return parts


def _expand_ranges(body: str, whole: str) -> list[str]:
    """`1-3,07` -> ['1', '2', '3', '07'] keeping the low bound's width as padding."""
    bounds: list[tuple[str, int, int]] = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise HpcUsageError(f"nodelist = {whole!r}: bad range {item!r}. Fix: use N or N-M, e.g. 'node[1-4,7]'")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HpcUsageError(f"nodelist = {whole!r}: range {item!r} runs backwards. Fix: write {hi}-{lo}")
        bounds.append((lo, int(lo), int(hi)))
    count = sum(hi - lo + 1 for _, lo, hi in bounds)
    if count > MAX_HOSTS:
        raise _too_many(whole, count)
    return [str(i).zfill(len(text)) for text, lo, hi in bounds for i in range(lo, hi + 1)]


def _expand_one(name: str, whole: str) -> list[str]:
    """Expand one host pattern, which may hold several bracket groups."""
    pieces = re.split(r"(\[[^\]]*\])", name)
    results = [""]
    for piece in pieces:
        if piece.startswith("["):
            values = _expand_ranges(piece[1:-1], whole)
            if len(results) * len(values) > MAX_HOSTS:  # r[1-1000]n[1-1000]: the product counts
                raise _too_many(whole, len(results) * len(values))
            results = [r + v for r in results for v in values]
        else:
            results = [r + piece for r in results]
    return results


def expand(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist such as ``"node[1-4,7],gpu01"`` into host names, in order.

    Empty input or an empty element is an error: a hostfile built from it would be wrong, and
    DeepSpeed would silently fall back to local GPUs (its runner only warns about a bad hostfile).
    """
    text = nodelist.strip()
    if not text:
        raise HpcUsageError("nodelist = '': no hosts. Fix: pass a SLURM hostlist such as 'node[1-4]'")
    hosts: list[str] = []
    for part in _split_top(text):
        part = part.strip()
        if not part:
            raise HpcUsageError(f"nodelist = {nodelist!r}: empty element. Fix: remove the stray comma")
        if any(c.isspace() for c in part):
            raise HpcUsageError(f"nodelist = {nodelist!r}: host {part!r} contains whitespace. Fix: remove it")
        hosts.extend(_expand_one(part, nodelist))
        if len(hosts) > MAX_HOSTS:
            raise _too_many(nodelist, len(hosts))
    return hosts
