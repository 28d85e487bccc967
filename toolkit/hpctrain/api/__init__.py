"""hpctrain as a Python library: what `import hpctrain` offers a notebook or a pipeline (docs/api.md).

    run = hpctrain.submit("run.toml", nodes=2, zero=3)   # -> Run: the job is queued, its folder written
    run.wait(timeout=3600).state                          # polls what `hpctrain status` polls
    run.summary()["attempts"][-1]["tokens_per_s"]

The CLI is a caller of these functions like any other: `hpctrain submit`, `plan`, `status`, `list`, `cancel`,
`logs` and `summary` parse their flags, call the function here, and print what it returns. Keywords are the
flags' names (`gpus_per_node=0` is `--gpus-per-node 0`), and a dotted name is a spec key (`**{"train.lr": 1e-4}`
is `--set train.lr=1e-4`): the same keys, the same checks and the same refusals (hpctrain.spec.flags).

Nothing heavy loads with this package (no torch, deepspeed, transformers or submitit): `hpctrain --help` stays
fast, and a login node without torch can use every function.
"""

from __future__ import annotations

from hpctrain.api.request import plan
from hpctrain.api.runs import Cancelled, Listing, Run, Status, Summaries, listing, runs, summaries
from hpctrain.api.submitting import submit

__all__ = ["Cancelled", "Listing", "Run", "Status", "Summaries", "listing", "plan", "runs", "submit", "summaries"]
