"""The one wrapper around SLURM's commands (sacct, squeue, scontrol, scancel, sinfo, sbatch) hpctrain runs.

submitit owns the pickled call and its own polling; everything else that shells out to SLURM goes
through `_run` here, so that every call gets the same treatment: argv lists (never a shell), a
timeout, bounded retries with exponential backoff while slurmctld/slurmdbd do not answer, and then
one clear `SlurmUnavailable` that names the command and what to check.

Below both sides (layers contract in pyproject.toml): the login side submits and polls through it, and a rank
asks its job's live end and makes its job requeueable through it (hpctrain.node.checkpointing.checkpointer,
hpctrain.node.launch.entry).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

import click

from hpctrain.states import normalize_state

# Messages meaning "the daemon did not answer", not "your request is wrong": worth retrying.
_TRANSIENT = re.compile(
    r"socket timed out|unable to contact slurm controller|connection refused|"
    r"slurmdbd|problem talking to the database|persistent connection|"
    r"zero bytes were transmitted|resource temporarily unavailable|backup controller|"
    r"communications connection failure|slurm_receive_msg|transient|munge",
    re.IGNORECASE,
)
# For sbatch only "not connected at all" is safe to retry: after a send timeout the job may exist.
_SBATCH_RETRYABLE = re.compile(r"unable to contact slurm controller \(connect failure\)|connection refused",
                               re.IGNORECASE)


# sbatch's rejection messages -> the spec field a user should change.
_REJECTIONS: tuple[tuple[str, str], ...] = (
    ("invalid partition", "resources.partition"),
    ("invalid account", "resources.account"),
    ("invalid qos", "resources.qos"),
    ("qos", "resources.qos"),
    ("time limit", "resources.time"),
    ("memory", "resources.mem"),
    ("gres", "resources.gpus_per_node"),
    ("feature specification", "resources.constraint"),
    ("node count", "resources.nodes"),
    ("processors", "resources.cpus_per_task"),
    ("node configuration is not available", "resources"),
    ("excluded", "resources.exclude"),
)


class SlurmUnavailable(click.ClickException):
    """slurmctld/slurmdbd did not answer within the retry budget."""


class SlurmCommandError(click.ClickException):
    """A SLURM command failed for a reason retrying will not fix."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv, self.returncode, self.stderr = list(argv), returncode, stderr
        super().__init__(f"`{' '.join(argv)}` failed (exit {returncode}): {_last_lines(stderr)}")


