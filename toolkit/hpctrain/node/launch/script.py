"""The user's own program (`submit --script/--module`), started by the node entry in place of the trainer.

node/launch/main.py runs the same path for it as for the trainer: run-folder checks, the pre-flight rendezvous, the
start/stop/failure events, the exit codes; this module starts the program and tells how it ended:

* srun: this process is one rank; the program runs as its child with RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. torchrun/deepspeed/accelerate: this process is the
  node's one task, and the launcher (its child) starts the node's ranks and sets their variables.
  Every rank gets HPCTRAIN_RUN_DIR and HPCTRAIN_DS_CONFIG (hpctrain.runtime reads them).
* SLURM's pre-timeout USR2 (or a preemption's TERM) reaches every process of the step. The program starts
  with USR2 ignored (so that torchrun's or DeepSpeed's launcher does not die of it: they do not handle it);
  hpctrain.runtime installs its handler when the script imports it. The signal is also written to
  stop-request.json, which runtime.should_stop() reads: a signal that came before the import is not lost.
* When the program ends after the signal, the run stopped for requeue (exit 3, resumed by hpctrain.runtime's
  resume_from); otherwise a non-zero exit is the script's failure, told by the last exception of its stderr
  (which passes through here to the log unchanged, its tail kept for the failure event).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.node.checkpointing.checkpointer import StopFlag, wait_for_requeue
from hpctrain.node.dist import DistEnv
from hpctrain.node.monitor.metrics import attempt_number, log
from hpctrain.node.monitor.tracking import ScriptTracker
from hpctrain.runs import tracebacks
from hpctrain.runs.folder import RunFolder
from hpctrain.spec import launch as user_launch
from hpctrain.spec.model import Spec

TAIL_LINES = 200
# The program's rank processes register their stack dumps from here (its sitecustomize; the module says how).
SITE_DIR = str(Path(__file__).resolve().parent / "site")
STACKS_ENV = "HPCTRAIN_STACKS"  # {"dir", "attempt", "job"}: where a rank of the program writes its stack file
STARTED_ENV = "HPCTRAIN_STARTED"  # when this run's node entry started (unix time)
# The last line of a Python traceback: "ValueError: boom", "torch.OutOfMemoryError: CUDA out of memory".
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b(?::.*)?)$")


class ScriptFailed(Exception):
    """The user's program exited non-zero (no stop signal came): the exception that caused it, its traceback (else
    the stderr tail), and the program's rank that raised it (a per-node launcher's rank tag; None: untagged)."""

    def __init__(self, returncode: int, exception: str, tail: list[str], rank: int | None = None) -> None:
        how = (f"killed by signal {signal.Signals(-returncode).name}" if returncode < 0 and -returncode in
               signal.valid_signals() else f"exited with code {returncode}")
        super().__init__(f"the script {how}" + (f": {exception}" if exception else ""))
        self.returncode, self.exception, self.tail, self.rank = returncode, exception, tail, rank


@dataclass
class ScriptStop(StopFlag):
    """StopFlag that also hands the signal to the program and writes stop-request.json (once per signal)."""

    child: subprocess.Popen[bytes] | None = None
    request: str = ""
    started: float = field(default_factory=time.time)  # before install(): a request from now on is this run's
    written: set[int] = field(default_factory=set)

    def _handle(self, signum: int, frame: Any) -> None:
        # The first signal tells why the run stops: the TERM of the requeue that follows a USR2 does not.
        self.signum = self.signum or signum
        child = self.child
        if child is not None and child.poll() is None and signum == signal.SIGUSR2:
            child.send_signal(signum)  # SLURM signals the whole step; a container may not pass it on
        if self.request and signum not in self.written:
            self.written.add(signum)
            _write_request(self.request, signum)


def _write_request(path: str, signum: int) -> None:
    rec = {"job": os.environ.get("SLURM_JOB_ID", ""), "restart": os.environ.get("SLURM_RESTART_COUNT", "0") or "0",
           "signal": signum, "time": time.time()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # the signal itself still reaches the program


# ds_config.json's monitor blocks whose output_path is relative to the run folder (render/deepspeed.py).
MONITOR_BLOCKS = ("tensorboard", "csv_monitor", "wandb")


def script_ds_config(paths: RunFolder) -> Path:
    """The DeepSpeed config a user's program gets. The rendered one names the trackers' folders relative to
    the run folder, where hpctrain's trainer runs; a script runs in its own directory, so its copy
    (ds_config.effective.json) names them absolutely. The rendered file when nothing is relative."""
    from hpctrain.runs.folder import json_text, write_private

    cfg = json.loads(paths.ds_config_json.read_text())
    moved = False
    for block in MONITOR_BLOCKS:
        sect = cfg.get(block)
        if isinstance(sect, dict) and sect.get("output_path") and not os.path.isabs(str(sect["output_path"])):
            sect["output_path"] = str(paths.path / str(sect["output_path"]))
            moved = True
    if not moved:
        return paths.ds_config_json
    write_private(paths.ds_config_effective_json, json_text(cfg))  # every rank writes the same bytes, atomically
    return paths.ds_config_effective_json


def where(spec: Spec, d: DistEnv, paths: RunFolder, ranks_per_node: int, nodes: int) -> user_launch.Where:
    """The allocation's facts for this node's command (spec.launch.script_command)."""
    return user_launch.Where(python=sys.executable, ds_config=str(script_ds_config(paths)),
                             hostfile=str(paths.hostfile),
                             nnodes=str(nodes), ranks_per_node=str(ranks_per_node), node_rank=str(d.node_rank),
                             master_addr=d.master_addr, master_port=str(d.master_port),
                             gpu=spec.resources.gpus_per_node > 0)


def child_env(spec: Spec, d: DistEnv, paths: RunFolder, ranks_per_node: int, started: float,
              base: dict[str, str] | None = None, job_id: str = "") -> dict[str, str]:
    """The program's environment: this process's (prepare_process_env ran), plus the run folder and the
    rendered DeepSpeed config; under a per-node launcher the rank variables are the launcher's to set. Its rank
    processes dump their stacks on SIGURG (site/sitecustomize.py, first on PYTHONPATH, reads HPCTRAIN_STACKS)."""
    env = dict(os.environ if base is None else base)
    env.update(HPCTRAIN_RUN_DIR=str(paths.path), HPCTRAIN_DS_CONFIG=str(script_ds_config(paths)),
               MASTER_ADDR=d.master_addr, MASTER_PORT=str(d.master_port))
    env[STACKS_ENV] = json.dumps({"dir": str(paths.stacks_dir), "attempt": attempt_number(env),
                                  "job": job_id or d.job_id})
    env.pop("HPCTRAIN_STACKS_PID", None)  # a rank below this entry is the one that dumps
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    # A stop request older than this start is an earlier run's (hpctrain.runtime.should_stop ignores it).
    env[STARTED_ENV] = repr(started)
    if user_launch.per_node(spec.launch):
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(key, None)
        env["NODE_RANK"] = str(d.node_rank)
    else:
        env.update(RANK=str(d.rank), WORLD_SIZE=str(d.world_size), LOCAL_RANK=str(d.local_rank),
                   LOCAL_WORLD_SIZE=str(ranks_per_node), NODE_RANK=str(d.node_rank))
    if spec.launch.launcher == "accelerate" and spec.resources.gpus_per_node == 0:
        env.setdefault("ACCELERATE_USE_CPU", "true")  # its --multi_gpu launcher on CPU ranks (spec.launch says why)
    return env


def run_script(spec: Spec, paths: RunFolder, d: DistEnv, stop: ScriptStop, *, ranks_per_node: int,
               nodes: int, job_id: str = "") -> tuple[int, list[str]]:
    """Start the program, pass its stderr through, wait for it. Returns (exit code, stderr tail)."""
    argv = user_launch.script_command(spec.launch, where(spec, d, paths, ranks_per_node, nodes))
    log.info("starting the user's program: %s", user_launch.shell_line(argv))
    stop.request = str(paths.stop_request)  # {"job", "restart", "signal", "time"}
    proc = subprocess.Popen(argv, env=child_env(spec, d, paths, ranks_per_node, stop.started, job_id=job_id),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=_ignore_usr2)  # noqa: PLW1509 - one signal disposition, nothing else
    stop.child = proc
    # Rank 0's entry writes what the program report()s into its trackers as it comes (not only at `sync`).
    tracker = ScriptTracker(paths, spec, attempt_number()).start() if d.rank == 0 and ScriptTracker.wanted(spec) \
        else None
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    sink = RankLog(paths.logs_dir / f"attempt-{attempt_number()}.rank-{d.rank}.log", d.rank)
    pumps = [threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, sink, "stderr", tail),
                              name="hpctrain-script-stderr", daemon=True),
             threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, sink, "stdout", None),
                              name="hpctrain-script-stdout", daemon=True)]
    for pump in pumps:
        pump.start()
    code = proc.wait()
    for pump in pumps:
        pump.join(timeout=10)
    sink.close()
    if tracker is not None:
        tracker.close()
    log.info("the user's program exited with code %d%s", code, f" after signal {stop.signum}" if stop.signum else "")
    return code, list(tail)


def _ignore_usr2() -> None:
    """In the child before exec: USR2 ignored (inherited by the launcher and the ranks) until hpctrain.runtime
    installs its handler."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class RankLog:
    """The program's output in this rank's own log (logs/attempt-K.rank-R.log), each line stamped like the node's
    lines and tagged with its stream, so `hpctrain logs` shows it per rank, host and attempt, merged by time with
    what hpctrain said. One write() per line on an O_APPEND descriptor: whole lines beside the node's logger."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            self.fd = None  # the output still reaches SLURM's log

    def write(self, stream: str, line: str) -> None:
        if self.fd is None:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        with contextlib.suppress(OSError):
            os.write(self.fd, f"{stamp} rank{self.rank} {stream.upper()} {line}\n".encode("utf-8", "replace"))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pump(src: Any, dst: Any, sink: RankLog, stream: str, tail: collections.deque[str] | None) -> None:
    """One of the program's streams to ours (SLURM's log, as before) and to the rank's log, line by line as it
    comes; stderr's last lines are kept for the failure event."""
    out = dst.buffer
    for raw in iter(src.readline, b""):
        try:
            out.write(raw)
            out.flush()
        except (OSError, ValueError):
            pass
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        sink.write(stream, line)
        if tail is not None:
            tail.append(line)


