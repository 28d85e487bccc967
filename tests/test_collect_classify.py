"""Failure classification over real-looking logs: one fixture per class, plus torn/interleaved/binary input."""

from __future__ import annotations

import pytest

from hpctrain.collect import classify as cc
from hpctrain.collect.logs import last_timestamp, parse_time
from hpctrain.states import FailureClass as FC

HEAD = ("2026-11-29T10:00:01 rank{r} INFO hpctrain node: mode train, rank {r}/4 (local {r}) via slurm, "
        "master node1:21234\n")

GPU_OOM = HEAD.format(r=1) + """\
2026-11-29T10:00:05 rank1 INFO step 3 | loss 9.8123 | lr 1.00e-04 | tok/s 51234 | pad 0.0%
2026-11-29T10:00:06 rank1 ERROR training failed:
Traceback (most recent call last):
  File "/opt/hpctrain/toolkit/hpctrain/node/launch/main.py", line 48, in run
    engine, state = train.run_training(prep, stop)
  File "/opt/venv/lib/python3.12/site-packages/torch/_tensor.py", line 626, in backward
    torch.autograd.backward(
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.10 GiB \
of which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.88 GiB memory in use.
"""

HOST_OOM_ERR = """srun: error: node3: task 2: Out Of Memory
slurmstepd: error: Detected 1 oom_kill event in StepId=1234.0. Some of the step tasks have been OOM Killed.
"""

NCCL_TIMEOUT = HEAD.format(r=2) + """\
[rank2]:[E1129 10:31:02.123456 12345 ProcessGroupNCCL.cpp:616] [Rank 2] Watchdog caught \
collective operation timeout: WorkNCCL(SeqNum=1042, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran \
for 600031 milliseconds before timing out.
[rank2]:[E1129 10:31:02.223456 12345 ProcessGroupNCCL.cpp:1664] [PG 0 Rank 2] Exception (either an error or timeout) \
detected by watchdog at work: 1042, last enqueued NCCL work: 1042, last completed NCCL work: 1041.
terminate called after throwing an instance of 'c10::DistBackendError'
"""

GLOO_TIMEOUT = HEAD.format(r=0) + """2026-11-29T10:40:00 rank0 ERROR training failed:
Traceback (most recent call last):
  File "/opt/hpctrain/toolkit/hpctrain/node/train.py", line 265, in run_training
    dist.all_reduce(red)
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2806, in all_reduce
    work.wait()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms for recv \
operation to complete
"""

PEER_CLOSED = HEAD.format(r=0) + """2026-11-29T10:00:09 rank0 ERROR training failed:
Traceback (most recent call last):
  File "/opt/hpctrain/toolkit/hpctrain/node/train.py", line 265, in run_training
    dist.all_reduce(red)
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.77.0.2]:21000
"""

USER_EXC = HEAD.format(r=1) + """\
2026-11-29T10:00:07 rank1 INFO step 6 | loss 9.1000 | lr 1.00e-04 | tok/s 812 | pad 0.0%
2026-11-29T10:00:08 rank1 ERROR training failed:
Traceback (most recent call last):
  File "/opt/hpctrain/toolkit/hpctrain/node/launch/main.py", line 48, in run
    engine, state = train.run_training(prep, stop)
  File "/opt/hpctrain/toolkit/hpctrain/node/train.py", line 310, in _fail_hook
    raise ValueError(f"HPCTRAIN_FAIL_AT_STEP: failing on purpose at step {step}")
ValueError: HPCTRAIN_FAIL_AT_STEP: failing on purpose at step 7
"""

APPTAINER = """FATAL:   could not open image /images/train.sif: failed to retrieve path for /images/train.sif: \
lstat /images/train.sif: no such file or directory
srun: error: node2: task 0: Exited with exit code 255
"""
PYXIS = """pyxis: importing docker image: nvcr.io#nvidia/pytorch:24.01-py3
pyxis: child 81231 failed with error code: 1
pyxis: failed to import docker image
slurmstepd: error: pyxis: [ERROR] URL https://nvcr.io/proxy_auth returned error code: 401 Unauthorized
"""
PODMAN = 'Error: short-name "train" did not resolve to an alias and no unqualified-search registries are defined\n'
CHRUN = "ch-run[4412]: error: can't run user command: python: No such file or directory (core.c:1193 2)\n"