class SubmitUnknown(SlurmUnavailable):
    """sbatch may or may not have queued the job: no answer in time, killed, or an answer without a
    job id. Never retried (a retry could queue it twice); the caller keeps the run and reconciles it
    from squeue/sacct by the submission's comment."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.kept: list[str] = []  # files the caller kept because the job may need them (its pickles)
        super().__init__(f"the outcome of sbatch is unknown: {reason}")


class SbatchRejected(click.UsageError):
    """sbatch refused the script (bad partition, account, memory...). `field` is the spec field."""

    def __init__(self, reason: str, field: str) -> None:
        self.reason, self.field = reason, field
        super().__init__(f"sbatch rejected the job: {reason} (check {field})")


@dataclass(frozen=True)
class SacctRun:
    """One record of `sacct -D`: a run of a job (SLURM keeps one per requeue, and one per resize)."""

    state: str
    exit_code: str = ""
    nodelist: str = ""
    start: float | None = None  # None: SLURM cleared it (a run requeued before its batch script started)
    end: float | None = None


@dataclass(frozen=True)
class SacctRecord:
    """One job (or array task) as sacct reports its allocation now (its latest run); `history` holds the states
    of every run, oldest first, and `runs` the whole records (hosts and times of each requeued run)."""

    job_id: str
    state: str
    exit_code: str = ""
    nodelist: str = ""
    start: float | None = None
    end: float | None = None
    history: tuple[str, ...] = field(default=())
    runs: tuple[SacctRun, ...] = field(default=())


def _retries() -> int:
    # Each attempt against a dead slurmctld already takes ~9 s (the client's own retries).
    return max(1, int(os.environ.get("HPCTRAIN_SLURM_RETRIES", "3")))


def _backoff() -> float:
    return float(os.environ.get("HPCTRAIN_SLURM_BACKOFF_S", "0.5"))


def _budget() -> float:
    """Total seconds one call may spend retrying: a dead controller must not hang a CLI for minutes."""
    return float(os.environ.get("HPCTRAIN_SLURM_BUDGET_S", "60"))


def _run(argv: Sequence[str], *, input_text: str | None = None, timeout_s: float = 30.0,
         retryable: re.Pattern[str] = _TRANSIENT, env: dict[str, str] | None = None,
         retry_timeouts: bool = True, tries: int | None = None, own_session: bool = False,
         abandon: Callable[[], bool] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a SLURM command; retry transient failures with exponential backoff, then raise. `own_session`: the
    command runs in a session of its own, so a Ctrl-C at the terminal reaches hpctrain but not the command.
    `abandon()` true while it runs (sbatch, a signal held meanwhile): stop waiting and raise SubmitUnknown,
    leaving the command to finish on its own."""
    argv = list(argv)
    delay, last = _backoff(), ""
    tries = tries or _retries()
    started = time.monotonic()
    deadline = started + _budget()
    for attempt in range(tries):
        left = deadline - time.monotonic()
        try:
            proc = _complete(argv, input_text, max(1.0, min(timeout_s, left)), env, own_session, abandon)
        except FileNotFoundError as exc:
            raise SlurmUnavailable(
                f"`{argv[0]}` is not on PATH: SLURM's client tools are not installed here. "
                "Run on a login node, or use --executor local.") from exc
        except subprocess.TimeoutExpired:
            if not retry_timeouts:  # sbatch: the job may be queued already; never submit twice
                raise SubmitUnknown(f"`{argv[0]}` got no answer within {timeout_s:.0f}s") from None
            last = f"no answer within {timeout_s:.0f}s"
        else:
            if proc.returncode == 0:
                return proc
            last = proc.stderr.strip() or proc.stdout.strip()
            if not retryable.search(last):
                raise SlurmCommandError(argv, proc.returncode, proc.stderr)
        if attempt == tries - 1 or time.monotonic() + delay >= deadline or (abandon is not None and abandon()):
            tries = attempt + 1
            break
        time.sleep(delay)
        delay *= 2
    waited = time.monotonic() - started
    what = "slurmdbd (accounting)" if argv[0] in ("sacct", "sacctmgr") else "slurmctld"
    raise SlurmUnavailable(
        f"`{' '.join(argv[:3])}{' ...' if len(argv) > 3 else ''}` failed {tries} time{'s' * (tries != 1)} over "
        f"{waited:.0f}s: {_last_lines(last)}\n"
        f"Check that {what} and munged are running and reachable (`scontrol ping`"
        f"{', `sacctmgr show cluster`' if what.startswith('slurmdbd') else ''}); "
        "hpctrain recorded nothing from this call.")


def _complete(argv: list[str], input_text: str | None, timeout_s: float, env: dict[str, str] | None,
              own_session: bool, abandon: Callable[[], bool] | None) -> subprocess.CompletedProcess[str]:
    """subprocess.run, or with `abandon` a wait that checks it five times a second (never killing the command:
    an sbatch left alone still queues its job, and its tag finds it)."""
    if abandon is None:
        return subprocess.run(argv, input=input_text, capture_output=True, text=True, timeout=timeout_s, env=env,
                              check=False, start_new_session=own_session)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=own_session)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out, err = proc.communicate(input_text, timeout=0.2)
            return subprocess.CompletedProcess(argv, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            input_text = None  # sent with the first call; a retried communicate() must not send it again
            if abandon():
                raise SubmitUnknown(f"a signal arrived while `{argv[0]}` ran; it was left to finish on its own, "
                                    "so the job may be queued") from None
            if time.monotonic() >= deadline:
                proc.kill()
                proc.communicate()
                raise subprocess.TimeoutExpired(argv, timeout_s) from None


def _last_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) if lines else "(no output)"


# -- sacct ------------------------------------------------------------------------------------
_SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Start", "End")


