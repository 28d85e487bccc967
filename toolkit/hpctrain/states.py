"""SLURM job states, failure classes, what a retry can do about each, and the node's exit codes.

Every stage decides these questions here and only here: the registry (which states are final and never
re-queried), the collector (which state explains a failure, which class an attempt gets), the retry policy
(which classes are retried), the supervisor and watchdog, and every rank (its exit code, its failure event).

The values are strings written to disk (summary.json, attempts.jsonl, events.jsonl, the registry): they
never change, so old run folders still read. The enums subclass `str`/`int`, so a member equals its
value (`JobState.COMPLETED == "COMPLETED"`), serializes as it and hashes as it: code that holds a state
read back from disk as a plain string compares and looks it up the same way.

Stdlib only: the CLI, the collector and every rank import this module.
"""

from __future__ import annotations

from enum import Enum, IntEnum


class _StrEnum(str, Enum):
    """`enum.StrEnum` (Python 3.11+) for 3.10: str() and format() give the value, not `Class.MEMBER`."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class JobState(_StrEnum):
    """Every job state sacct or squeue prints (`man sacct`, JOB STATE CODES; `man squeue`), plus UNKNOWN
    (no record: sacct down or the job not known yet). The local executor reports RUNNING, COMPLETED, FAILED."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    RESIZING = "RESIZING"
    UPDATE_DB = "UPDATE_DB"
    POWER_UP_NODE = "POWER_UP_NODE"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    REVOKED = "REVOKED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    UNKNOWN = "UNKNOWN"
    # hpctrain's own, for a submission whose sbatch answer was lost (hpctrain.slurm.uncertain): the job may
    # be queued (SUBMIT_UNKNOWN, reconciled from squeue/sacct by the run's --comment tag), or SLURM never
    # listed it within the grace period (SUBMIT_FAILED, final).
    SUBMIT_UNKNOWN = "SUBMIT_UNKNOWN"
    SUBMIT_FAILED = "SUBMIT_FAILED"


# A job in one of these states is over for good: SLURM will not change its record again, so the registry
# caches it and stops asking. Not final, by choice:
# * REQUEUED: the job goes back to PENDING and runs again (its earlier run ended: see RUN_ENDED_STATES).
# * REQUEUE_HOLD / SPECIAL_EXIT / RESV_DEL_HOLD: requeued and held; a person's `scontrol release` runs it again.
# * REVOKED: a federation moved the job to a sibling cluster, where it goes on.
# * SUSPENDED / STOPPED: resumable.
FINAL_STATES: frozenset[JobState] = frozenset({
    JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT, JobState.PREEMPTED,
    JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.BOOT_FAIL, JobState.DEADLINE, JobState.SUBMIT_FAILED,
})
# The two copies this replaces disagreed on REQUEUED: the registry's list left it out (a requeued JOB is not
# over), the collector's included it (a summary row marked REQUEUED is an earlier RUN of a requeued job, and
# that run is over). Both were right about different things, so there are two sets: a job's state is final
# when in FINAL_STATES; a row that describes one run of a job has ended when in RUN_ENDED_STATES.
RUN_ENDED_STATES: frozenset[JobState] = FINAL_STATES | {JobState.REQUEUED}
ACTIVE_STATES: frozenset[JobState] = frozenset(JobState) - RUN_ENDED_STATES - {JobState.UNKNOWN}

# States in which the job was stopped from outside (a person, the time limit, the scheduler, a lost node):
# what the ranks logged while dying (peers gone, SIGKILL) is a consequence, not the cause.
STOPPED_FROM_OUTSIDE: frozenset[JobState] = frozenset({
    JobState.CANCELLED, JobState.TIMEOUT, JobState.PREEMPTED, JobState.NODE_FAIL, JobState.DEADLINE,
    JobState.BOOT_FAIL, JobState.REQUEUED,
})


def normalize_state(raw: str) -> str:
    """sacct's text -> a state: "CANCELLED by 1000" -> CANCELLED, "COMPLETED+" (a truncated column) ->
    COMPLETED, "" -> UNKNOWN. A word this module does not know (a newer SLURM) is kept as it is, upper-cased:
    it is then neither final nor a failure, so the job is simply asked about again."""
    word = raw.strip().split(" ", 1)[0].rstrip("+").upper()
    if not word:
        return JobState.UNKNOWN
    try:
        return JobState(word)
    except ValueError:
        return word


def is_final(state: str | None) -> bool:
    """The job will not change state again (see FINAL_STATES)."""
    return state in FINAL_STATES


def run_ended(state: str | None) -> bool:
    """This run of the job is over (a REQUEUED run is, though its job goes on)."""
    return state in RUN_ENDED_STATES