PREFLIGHT = """\
hpctrain: preflight failed: pre-flight: 1 of 4 ranks did not join the rendezvous at node1:20008: rank(s) 3; \
expected on host(s) node4 (no rank at all from node4: check that node)
"""


def src(text: str, name: str = "logs/attempt-0.rank-0.log", rank: int | None = 0,
        host: str | None = None) -> cc.LogSource:
    return cc.LogSource(name, text, rank, host)


def test_gpu_oom_names_rank_and_host() -> None:
    f = cc.classify("FAILED", [src(GPU_OOM, "logs/attempt-0.rank-1.log", 1, "node1"),
                               src(PEER_CLOSED, "logs/attempt-0.rank-0.log", 0, "node1")], exit_code="1:0")
    assert f.failure_class == FC.GPU_OOM
    assert (f.rank, f.host, f.source) == (1, "node1", "logs/attempt-0.rank-1.log")
    assert f.exception and f.exception.startswith("torch.OutOfMemoryError: CUDA out of memory")


@pytest.mark.parametrize("state,exit_code,text", [
    ("FAILED", "0:9", HOST_OOM_ERR),
    ("OUT_OF_MEMORY", "0:125", ""),
    ("FAILED", "137:0", "/var/spool/slurmd/job01234/slurm_script: line 52: 81231 Killed   python -u train.py\n"),
    ("FAILED", "0:0",
     "[Mon Nov 29 10:00:01 2026] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE)\n"),
])
def test_host_oom(state: str, exit_code: str, text: str) -> None:
    f = cc.classify(state, [src(text, "submitit/1234_2_log.err", 2, "node3")], exit_code=exit_code)
    assert f.failure_class == FC.HOST_OOM


def test_bare_killed_after_scancel_is_not_oom() -> None:
    f = cc.classify("CANCELLED", [src("slurmstepd: error: *** STEP 12.0 ON node1 CANCELLED AT 2026-11-29T10:00:00 ***\n"
                                      "Killed\n")], exit_code="0:15")
    assert f.failure_class == FC.CANCELLED


@pytest.mark.parametrize("text", [NCCL_TIMEOUT, GLOO_TIMEOUT, PEER_CLOSED])
def test_comm_timeouts(text: str) -> None:
    f = cc.classify("FAILED", [src(text, rank=2, host="node2")], exit_code="1:0")
    assert f.failure_class == FC.COMM_TIMEOUT
    assert f.rank == 2


def test_user_exception_beats_peers_connection_closed() -> None:
    """Rank 1 raised; rank 0 only saw its peer vanish. The root cause is rank 1's exception."""
    f = cc.classify("FAILED", [src(PEER_CLOSED, "logs/attempt-0.rank-0.log", 0, "node1"),
                               src(USER_EXC, "logs/attempt-0.rank-1.log", 1, "node2")], exit_code="1:0")
    assert f.failure_class == FC.PYTHON_EXCEPTION
    assert (f.rank, f.host) == (1, "node2")
    assert f.exception == "ValueError: HPCTRAIN_FAIL_AT_STEP: failing on purpose at step 7"
    assert f.last_lines[-1] == f.exception
    assert any("_fail_hook" in ln for ln in f.last_lines)


@pytest.mark.parametrize("text", [APPTAINER, PYXIS, PODMAN, CHRUN])
def test_container_errors(text: str) -> None:
    f = cc.classify("FAILED", [src(text, "submitit/77_0_log.err", 0, "node2")], exit_code="255:0")
    assert f.failure_class == FC.CONTAINER_ERROR
    assert f.host == "node2"