def failure(code: int, tail: list[str]) -> ScriptFailed:
    """The program's non-zero exit as the exception node/launch/main.py reports: the exception that caused it
    (hpctrain.runs.tracebacks.cause: under a per-node launcher the failing rank's own exception, not a healthy
    peer's "connection closed" printed after it, nor the launcher's ChildFailedError / CalledProcessError), the
    lines of its traceback, and the rank that raised it where the launcher tags its lines. A traceback whose head
    scrolled out of the tail leaves its last exception line."""
    got = tracebacks.cause(tail)
    if got is None:
        last = next((m for m in (_EXC_LINE.match(tracebacks.split(ln)[1].strip()) for ln in reversed(tail)) if m),
                    None)
        return ScriptFailed(code, last.group(1) if last else "", tail[-12:])
    own = [ln for ln in tail[got.start:got.end + 1] if got.rank is None or tracebacks.split(ln)[0] == got.rank]
    return ScriptFailed(code, got.exception, own, rank=got.rank)


def requeue_pending(rank: int, stop: StopFlag) -> None:
    """After the stop event: rank 0 hands the job back to SLURM (submitit requeues it, as for the trainer);
    the other ranks wait, so that their exit does not end the step (srun --kill-on-bad-exit) first."""
    if rank == 0:
        stop.chain()
    else:
        wait_for_requeue()
