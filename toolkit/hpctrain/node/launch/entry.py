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
    # Runs of this job before this one, on submitit's local executor (which restarts the tasks on a requeue
    # but, unlike SLURM, exports no SLURM_RESTART_COUNT): each run logs as an attempt of its own.
    restarts: int = 0

    def __call__(self) -> int:
        import os

        from hpctrain.states import NODE_MODE_ENV

        if os.environ.get(NODE_MODE_ENV) == "health":  # the in-job driver's health step (hpctrain.node.launch.health)
            from hpctrain.node.launch import health

            return health.run(self.run_dir)
        from hpctrain.node.launch.main import run  # heavy imports happen on the node only

        if self.restarts and "SUBMITIT_LOCAL_JOB_ID" in os.environ:
            os.environ["HPCTRAIN_LOCAL_RESTARTS"] = str(self.restarts)

        return run(self.run_dir, self.mode)

    def checkpoint(self, *args: object, **kwargs: object) -> object:
        """submitit calls this on SLURM's pre-timeout USR2 (after the ranks saved their checkpoint): the same
        call again, so submitit requeues the job instead of refusing a timed-out non-checkpointable one.
        The requeued ranks resume from the latest complete checkpoint by themselves. A run submitted with
        `--retries 0` asked for no automatic retries of any kind: None, and the job ends.

        Training jobs are submitted `--no-requeue` (a lost node must end the job, for the supervisor), so the
        job is made requeueable here, right before submitit's `scontrol requeue`; the rerun's batch script
        turns it off again. In a container (no scontrol) the batch script's hand-off does both."""
        import os

        import tomllib
        from submitit.helpers import DelayedSubmission

        from hpctrain.runs.folder import RunFolder

        try:
            spec = tomllib.loads(RunFolder(self.run_dir).spec_toml.read_text(encoding="utf-8"))
            if int(spec.get("launch", {}).get("retries", 1)) <= 0:
                return None
        except (OSError, ValueError):
            pass  # unreadable spec: requeue, the ranks will report it
        _allow_requeue(os.environ.get("SLURM_JOB_ID", ""))
        local = "SUBMITIT_LOCAL_JOB_ID" in os.environ
        return DelayedSubmission(NodeJob(self.run_dir, self.mode, self.restarts + 1 if local else self.restarts))


def _allow_requeue(job_id: str) -> None:
    """Best effort: without it submitit's `scontrol requeue` fails and the supervisor resubmits instead."""
    if not job_id:
        return
    try:
        from hpctrain import slurmcommands as _slurm

        _slurm.allow_requeue(job_id)
    except Exception:  # noqa: BLE001,S110 - never let the requeue path fail on this
        pass