def test_preflight_names_missing_host() -> None:
    f = cc.classify("FAILED", [src(PREFLIGHT, "submitit/12_0_log.err", 0, "node1")], exit_code="4:0")
    assert f.failure_class == FC.PREFLIGHT
    assert f.host == "node4"
    assert "did not join" in f.message


def test_hang_from_heartbeat() -> None:
    assert cc.is_hang(1000.0, 1000.0 + 3600, 2.0)
    assert not cc.is_hang(1000.0, 1000.0 + 60, 2.0)
    assert not cc.is_hang(None, 5000.0, 2.0)
    f = cc.classify("CANCELLED", [src(HEAD.format(r=0))], hang=True, hang_message="no step for 60 min")
    assert f.failure_class == FC.HANG and "60 min" in f.message


@pytest.mark.parametrize("state,cls", [("COMPLETED", None), ("TIMEOUT", FC.TIME_LIMIT), ("PREEMPTED", FC.PREEMPTED),
                                       ("CANCELLED", FC.CANCELLED), ("OUT_OF_MEMORY", FC.HOST_OOM),
                                       ("NODE_FAIL", FC.NODE_FAIL), ("FAILED", FC.UNKNOWN), ("RUNNING", None)])
def test_slurm_states_stay_distinct(state: str, cls: str | None) -> None:
    assert cc.classify(state, [src(HEAD.format(r=0))]).failure_class == cls


def test_survivors_comm_errors_do_not_hide_node_fail() -> None:
    dead = src("2026-11-29T10:00:01 rank1 INFO step 5 | loss 9.0\n", "logs/attempt-0.rank-1.log", 1, "node2")
    alive = src("2026-11-29T10:00:01 rank0 INFO step 5 | loss 9.0\n2026-11-29T10:10:01 rank0 ERROR x\n" + PEER_CLOSED,
                "logs/attempt-0.rank-0.log", 0, "node1")
    f = cc.classify("NODE_FAIL", [alive, dead])
    assert f.failure_class == FC.NODE_FAIL
    assert f.host == "node2"


def test_timeout_with_signal_stop_is_time_limit() -> None:
    text = HEAD.format(r=0) + ("2026-11-29T10:00:02 rank0 INFO signal 12: "
                               "checkpointed at step 40, stopping for requeue\n")
    assert cc.classify("TIMEOUT", [src(text)]).failure_class == FC.TIME_LIMIT


@pytest.mark.parametrize("signum,state,cls", [(12, "FAILED", FC.TIME_LIMIT), (15, "FAILED", FC.PREEMPTED),
                                              (12, "TIMEOUT", FC.TIME_LIMIT), (15, "PREEMPTED", FC.PREEMPTED)])
def test_stopped_on_signal_after_checkpoint(signum: int, state: str, cls: str) -> None:
    text = HEAD.format(r=0) + (f"2026-11-29T10:00:02 rank0 INFO signal {signum}: "
                               "checkpointed at step 40, stopping for requeue\n")
    f = cc.classify(state, [src(text, host="node1")], exit_code="3:0")
    assert f.failure_class == cls and "resumable" in f.message and f.host == "node1"


def test_submitit_refusing_requeue_is_time_limit() -> None:
    """Rank 0 chained into submitit's USR2 handler, which raised; rank 1 stopped cleanly."""
    r0 = HEAD.format(r=0) + ("2026-11-29T17:03:47 rank0 ERROR training failed:\nTraceback (most recent call last):\n"
                             '  File "/x/job_environment.py", line 227, in checkpoint_and_try_requeue\n'
                             "    raise utils.UncompletedJobError(message)\nsubmitit.core.utils.UncompletedJobError: "
                             "Job not requeued because: timed-out and not checkpointable.\n")
    r1 = HEAD.format(r=1) + "2026-11-29T17:03:47 rank1 INFO signal 12: checkpointed at step 35, stopping for requeue\n"
    f = cc.classify("FAILED", [src(r0, rank=0, host="node1"), src(r1, "logs/attempt-0.rank-1.log", 1, "node2")],
                    exit_code="3:0")
    assert f.failure_class == FC.TIME_LIMIT and "step 35" in f.message
    r0 = r0.replace("timed-out and not checkpointable", "checkpoint function returned None")
    f = cc.classify("FAILED", [src(r0, rank=0, host="node1"), src(r1, "logs/attempt-0.rank-1.log", 1, "node2")],
                    exit_code="9:0")
    assert f.failure_class == FC.TIME_LIMIT


