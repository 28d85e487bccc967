"""The local executor's job controller: submitit's own, plus a record of how its tasks ended.

submitit's local controller (`python -m submitit.local._local FOLDER`) starts one process per rank, waits for them
and exits 0 whatever they did; the process that started it (`hpctrain submit`) is long gone by then, so nobody
learns a task's exit status. A rank that died hard (os._exit, a signal, the OOM killer) leaves no result pickle
either, and `summary` could only say "exit ?". This controller is submitit's with one addition: when its tasks
have ended it writes `submitit/JOB_exit.json` (JOB: the controller's pid, the local job id), the tasks' statuses
and the job's exit code in sacct's "CODE:SIGNAL" form, which hpctrain.slurm.refresh records for the attempt
like sacct's for a SLURM job.

    python -m hpctrain.slurm.localctl RUN/submitit      # started by make_executor's submit, never by hand

Stdlib at module level: the CLI reads the records (read_exit_code) without importing submitit.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODULE = "hpctrain.slurm.localctl"  # in the controller's argv: dispatch._is_local_controller looks for it
REAP_S = 5.0  # how long to wait for a task the controller just sent SIGKILL to (its status is the record)


def exit_record(folder: Path, job_id: str) -> Path:
    """Where the controller of local job `job_id` writes its tasks' exit statuses (in submitit's folder)."""
    return Path(folder) / f"{job_id}_exit.json"


def job_exit_code(statuses: Sequence[int | None]) -> str | None:
    """The job's exit code in sacct's "CODE:SIGNAL" form from its tasks' Popen return codes (-N: signal N).

    A signal wins over an exit status: a rank killed (SIGKILL from the OOM killer) is the cause, its peers'
    non-zero exits the consequence; then the highest status (srun's rule). Tasks that could not be reaped
    (None) are left out; None when no task's status is known."""
    known = [s for s in statuses if s is not None]
    if not known:
        return None
    signals = [-s for s in known if s < 0]
    if signals:
        return f"0:{signals[0]}"
    return f"{max(known)}:0"


def read_exit_code(folder: Path, job_id: str) -> str | None:
    """The exit code the controller of local job `job_id` recorded; None if it wrote none (it was killed,
    it is still running, or the job ran under submitit's own controller, before this module existed)."""
    try:
        rec = json.loads(exit_record(folder, job_id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    code = rec.get("exit_code") if isinstance(rec, dict) else None
    return str(code) if code else None


def _write_record(folder: Path, job_id: str, statuses: Sequence[int | None]) -> None:
    """Atomically (temp file + rename), mode 0600 like everything in a run folder; a requeue's later run of
    the tasks replaces the earlier run's record, so the file always holds how the job ended."""
    from hpctrain.runs.folder import write_private

    rec = {"job_id": job_id, "exit_code": job_exit_code(statuses), "task_statuses": list(statuses),
           "time": time.time()}
    with contextlib.suppress(OSError):  # a record is a courtesy: never fail the controller over it
        write_private(exit_record(folder, job_id), json.dumps(rec) + "\n")


def _reaped(task: subprocess.Popen[Any]) -> int | None:
    try:
        return task.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        return None


def _controller_class() -> type:
    """submitit's Controller with the record written where it lets go of its tasks (kill_tasks ends every run
    of the tasks, a normal end, a time-out, a requeue or a signal to the controller alike)."""
    from submitit.local.local import Controller

    class RecordingController(Controller):
        def kill_tasks(self) -> None:
            tasks = list(self.tasks)
            super().kill_tasks()
            if tasks:
                _write_record(self.folder, self.pid, [_reaped(t) for t in tasks])

    return RecordingController


def start_controller(folder: Path, command: str, *, tasks_per_node: int, cuda_devices: str, timeout_min: float,
                     signal_delay_s: int, stderr_to_stdout: bool = False) -> subprocess.Popen[bytes]:
    """submitit.local.local.start_controller with this module as the controller (same environment contract:
    the SUBMITIT_LOCAL_* variables its Controller reads). No `setup` commands: hpctrain sets none, and
    without a shell the controller's pid is the job id."""
    env = dict(os.environ)
    env.update(
        SUBMITIT_LOCAL_NTASKS=str(tasks_per_node), SUBMITIT_LOCAL_COMMAND=command,
        SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * timeout_min)), SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(signal_delay_s)),
        SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_STDERR_TO_STDOUT="1" if stderr_to_stdout else "", SUBMITIT_EXECUTOR="local",
        CUDA_VISIBLE_DEVICES=cuda_devices, SUBMITIT_LOCAL_WITH_SHELL="",
    )
    return subprocess.Popen([sys.executable, "-m", MODULE, str(folder)], env=env)


def make_executor(folder: Path) -> Any:
    """A submitit LocalExecutor whose jobs run under this module's controller."""
    import submitit
    from submitit.local.local import LocalJob

    class RecordingLocalExecutor(submitit.LocalExecutor):
        def _submit_command(self, command: str) -> Any:
            # submitit's own, but for the controller it starts.
            ntasks = self.parameters.get("tasks_per_node", 1)
            n_gpus = self.parameters.get("gpus_per_node", 0)
            visible = self.parameters.get("visible_gpus", ())
            gpus = range(n_gpus) if visible == () else visible[:n_gpus]
            process = start_controller(self.folder, command, tasks_per_node=ntasks,
                                       cuda_devices=",".join(str(k) for k in gpus),
                                       timeout_min=self.parameters.get("timeout_min", 2.0),
                                       signal_delay_s=self.parameters.get("signal_delay_s", 30),
                                       stderr_to_stdout=self.parameters.get("stderr_to_stdout", False))
            return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))

    return RecordingLocalExecutor(folder=folder)


def main(argv: Sequence[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m {MODULE} SUBMITIT_FOLDER")
    _controller_class()(Path(argv[0])).run()


if __name__ == "__main__":
    main(sys.argv[1:])