def sacct_states(job_ids: Iterable[str]) -> dict[str, SacctRecord]:
    """States of many jobs in ONE sacct call. Keys are job ids as given (array tasks as "A_i").

    -X: allocations only (a step's state is not the job's); -D: keep requeued/NODE_FAIL records,
    which sacct otherwise hides behind the newest one. sacct lists only today's jobs unless
    given -j, which we always pass.
    """
    ids = sorted({str(j) for j in job_ids if str(j)})
    if not ids:
        return {}
    # Ask about array *parents*: `-j A_3` returns nothing for an array cancelled before its tasks
    # were split out, while `-j A` returns the split tasks, the pending range, or the whole array.
    parents = sorted({j.split("_", 1)[0] for j in ids})
    argv = ["sacct", "-X", "-D", "--parsable2", "--noheader",
            "-o", ",".join(_SACCT_FIELDS), "-j", ",".join(parents)]
    records = parse_sacct(_run(argv).stdout)
    out: dict[str, SacctRecord] = {}
    for j in ids:
        rec = records.get(j) or records.get(j.split("_", 1)[0])  # unsplit array: its state is every task's
        if rec is not None:
            out[j] = rec if rec.job_id == j else replace(rec, job_id=j)
    return out


def parse_sacct(text: str) -> dict[str, SacctRecord]:
    """Parse `sacct -X -D --parsable2 --noheader -o JobID,State,ExitCode,NodeList,Start,End`."""
    hist: dict[str, list[SacctRun]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        parts += [""] * (len(_SACCT_FIELDS) - len(parts))
        jid, state, exit_code, nodes, start, end = parts[: len(_SACCT_FIELDS)]
        if "." in jid:  # a step (batch, extern, 0): -X should have hidden it already
            continue
        run = SacctRun(state=normalize_state(state), exit_code=exit_code,
                       nodelist="" if nodes in ("None assigned", "(null)") else nodes,
                       start=_parse_time(start), end=_parse_time(end))
        for key in _expand_array_id(jid):
            hist.setdefault(key, []).append(run)
    out: dict[str, SacctRecord] = {}
    for key, runs in hist.items():
        # -D lists older records of a requeued job first; the last one is the job's current state.
        last = runs[-1]
        out[key] = SacctRecord(job_id=key, state=last.state, exit_code=last.exit_code,
                               nodelist=last.nodelist, start=last.start, end=last.end,
                               history=tuple(r.state for r in runs), runs=tuple(runs))
    return out


def _parse_time(text: str) -> float | None:
    text = text.strip()
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()  # sacct prints local time
    except ValueError:
        return None


# An array of more tasks than this is not one hpctrain submitted (a sweep is one task per point, and
# SLURM's own MaxArraySize defaults to 1001); a range beyond it, or a malformed one, stays unexpanded.
MAX_ARRAY_TASKS = 100_000


def _expand_array_id(jid: str) -> list[str]:
    """"12_[0-2,5%4]" (pending array tasks) -> 12_0 12_1 12_2 12_5; anything else unchanged.

    A malformed range ("1-", "-3", "5-2") or one beyond MAX_ARRAY_TASKS is left as the raw id: sacct's
    answer is data, and a strange line must not stop (or hang) the reading of the others.
    """
    m = re.fullmatch(r"(\d+)_\[([0-9,\-]+)(?:%\d+)?\]", jid)
    if not m:
        return [jid]
    main, spans = m.group(1), []
    for part in m.group(2).split(","):
        r = re.fullmatch(r"(\d{1,9})(?:-(\d{1,9}))?", part)
        if not r or int(r.group(2) or r.group(1)) < int(r.group(1)):
            return [jid]
        spans.append((int(r.group(1)), int(r.group(2) or r.group(1))))
    if sum(hi - lo + 1 for lo, hi in spans) > MAX_ARRAY_TASKS:
        return [jid]
    return [f"{main}_{i}" for lo, hi in spans for i in range(lo, hi + 1)]


# -- scancel / sinfo / sbatch ------------------------------------------------------------------
def scancel(job_ids: Iterable[str]) -> None:
    """Cancel jobs (array ids "A" cancel every task; "A.S" one step). scancel is idempotent on finished jobs."""
    ids = sorted({str(j) for j in job_ids if str(j)})
    if ids:
        _run(["scancel", *ids])


# A job id as SLURM prints it, or an array task's "A_i": only such a string reaches a command's arguments.
_JOB_ID = re.compile(r"\d+(?:_\d+)?")


def _is_job_id(job_id: str) -> bool:
    return _JOB_ID.fullmatch(str(job_id)) is not None


def signal_steps(job_id: str, signal_name: str) -> None:
    """`scancel -s SIG JOB`: the signal goes to every process of the job's steps on every node (not to
    the batch shell, which runs the watchdog). Used for stack dumps (hpctrain.runs.stacks)."""
    if not _is_job_id(job_id) or not re.fullmatch(r"[A-Z0-9]+", signal_name):
        raise ValueError(f"signal_steps: job {job_id!r}, signal {signal_name!r}")
    _run(["scancel", "-s", signal_name, str(job_id)], timeout_s=15.0, tries=1)


def queue_reason(job_id: str) -> tuple[str, str]:
    """(state, reason) as squeue shows them now, e.g. ("PENDING", "Resources"); ("", "") once the job left
    the queue. The reason is SLURM's why-it-waits ("None" while running)."""
    out = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r"], timeout_s=15.0).stdout.strip()
    state, _, reason = out.splitlines()[0].partition("|") if out else ("", "", "")
    return state.strip(), reason.strip()


def start_step(argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start one `srun` job step inside the current allocation and return at once (hpctrain.fault.injob
    watches it). Its output goes where srun's --output/--error say, or the batch script's own log."""
    if not argv or argv[0] != "srun":
        raise ValueError(f"start_step runs srun, not {argv[:1]}")
    try:
        return subprocess.Popen(list(argv), env=env)  # argv is ours, no shell
    except FileNotFoundError as exc:
        raise SlurmUnavailable("`srun` is not on PATH inside the job: SLURM's client tools are missing here") from exc


def step_ids(job_id: str) -> list[str]:
    """The job's running steps as squeue lists them ("123.0", "123.1"; not the batch step), oldest first."""
    out = _run(["squeue", "-h", "--steps", "-j", str(job_id), "-o", "%i"], timeout_s=15.0, tries=2).stdout
    ids = [w.strip() for w in out.splitlines() if re.fullmatch(rf"{re.escape(str(job_id))}\.\d+", w.strip())]
    return sorted(ids, key=lambda s: int(s.rsplit(".", 1)[1]))


def slurmd_port() -> int:
    """SlurmdPort of the running configuration (`scontrol show config`); SLURM's default 6818 when unset."""
    out = _run(["scontrol", "show", "config"], timeout_s=15.0).stdout
    m = re.search(r"^SlurmdPort\s*=\s*(\d+)", out, re.MULTILINE)
    return int(m.group(1)) if m else 6818


def queue_state(job_id: str) -> str:
    """The job's state as squeue shows it now ("RUNNING", "COMPLETING", ...); "" once it left the queue."""
    return _run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], timeout_s=15.0).stdout.strip()