def test_interleaved_traceback_with_binary_junk() -> None:
    """Another rank's lines and NUL/binary bytes inside the traceback; the exception is still found."""
    raw = (b"2026-11-29T10:00:08 rank1 ERROR training failed:\nTraceback (most recent call last):\n"
           b"2026-11-29T10:00:08 rank0 INFO step 7 | loss 9.0\n"
           b'  File "/x/train.py", line 3, in f\n\x00\x00\xff\xfe\x01garbage\n    raise KeyError("tokenizer")\n'
           b"[rank1]: KeyError: 'tokenizer'\n")
    f = cc.classify("FAILED", [src(cc.clean_text(raw), rank=1)], exit_code="1:0")
    assert f.failure_class == FC.PYTHON_EXCEPTION
    assert f.exception == "KeyError: 'tokenizer'"


def test_truncated_traceback() -> None:
    text = HEAD.format(r=0) + 'Traceback (most recent call last):\n  File "/x/train.py", line 3, in f\n    run('
    f = cc.classify("FAILED", [src(text)], exit_code="1:0")
    assert f.failure_class == FC.PYTHON_EXCEPTION
    assert f.exception == "(traceback truncated)"


def test_earliest_exception_wins_and_node_line_comm_errors_are_comm() -> None:
    """Rank 0 failed later because rank 1 vanished; its stderr line names the gloo error."""
    late = (USER_EXC.replace("rank1", "rank0").replace("10:00:08", "10:00:20")
            .replace("ValueError: HPC", "KeyError: HPC"))
    early = USER_EXC.replace("10:00:08", "10:00:05")
    f = cc.classify("FAILED", [src(late, "logs/attempt-0.rank-0.log", 0), src(early, "logs/attempt-0.rank-1.log", 1),
                               src("hpctrain: rank 0 failed: RuntimeError: [pair.cc:553] Connection closed by peer "
                                   "[10.77.0.2]:17603 (traceback in /r/logs)\n", "submitit/10_0_log.err", 0)],
                    exit_code="1:0")
    assert f.failure_class == FC.PYTHON_EXCEPTION and f.rank == 1 and f.exception.startswith("ValueError")


def test_node_stderr_line_without_traceback() -> None:
    f = cc.classify("FAILED", [src("hpctrain: rank 3 failed: RuntimeError: loss is NaN (traceback in /r/logs)\n",
                                   "submitit/9_3_log.err", None, "node2")], exit_code="1:0")
    assert f.failure_class == FC.PYTHON_EXCEPTION
    assert f.rank == 3 and f.exception == "RuntimeError: loss is NaN"


def test_submitit_jobenvironment_gives_rank_and_host() -> None:
    text = ("submitit INFO (2026-11-29 16:52:58,133) - Starting with JobEnvironment(job_id=5_0, hostname=node2, "
            "local_rank=0(1), node=1(4), global_rank=1(4))\n")
    s = cc.identify(cc.LogSource("submitit/5_0_1_log.out", text))
    assert (s.rank, s.host, s.job_id) == (1, "node2", "5_0")


def test_timestamps() -> None:
    a = parse_time("2026-11-29T10:00:01 rank0 INFO x")
    b = parse_time("[2026-11-29 10:00:01,500] [INFO] [engine.py:1] x")
    c = parse_time("submitit INFO (2026-11-29 10:00:02,000) - Job completed successfully")
    assert a is not None and b == a + 0.5 and c == a + 1
    assert parse_time("  File x") is None and parse_time("2026-13-45T99:00:00 bad") is None
    assert last_timestamp("2026-11-29T10:00:01 a\ntrailing\n") == a