class FailureClass(_StrEnum):
    """Why an attempt failed: the `failure_class` of summary.json, attempts.jsonl and the registry
    (docs/summary.md explains the evidence for each)."""

    GPU_OOM = "gpu_oom"  # CUDA/HIP out of memory (torch.OutOfMemoryError)
    HOST_OOM = "host_oom"  # the kernel's or SLURM's OOM killer, SLURM state OUT_OF_MEMORY, Python MemoryError
    COMM_TIMEOUT = "comm_timeout"  # NCCL/gloo collective timed out or its connection broke, with no deeper cause
    HANG = "hang"  # no progress long before the job ended (heartbeats), or the watchdog's hang verdict
    PYTHON_EXCEPTION = "python_exception"  # the user's code or config raised
    INPUT_ERROR = "input_error"  # the node refused an input file (config, data, checkpoint): exit code 2
    CONTAINER_ERROR = "container_error"  # the container runtime could not start the image
    PREFLIGHT = "preflight"  # hpctrain's pre-flight rendezvous: a rank never joined (exit code 4)
    # A node died or went away. A lost peer is this class too: the watchdog's peer_lost verdict, and survivors'
    # "connection closed by peer" naming a host whose ranks just stopped, both mean the peer's node (or its
    # process) died without a word, and a retry must exclude that host, as for SLURM's NODE_FAIL.
    NODE_FAIL = "node_fail"
    # A node whose ranks stayed slower than the others' median for fault.straggler_patience_s (the in-job
    # driver's straggler verdict): it works, so it is not a node failure, but it is replaced or excluded like one.
    STRAGGLER = "straggler"
    TIME_LIMIT = "time_limit"  # SLURM's TIMEOUT / DEADLINE, or the pre-timeout signal (checkpointed)
    PREEMPTED = "preempted"  # SLURM preempted or requeued it, or the node stopped on SIGTERM (checkpointed)
    CANCELLED = "cancelled"  # scancel by a person (the watchdog's own cancel is a hang or a node_fail)
    UNKNOWN = "unknown"  # the job failed and no evidence says why


# What a retry can do about each class (hpctrain.fault.policy acts on these; every class is in exactly one).
# Retried: the cause is outside the run (a node, the scheduler, the clock) or may be transient.
RETRYABLE: frozenset[FailureClass] = frozenset({
    FailureClass.NODE_FAIL, FailureClass.STRAGGLER, FailureClass.PREEMPTED, FailureClass.TIME_LIMIT, FailureClass.HANG,
    FailureClass.COMM_TIMEOUT, FailureClass.PREFLIGHT, FailureClass.UNKNOWN,
})
# Not retried: the same code, config, input, sizing or image fails the same way again; a person must fix it.
USER_ERRORS: frozenset[FailureClass] = frozenset({
    FailureClass.PYTHON_EXCEPTION, FailureClass.GPU_OOM, FailureClass.HOST_OOM, FailureClass.CONTAINER_ERROR,
    FailureClass.INPUT_ERROR,
})
# Not retried either: a person stopped it on purpose.
STOPPED_BY_PERSON: frozenset[FailureClass] = frozenset({FailureClass.CANCELLED})
# Events outside the run: the same one twice in a row says nothing about the run (bad luck, not a loop).
OUTSIDE_EVENTS: frozenset[FailureClass] = frozenset({
    FailureClass.NODE_FAIL, FailureClass.STRAGGLER, FailureClass.PREEMPTED, FailureClass.TIME_LIMIT,
})
# Classes whose `host` names a machine to keep the retry away from (--exclude).
IMPLICATES_HOST: frozenset[FailureClass] = frozenset({
    FailureClass.NODE_FAIL, FailureClass.STRAGGLER, FailureClass.PREFLIGHT, FailureClass.HANG,
})


def is_retryable(cls: str | None) -> bool:
    """A retry may succeed where this attempt failed (None, no failure, is not retried: nothing to fix)."""
    return cls in RETRYABLE


# What SLURM's state alone says about the failure, when no log or event says more. FAILED is not here: it
# says only that a process exited non-zero, so its class comes from the evidence (else UNKNOWN).
CLASS_OF_STATE: dict[JobState, FailureClass] = {
    JobState.TIMEOUT: FailureClass.TIME_LIMIT,
    JobState.DEADLINE: FailureClass.TIME_LIMIT,
    JobState.PREEMPTED: FailureClass.PREEMPTED,
    JobState.NODE_FAIL: FailureClass.NODE_FAIL,
    JobState.BOOT_FAIL: FailureClass.NODE_FAIL,
    JobState.CANCELLED: FailureClass.CANCELLED,
    JobState.OUT_OF_MEMORY: FailureClass.HOST_OOM,
}


def class_of_state(state: str | None) -> FailureClass | None:
    """The class SLURM's state alone implies: CLASS_OF_STATE, UNKNOWN for FAILED, None otherwise
    (COMPLETED, still running, or a REQUEUED run whose cause needs the logs)."""
    if state == JobState.FAILED:
        return FailureClass.UNKNOWN
    try:
        return CLASS_OF_STATE.get(JobState(state)) if state else None
    except ValueError:
        return None


class ExitCode(IntEnum):
    """The node entrypoint's exit code, the same on every rank of a failed run (hpctrain.node.launch.main)."""

    OK = 0
    ERROR = 1  # anything else: the traceback is in logs/attempt-K.rank-R.log
    INPUT = 2  # bad input: rank 0's stderr names the file and the fix
    STOPPED = 3  # stopped on SLURM's pre-timeout/preemption signal after a checkpoint: a resubmit resumes
    PREFLIGHT = 4  # the pre-flight rendezvous failed