def job_end_time(job_id: str) -> float | None:
    """The job's projected end as slurmctld holds it now (squeue's %e, epoch seconds). Unlike the
    SLURM_JOB_END_TIME exported when the job started, it moves with `scontrol update TimeLimit=` (a limit
    extended or cut while the job runs). One try, bounded: a rank asks inside the pre-timeout window. None
    when squeue is missing (a container without SLURM's tools), refused or slow, or the end is unknown."""
    if not _is_job_id(job_id):
        return None
    try:
        out = _run(["squeue", "-h", "-j", str(job_id), "-o", "%e"], timeout_s=10.0, tries=1).stdout
    except click.ClickException:
        return None
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return _parse_time(lines[0]) if len(lines) == 1 else None


def pending_reasons(job_ids: Iterable[str]) -> dict[str, str]:
    """Why SLURM keeps jobs waiting (squeue's %r: "Resources", "Priority", "ReqNodeNotAvail, UnavailableNodes:
    node2", "BeginTime", ...), in ONE squeue call; jobs not pending (or gone) are left out. Keys are the ids
    as given (array tasks "A_i": an unsplit pending range "A_[0-3]" gives its reason to each task)."""
    ids = sorted({str(j) for j in job_ids if str(j)})
    if not ids:
        return {}
    parents = sorted({j.split("_", 1)[0] for j in ids})
    out = _run(["squeue", "-h", "-t", "PENDING", "-j", ",".join(parents), "-o", "%i|%r"], timeout_s=15.0).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        jid, _, reason = line.strip().partition("|")
        if jid and reason and reason != "None":
            for key in _expand_array_id(jid):
                found[key] = reason
    return {j: found.get(j) or found[j.split("_", 1)[0]] for j in ids if j in found or j.split("_", 1)[0] in found}