def test_garbage_never_raises() -> None:
    for text in ["", "\x00" * 100, "Traceback (most recent call last):", "rank\n" * 3, "é\ud800"]:
        cc.classify("FAILED", [src(text)], exit_code="garbage")
        cc.classify(None, [src(text, rank=None)])


def test_text_since_cuts_appended_runs() -> None:
    from hpctrain.collect.logs import parse_time, text_since

    start = parse_time("2026-11-29T10:00:10 x")
    assert start is not None
    text = ("submitit INFO (2026-11-29 10:00:01,000) - Starting\nold traceback\n"
            "[W1129 10:00:11.5 socket.cpp:1] new\nsubmitit INFO (2026-11-29 10:00:12,000) - done\n")
    assert text_since(text, start).startswith("[W1129 10:00:11")
    assert text_since("no stamps at all\n", start) == "no stamps at all\n"
    assert text_since("submitit INFO (2026-11-29 09:00:00,000) - old\n", start) == ""


def test_lost_host_from_peer_and_silence() -> None:
    peer = "RuntimeError: [pair.cc:553] Connection closed by peer [node4]:30955\n"
    alive = src("2026-11-29T10:00:01 rank0 INFO step 1\n2026-11-29T10:00:01 rank0 ERROR training failed:\n" + peer,
                rank=0, host="node3")
    dead = src("2026-11-29T10:00:01 rank1 INFO step 1\n", "logs/attempt-0.rank-1.log", 1, "node4")
    assert cc.lost_host([alive, dead], resolve=False) == "node4"
    quiet_alive = src("2026-11-29T10:00:01 rank0 ERROR x\n", rank=0, host="node3")
    assert cc.lost_host([quiet_alive, dead], resolve=False) == "node4"  # the only host whose log just stops
    assert cc.lost_host([dead], resolve=False) is None
    f = cc.classify("REQUEUED", [alive, dead])
    assert (f.failure_class, f.host) == (FC.NODE_FAIL, "node4")


def test_peer_lost_before_slurm_noticed() -> None:
    """node4 died; rank 0 got 'connection reset by peer' and srun aborted the step before slurmctld's
    node timeout: state FAILED, but the class is node_fail on node4 (srun names node index 1)."""
    r0 = HEAD.format(r=0) + ("2026-11-29T17:20:20 rank0 ERROR training failed:\nTraceback (most recent call last):\n"
                             "  File \"/x.py\", line 1, in f\nRuntimeError: [pair.cc:537] Read error [node4]:12010: "
                             "Connection reset by peer.\n")
    r1 = HEAD.format(r=1) + "2026-11-29T17:19:52 rank1 INFO step 2 | loss 5.75\n"
    err = ("srun: error: node3: task 0: Exited with exit code 1\nsrun: error: Aborting, io error and missing step on "
           "node 1\nsrun: error: Timed out waiting for job step to complete\n")
    logs = [src(r0, rank=0, host="node3"), src(r1, "logs/attempt-0.rank-1.log", 1, "node4")]
    f = cc.classify("FAILED", [*logs, src(err, "submitit/1651_0_log.err", 0, "node3")], exit_code="1:0",
                    hosts=["node3", "node4"])
    assert (f.failure_class, f.host) == (FC.NODE_FAIL, "node4")
    f = cc.classify("FAILED", logs, exit_code="1:0")  # without srun's line: the silent named peer
    assert (f.failure_class, f.host) == (FC.NODE_FAIL, "node4") and "lost its peer" in f.message


@pytest.mark.parametrize("exc", ["RuntimeError: [pair.cc:537] Read error [node4]:12010: Connection reset by peer",
                                 "BrokenPipeError: [Errno 32] Broken pipe",
                                 "DistBackendError: NCCL error: remote process exited or there was a network error",
                                 "RuntimeError: Connection refused [node2]:29500"])