# The class an exit code alone implies (when no log or event names one).
CLASS_OF_EXIT: dict[ExitCode, FailureClass] = {
    ExitCode.INPUT: FailureClass.INPUT_ERROR,
    ExitCode.PREFLIGHT: FailureClass.PREFLIGHT,
}


def exit_status(exit_code: str | int | None) -> int | None:
    """The process's exit status from sacct's "CODE:SIGNAL" ("2:0" -> 2), an int, or None."""
    if exit_code is None or isinstance(exit_code, int):
        return exit_code
    head = exit_code.split(":")[0].strip()
    return int(head) if head.isdigit() else None


def class_of_exit(exit_code: str | int | None) -> FailureClass | None:
    """CLASS_OF_EXIT for sacct's exit code ("2:0" -> input_error); None for any other code."""
    status = exit_status(exit_code)
    if status is None:
        return None
    try:
        return CLASS_OF_EXIT.get(ExitCode(status))
    except ValueError:
        return None


# SLURM sends the --signal=SIG@N signal up to 60 s earlier than asked ("due to the resolution of event handling",
# man sbatch); more slack covers a rank that reached its step boundary late.
SIGNAL_EARLY_S = 90.0


def stop_class(signum: int, seconds_left: float | None, window_s: float, cancelled: bool = False,
               limit_s: float = 0.0) -> FailureClass | None:
    """Why a rank was told to stop, from the signal and how much of the time limit was left.

    USR1/USR2 is the pre-timeout signal only near the end (`seconds_left` within the signal window plus
    SLURM's early margin); earlier it is a preemption (PreemptParameters=send_user_signal) or a person's
    `scancel --signal`. TERM is a preemption, unless `hpctrain cancel` asked for it (`cancelled`). With
    the time left unknown, USR1/USR2 keep their documented meaning (the time limit). 0: this rank learned of
    the stop from a peer (None: the peer's event names it). Where the time left is counted from the rank's own
    start (no SLURM_JOB_START_TIME), the job's start-up went before it: 5% of the limit (`limit_s`) more slack
    keeps a real time limit from reading as a preemption (either is retried and resumes)."""
    import signal

    if cancelled and signum:
        return FailureClass.CANCELLED
    if signum in (signal.SIGUSR1, signal.SIGUSR2):
        if seconds_left is not None and seconds_left > window_s + SIGNAL_EARLY_S + 0.05 * limit_s:
            return FailureClass.PREEMPTED
        return FailureClass.TIME_LIMIT
    return FailureClass.PREEMPTED if signum == signal.SIGTERM else None


# The in-job driver's restart number k of an srun step (0 or unset: the job's first step), in every rank's
# environment: hpctrain.fault.injob sets it, hpctrain.node.launch.predecessors reads it.
INJOB_RESTART_ENV = "HPCTRAIN_INJOB_RESTART"
# "0" in the submitting environment turns warm ranks off (hpctrain.fault.warm): every srun step of the in-job
# driver starts its ranks cold, importing torch and DeepSpeed, as before zygotes existed.
WARM_RANKS_ENV = "HPCTRAIN_WARM_RANKS"
# The driver's health step: HPCTRAIN_NODE_MODE=health makes a rank's entry (submitit's callable, or python -m
# hpctrain.node) run hpctrain.node.launch.health instead of training, writing its report into HPCTRAIN_HEALTH_DIR.
NODE_MODE_ENV, HEALTH_DIR_ENV = "HPCTRAIN_NODE_MODE", "HPCTRAIN_HEALTH_DIR"
# The driver's second health step, on borderline nodes only: HPCTRAIN_HEALTH_ROUND=2 makes the check measure
# the node's compute again (no network test) into HPCTRAIN_HEALTH_DIR; the driver judges both rounds' samples.
HEALTH_ROUND_ENV = "HPCTRAIN_HEALTH_ROUND"
# Tests' fault injection into the health check (hpctrain.node.launch.health's docstring lists the entries; the
# driver reads "borderline:host=H", the node the rest).
HEALTH_INJECT_ENV = "HPCTRAIN_HEALTH_INJECT"

# Verdicts in metrics/watchdog.jsonl that blame nodes, not the program: a lost peer (the watchdog), a node that
# failed the health check and a persistent straggler (the in-job driver, when no spare was left). The supervisor
# and the collector read each as node_fail on its `silent_hosts`, which a resubmission excludes; "hang" is the
# other verdict.
NODE_VERDICTS: frozenset[str] = frozenset({"peer_lost", "unhealthy", "straggler"})


def class_of_verdict(event: str | None) -> FailureClass:
    """The failure class a watchdog.jsonl verdict names: a straggler is a straggler (slow, not failed), the other
    node verdicts are node_fail, anything else a hang. Every one of them implicates its `silent_hosts`."""
    if event == "straggler":
        return FailureClass.STRAGGLER
    return FailureClass.NODE_FAIL if event in NODE_VERDICTS else FailureClass.HANG