def jobs_by_comment(comments: Iterable[str], since: float) -> dict[str, tuple[str, str]]:
    """Jobs whose --comment is one of `comments` -> (job id, state): squeue first (every job it still
    lists, finished ones included for MinJobAge), then sacct from `since` on (sacct keeps comments
    only with AccountingStoreFlags=job_comment). Array tasks map to their array's id. Raises
    SlurmUnavailable when squeue cannot answer: "not found" must mean SLURM said so."""
    wanted = set(comments)
    found: dict[str, tuple[str, str]] = {}
    out = _run(["squeue", "-h", "--me", "-t", "all", "-o", "%F|%k|%T"], timeout_s=15.0).stdout
    for line in out.splitlines():
        jid, comment, state = (line.strip().split("|") + ["", ""])[:3]
        if comment in wanted and jid.isdigit():
            found.setdefault(comment, (jid, normalize_state(state)))
    if wanted - set(found):
        start = datetime.fromtimestamp(max(0.0, since - 60)).strftime("%Y-%m-%dT%H:%M:%S")
        try:
            out = _run(["sacct", "-X", "-n", "-P", "-S", start, "-o", "JobID,Comment,State"], timeout_s=15.0).stdout
        except click.ClickException:
            out = ""  # accounting is optional here: squeue has answered
        for line in out.splitlines():
            jid, comment, state = (line.strip().split("|") + ["", ""])[:3]
            main = jid.split("_", 1)[0]
            if comment in wanted and comment not in found and main.isdigit():
                found[comment] = (main, normalize_state(state))
    return found


def allow_requeue(job_id: str) -> bool:
    """`scontrol update JobId=J Requeue=1`: training jobs are submitted --no-requeue (a lost node goes to
    the supervisor), so rank 0 makes its job requeueable right before its own time-limit/preemption
    `scontrol requeue`. One try, no retry loop: it runs inside the pre-timeout signal's grace period.
    False when scontrol is missing (in a container the batch script's hand-off does both) or refused."""
    if not _is_job_id(job_id):
        return False
    try:
        _run(["scontrol", "update", f"JobId={job_id}", "Requeue=1"], timeout_s=15.0, tries=1)
    except click.ClickException:
        return False
    return True


def node_states(nodelist: str) -> dict[str, str]:
    """State of each node of a hostlist as sinfo reports it ("idle", "down*", "drained", "mixed"...).

    Used by the supervisor (hpctrain.fault.supervisor) to name the dead node of a NODE_FAIL.
    """
    out = _run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%T"]).stdout
    states: dict[str, str] = {}
    for line in out.splitlines():
        name, _, state = line.strip().partition("|")
        if name and state:
            states[name] = state
    return states


def partitions() -> list[str]:
    """Partition names as sinfo lists them (default partition without its '*')."""
    out = _run(["sinfo", "-h", "-o", "%P"]).stdout
    return sorted({p.strip().rstrip("*") for p in out.split() if p.strip()})


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    nodes: int  # all nodes, whatever their state: a job bigger than this can never start
    cpus: int  # most CPUs on one node
    mem_mb: int  # most memory on one node (MB)


def partition_info(name: str = "", tries: int | None = None) -> PartitionInfo | None:
    """Size of a partition (the default one when `name` is ""), or None if sinfo does not know it."""
    out = _run(["sinfo", "-h", "-o", "%P|%D|%c|%m"], tries=tries).stdout
    found: dict[str, list[int]] = {}
    default = ""
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        part = parts[0]
        if part.endswith("*"):
            part = default = part[:-1]
        try:
            n, c, m = (int(x.rstrip("+")) for x in parts[1:])
        except ValueError:
            continue
        acc = found.setdefault(part, [0, 0, 0])
        acc[0] += n
        acc[1], acc[2] = max(acc[1], c), max(acc[2], m)
    key = name or default
    if key not in found:
        return None
    n, c, m = found[key]
    return PartitionInfo(key, n, c, m)