def test_an_exception_reporting_a_lost_peer_is_one_for_the_watchdog_and_the_classifier(exc: str) -> None:
    """One pattern (classify.PEER_LOST): the hang watchdog's peer-lost verdict and the classifier's class of the
    same exception agree (before, the classifier called a broken pipe a user's Python exception)."""
    from hpctrain.fault.watchdog import lost_peers

    failure = {"rank": 0, "host": "node3", "step": 5, "phase": "reduce", "time": 0.0, "error": exc}
    beats = [{"rank": 0, "host": "node3", "phase": "reduce", "time": -1.0},
             {"rank": 1, "host": "node4", "phase": "compute", "time": -1.0}]  # rank 1 went quiet before
    verdict = lost_peers([failure], beats, world=2, now=100.0, confirm_s=1.0)
    assert verdict is not None and verdict.silent_hosts == ("node4",)
    assert cc._kind_of_exception(exc) == FC.COMM_TIMEOUT
    assert cc._kind_of_exception("ValueError: Broken config") == FC.PYTHON_EXCEPTION


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "accelerate"])
def test_a_per_node_launchers_log_is_classified_by_the_raising_ranks_exception(launcher: str) -> None:
    """A real node log of a per-node launcher (tests/golden/script-failures, ds_loop.py --fail-on-rank 1 on one
    node x 2 ranks): rank 1's ValueError, then rank 0's gloo 'Connection closed by peer' printed after it, then the
    launcher's own error. The failure is rank 1's ValueError (it was '(traceback truncated)', rank 0)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent / "golden" / "script-failures" / f"{launcher}.log").read_text()
    f = cc.classify("FAILED", [src(text, rank=0, host="node2")], exit_code="1:0")
    assert (f.failure_class, f.rank, f.host) == (FC.PYTHON_EXCEPTION, 1, "node2"), f
    assert f.exception == "ValueError: example failure on rank 1 at step 2"
    assert f.last_lines[-1] == f.exception and 'raise ValueError(f"example failure' in "\n".join(f.last_lines)


def test_a_local_jobs_failure_names_the_local_executor_and_its_exit_code() -> None:
    """A local-executor attempt never touched SLURM: its state is the local job's, with the exit code its controller
    recorded (hpctrain.slurm.localctl); a SLURM attempt's words stay as they were."""
    f = cc.classify("FAILED", [src(HEAD.format(r=0))], exit_code="17:0", executor="local")
    assert f.failure_class == FC.UNKNOWN
    assert f.message == "local job state FAILED, exit 17:0; no error found in the logs"
    assert "SLURM" not in f.message
    assert cc.classify("FAILED", [src(HEAD.format(r=0))], exit_code="17:0").message == \
        "SLURM state FAILED, exit 17:0; no error found in the logs"
    assert cc.classify("CANCELLED", [], executor="local").message == "local job state CANCELLED"
    assert cc.classify("FAILED", [], exit_code="2:0", executor="local").message.startswith(
        "local job state FAILED, exit 2:0: the node's exit code for input_error")
    killed = cc.classify("FAILED", [src("Killed\n", "submitit/9_0_log.err")], exit_code="0:9", executor="local")
    assert killed.failure_class == FC.HOST_OOM and "SLURM" not in killed.message


def test_a_crash_injected_by_the_test_hook_says_so() -> None:
    """HPCTRAIN_FAIL_AT_STEP=N: every rank logs the hook's line, then os._exit(17): no traceback, no event."""
    hook = HEAD.format(r=1) + "2026-11-29T10:00:09 rank1 INFO HPCTRAIN_FAIL_AT_STEP=6: exiting hard\n"
    f = cc.classify("FAILED", [src(HEAD.format(r=0)), src(hook, "logs/attempt-0.rank-1.log", 1, "host1")],
                    exit_code="17:0", executor="local")
    assert f.failure_class == FC.UNKNOWN
    assert f.message == ("local job state FAILED, exit 17:0: crash injected by the HPCTRAIN_FAIL_AT_STEP=6 test hook "
                         "(the ranks exited hard after step 6)")
    assert (f.rank, f.host, f.source) == (1, "host1", "logs/attempt-0.rank-1.log")
