"""Stack dumps for a user's program: the rank's own process answers `hpctrain stacks`, under every launcher.

hpctrain's node entry puts this folder first on the PYTHONPATH of the program it starts (submit --script/--module;
hpctrain.node.launch.script.child_env) and names the run's stacks folder in HPCTRAIN_STACKS. Python imports
`sitecustomize` at every interpreter start, so each Python process below the node entry runs this file: the one that
is a rank (RANK set: srun's child, or a rank torchrun, DeepSpeed's launcher or accelerate started; the launchers
themselves run without it) registers faulthandler on SIGURG into stacks/attempt-K.rank-R.txt, exactly as
hpctrain's trainer does (hpctrain.node.monitor.stacks.install). Its own children do not: a spawned worker sees
HPCTRAIN_STACKS_PID naming another process, and a forked one (DataLoader workers) drops the inherited registration.

Then the site's own sitecustomize, which this file's name hides, is imported as if this one were not there.
Nothing here may fail the program: a stack dump is a diagnosis, never a reason not to train.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install() -> None:
    import json

    spec, rank = os.environ.get("HPCTRAIN_STACKS", ""), os.environ.get("RANK", "")
    if not spec or not rank.isdigit() or os.environ.get("HPCTRAIN_STACKS_PID"):
        return
    os.environ["HPCTRAIN_STACKS_PID"] = str(os.getpid())  # this process is the rank; its children are not
    where = json.loads(spec)
    from pathlib import Path

    from hpctrain.node.monitor import stacks

    stacks.install(Path(where["dir"]), int(rank), int(where["attempt"]), str(where["job"]))
    os.register_at_fork(after_in_child=stacks.uninstall)


def _chain() -> None:
    """Import the sitecustomize this one hides (a distribution's or a virtualenv's), with this folder gone."""
    import importlib

    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as err:
        if mine is not None:  # none to chain to: the import system expects to find this module when it returns
            sys.modules["sitecustomize"] = mine
        if err.name != "sitecustomize":
            raise


try:
    _install()
except Exception as exc:  # noqa: BLE001 - see the module's doc: never the program's failure
    print(f"hpctrain: no stack dumps for this rank: {exc}", file=sys.stderr)
_chain()