def test_only(script_text: str) -> str:
    """`sbatch --test-only` on a script given as text; returns sbatch's verdict, or raises
    SbatchRejected naming the spec field to change."""
    try:
        proc = _run(["sbatch", "--test-only"], input_text=script_text)
    except SlurmCommandError as exc:
        raise rejection(exc.stderr) from exc
    return (proc.stderr or proc.stdout).strip()


def sbatch(script_path: str, extra: Sequence[str] = (), comment: str = "",
           abandon: Callable[[], bool] | None = None) -> str:
    """Submit a script file with `--parsable`; returns sbatch's stdout (parse it with job_id_from_sbatch).

    `comment` goes to `--comment`: what `reconcile` finds the job by when sbatch's answer is lost.
    Only connect failures are retried: after a send/receive timeout slurmctld may already have
    queued the job, and a blind retry would submit it twice. Every outcome that may have queued a
    job raises SubmitUnknown; a refusal raises SbatchRejected. sbatch runs in a session of its own: a Ctrl-C
    at the terminal never kills it half-way (hpctrain.slurm.transaction holds the signal until the job is recorded);
    `abandon()` (a signal held meanwhile) stops the wait, leaving sbatch to queue the job on its own: SubmitUnknown.
    """
    argv = ["sbatch", "--parsable", *([f"--comment={comment}"] if comment else []), *extra, script_path]
    try:
        proc = _run(argv, retryable=_SBATCH_RETRYABLE, timeout_s=_sbatch_timeout(), retry_timeouts=False,
                    own_session=True, abandon=abandon)
    except SlurmCommandError as exc:
        raise _sbatch_failure(exc) from exc
    return proc.stdout.strip()


def _sbatch_timeout() -> float:
    return float(os.environ.get("HPCTRAIN_SBATCH_TIMEOUT_S", "60"))


def _sbatch_failure(exc: SlurmCommandError) -> SubmitUnknown | SbatchRejected:
    """A failed sbatch: killed by a signal (directly, or 128+N through a wrapper) or a daemon that
    stopped answering mid-way may have queued the job; anything else is a refusal."""
    if exc.returncode < 0 or exc.returncode > 128:
        return SubmitUnknown(f"sbatch was killed (exit {exc.returncode}): {_last_lines(exc.stderr)}")
    if _TRANSIENT.search(exc.stderr):
        return SubmitUnknown(f"sbatch lost its connection to slurmctld: {_last_lines(exc.stderr)}")
    return rejection(exc.stderr)


def rejection(stderr: str) -> SbatchRejected:
    """Turn sbatch's stderr into a usage error naming the field to fix."""
    reason = _last_lines(stderr, 1)
    reason = re.sub(r"^sbatch: error: (Batch job submission failed: )?", "", reason)
    low = reason.lower()
    field_name = next((f for key, f in _REJECTIONS if key in low), "resources")
    return SbatchRejected(reason, field_name)


# What sbatch prints: `--parsable` gives "12" or "12;cluster"; a site wrapper may drop the flag
# ("Submitted batch job 12"), print banners first, or report an array as "12_[0-3]".
_PARSABLE_ID = re.compile(r"(\d+)(?:_(?:\d+|\[[0-9,\-%]+\]))?(?:;\S+)?")
_SUBMITTED_ID = re.compile(r"\bSubmitted batch job (\d+)\b", re.IGNORECASE)


def job_id_from_sbatch(stdout: str) -> str:
    """The job id in sbatch's answer (the last line that carries one); SubmitUnknown without one."""
    for line in reversed([ln.strip() for ln in stdout.splitlines() if ln.strip()]):
        m = _PARSABLE_ID.fullmatch(line) or _SUBMITTED_ID.search(line)
        if m:
            return m.group(1)
    raise SubmitUnknown(f"sbatch exited 0 but its answer has no job id: {_last_lines(stdout) }")
