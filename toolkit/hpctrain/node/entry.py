"""What every rank runs: the callable submitit pickles, and `python -m hpctrain.node`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeJob:
    """Run on every rank of a job: pre-flight rendezvous first, then (mode "train") the trainer.

    Kept tiny and importable without torch so that submitit can unpickle it anywhere; the heavy
    modules load inside `__call__`, on the compute node.
    """

    run_dir: str
    mode: str = "train"  # "train" | "preflight"

    def __call__(self) -> int:
        from hpctrain.node.main import run  # heavy imports happen on the node only

        return run(self.run_dir, self.mode)

    def checkpoint(self, *args: object, **kwargs: object) -> object:
        """submitit calls this on SLURM's pre-timeout USR2 (after the ranks saved their checkpoint): the same
        call again, so submitit requeues the job instead of refusing a timed-out non-checkpointable one.
        The requeued ranks resume from the latest complete checkpoint by themselves. A run submitted with
        `--retries 0` asked for no automatic retries of any kind: None, and the job ends."""
        from pathlib import Path

        import tomllib
        from submitit.helpers import DelayedSubmission

        try:
            spec = tomllib.loads((Path(self.run_dir) / "spec.toml").read_text(encoding="utf-8"))
            if int(spec.get("launch", {}).get("retries", 1)) <= 0:
                return None
        except (OSError, ValueError):
            pass  # unreadable spec: requeue, the ranks will report it
        return DelayedSubmission(NodeJob(self.run_dir, self.mode))
