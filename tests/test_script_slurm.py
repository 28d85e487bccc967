"""`hpctrain submit --script` on the local SLURM cluster, with real DeepSpeed on the CPU.

The two example scripts (examples/scripts/) each run twice on 2 nodes: once signalled with USR2 after a few
steps (checkpoint through hpctrain.runtime -> submitit requeues the job -> the requeued run resumes) and once
uninterrupted; the losses must be the same at every step. A plain DeepSpeed loop goes through DeepSpeed's
launcher (one task per node, 2 ranks each, `--pass-ds-config`), the HF Trainer with ZeRO-2 through torchrun
(1 rank per node: what 2 would add, a node's second local rank under a per-node launcher, the DeepSpeed pair
proves; its two jobs share 2 nodes instead of taking 4 whole ones). A script raising on
rank 1 is classified from its own traceback and not retried; under accelerate too (its peer's and launcher's errors
printed after it are not the cause), with its frames in `stacks`. All jobs are submitted at once (module fixture),
so they queue together and each test waits only for its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import assert_agrees_with_sacct
from conftest import wait_until as _wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]
SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "scripts"
DATA = str(SCRIPTS / "tiny.txt")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}
STEPS = 10
# Reaches the script through DeepSpeed's launcher on 2 nodes as one argument, exactly (it is in every record).
TAG = "a 'b' \"c\" $(touch /tmp/x) `id` ; é 日本\nnext line"
COMMON = ["--executor", "slurm", "--partition", "debug", "--set", "train.precision=fp32", "--json"]
TWO_NODES = ["--nodes", "2", "--set", "resources.tasks_per_node=2", "--zero", "2"]
TWO_BY_ONE = ["--nodes", "2", "--set", "resources.tasks_per_node=1", "--zero", "2"]
JOBS = {
    "ds": ["--script", str(SCRIPTS / "ds_loop.py"), "--launcher", "deepspeed", "--pass-ds-config", *TWO_NODES,
           "--", "--data", DATA, "--steps", str(STEPS), "--step-sleep", "0.5", "--tag", TAG],
    "hf": ["--script", str(SCRIPTS / "hf_trainer.py"), "--launcher", "torchrun", *TWO_BY_ONE,
           "--", "--data", DATA, "--steps", str(STEPS), "--step-sleep", "0.5"],
    "raise": ["--script", str(SCRIPTS / "ds_loop.py"), "--nodes", "1", "--set", "resources.tasks_per_node=2",
              "--zero", "1", "--", "--data", DATA, "--steps", "5", "--fail-on-rank", "1"],
    # accelerate's launcher: rank 1 raises at step 2, after 30 s on step 1 for `hpctrain stacks` to ask.
    "acc": ["--script", str(SCRIPTS / "ds_loop.py"), "--launcher", "accelerate", "--nodes", "1", "--set",
            "resources.tasks_per_node=2", "--zero", "1", "--", "--data", DATA, "--steps", "5", "--step-sleep", "30",
            "--fail-on-rank", "1"],
}



def wait_until(cond: Callable[[], Any], timeout: float, what: str, poll: float = 2.0) -> Any:
    return _wait_until(cond, timeout, what, poll)


def state(job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True,
                         timeout=30, check=False).stdout
    lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def records(run: Path) -> list[dict[str, Any]]:
    from hpctrain.collect.metrics import read_metrics

    return read_metrics(run / "metrics" / "metrics.jsonl")[0]


def losses(run: Path) -> dict[int, float]:
    """The loss of every step (a step run twice, before and after a resume, keeps its later value)."""
    return {int(r["step"]): float(r["loss"]) for r in records(run)}


def notes(run: Path) -> list[dict[str, Any]]:
    from hpctrain.runs.folder import read_attempts

    return read_attempts(run / "attempts.jsonl")


def hpctrain(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not shutil.which("sbatch"):
        pytest.skip("no SLURM client on PATH (bash tests/cluster/slurm.sh up)")
    base = tmp_path_factory.mktemp("script")
    env = {**os.environ, "HPCTRAIN_RUNS_DIR": str(base / "runs"), "HPCTRAIN_STATE_DIR": str(base / "state"),
           "HPCTRAIN_CONFIG_DIR": str(base / "config")}
    out: dict[str, Any] = {"env": env}
    jobs: list[str] = []
    try:
        for name, flags in [("ds", JOBS["ds"]), ("ds_ref", slower(JOBS["ds"])), ("hf", JOBS["hf"]),
                            ("hf_ref", slower(JOBS["hf"])), ("raise", JOBS["raise"]), ("acc", JOBS["acc"])]:
            cut = flags.index("--")
            proc = hpctrain(env, "submit", "--job-name", name, *flags[:cut], *COMMON, *flags[cut:])
            assert proc.returncode == 0, proc.stderr
            sub = json.loads(proc.stdout)[0]
            jobs.append(str(sub["job_id"]))
            out[name] = (str(sub["job_id"]), Path(sub["run_dir"]))
            if name in ("ds", "hf"):  # watched from now on: the run may start (and end) while a test waits
                out[f"{name}_signal"] = _signaller(*out[name])
            if name.endswith("_ref") or name == "acc":
                out[f"{name}_stacks"] = _stacker(env, out[name][1], 1 if name == "acc" else 2)
        yield out
    finally:
        folders = [v[1] for k, v in out.items() if k in JOBS or k.endswith("_ref")]
        ids = jobs + [str(n["supervisor_job"]) for r in folders for n in notes(r) if n.get("supervisor_job")]
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30, check=False)


def slower(flags: list[str]) -> list[str]:
    """The same run with 1.5 s per step (the losses do not depend on it): `hpctrain stacks` has time to ask."""
    i = flags.index("--step-sleep")
    return [*flags[:i + 1], "1.5", *flags[i + 2:]]


def _stacker(env: dict[str, str], run: Path, steps: int = 2) -> threading.Thread:
    """`hpctrain stacks RUN --json` once the run trained `steps` steps (its JSON in the thread's `result`)."""
    def ask() -> None:
        wait_until(lambda: len(records(run)) >= steps, 900, f"{run.name}: {steps} training steps", poll=0.5)
        before = len(records(run))  # the steps when asked: at load the answer can come after the last step
        proc = hpctrain(env, "stacks", run.name, "--json", "--timeout", "60")
        thread.result = (before, proc.returncode, proc.stdout, proc.stderr)  # type: ignore[attr-defined]

    thread = threading.Thread(target=ask, name=f"stacks-{run.name}", daemon=True)
    thread.start()
    return thread


def _stacks_are_the_scripts(runs: dict[str, Any], name: str, script: str, world: int) -> None:
    """Under a per-node launcher (torchrun, DeepSpeed's), every rank's own process answered with the script's
    frames, each in its own file with its own host: not the node entry that wraps the launcher (which dumped as
    ranks 0-1 and called ranks 2-3 missing)."""
    thread = runs[f"{name}_stacks"]
    thread.join(timeout=900)
    steps, code, out, err = thread.result
    assert code == 0 and steps < STEPS, (steps, code, err)  # asked while the script trained
    rep = json.loads(out)
    assert rep["missing"] == [] and rep["dumped"] == list(range(world)), rep
    frames = [f for g in rep["groups"] for t in g["threads"] for f in t["frames"]]
    assert any(script in f for f in frames) and not any("hpctrain/node/" in f for f in frames), frames
    hosts = {h for g in rep["groups"] for h in g["hosts"]}
    assert len(hosts) == 2, rep  # 2 nodes


def _trackers_written_live(run: Path) -> None:
    """TensorBoard got every reported step while the script ran (no `hpctrain sync`): attempt 0's file holds the
    steps before the signal, attempt 1's the rest."""
    from hpctrain.collect.sync import tensorboard_last_steps

    tb = run / "metrics" / "tensorboard"
    assert tensorboard_last_steps(str(tb))["train/loss"] == STEPS
    last = [tensorboard_last_steps(str(p)).get("train/loss", 0) for k in (0, 1)
            for p in tb.iterdir() if p.name.endswith(f".hpctrain-script.attempt-{k}")]
    assert len(last) == 2 and 3 <= last[0] < STEPS and last[1] == STEPS, last


def _signaller(job: str, run: Path) -> threading.Thread:
    """USR2 to the job's steps once its metrics show 3 steps (scancel --signal, as the time limit would)."""
    def send() -> None:
        wait_until(lambda: len(records(run)) >= 3, 900, f"{run.name}: 3 training steps", poll=0.5)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)

    thread = threading.Thread(target=send, name=f"usr2-{job}", daemon=True)
    thread.start()
    return thread


def _signal_requeue_resume(runs: dict[str, Any], name: str) -> Path:
    """USR2 after 3 steps: the run stops after a checkpoint, is requeued and resumes to the end with the
    uninterrupted run's losses at every step."""
    job, run = runs[name]
    runs[f"{name}_signal"].join(timeout=900)
    assert not runs[f"{name}_signal"].is_alive(), f"{name}: no USR2 sent"
    wait_until(lambda: state(job) in FINAL, 600, f"job {job} ({name}) to end")
    assert state(job) == "COMPLETED", (run / "submitit").as_posix()
    from hpctrain.runs.events import read_events

    stop = next(e for e in read_events(run) if e.kind == "stop")
    # USR2 long before the job's time limit: a preemption by hpctrain.states.stop_class (the time limit's own
    # signal comes within signal_seconds of the end; tests/test_newcomer.py covers that side)
    assert stop.failure_class == "preempted" and stop.extra.get("checkpointed") is True, stop
    starts = [e for e in read_events(run) if e.kind == "start"]
    assert [e.attempt for e in starts if e.rank == 0] == [0, 1]  # the requeued run: SLURM_RESTART_COUNT=1
    steps = [r["step"] for r in records(run)]
    assert steps.count(1) == 1 and steps[-1] == STEPS  # resumed from the checkpoint, not from scratch
    ref_job, ref = runs[f"{name}_ref"]
    wait_until(lambda: state(ref_job) in FINAL, 600, f"reference job {ref_job} to end")
    assert state(ref_job) == "COMPLETED"
    got, want = losses(run), losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert got == pytest.approx(want, rel=1e-6), (got, want)
    return run


def _summary(runs: dict[str, Any], run: Path) -> dict[str, Any]:
    """`hpctrain summary RUN --json` once every attempt row is final (seen once: a requeued run's last row still
    PENDING right after sacct said COMPLETED)."""
    def final() -> dict[str, Any] | None:
        proc = hpctrain(runs["env"], "summary", str(run), "--json")
        assert proc.returncode == 0, proc.stderr
        doc = dict(json.loads(proc.stdout)["runs"][0])
        return doc if all(a["state"] in FINAL | {"REQUEUED"} for a in doc["attempts"]) else None

    return dict(wait_until(final, 120, f"{run.name}: every summary row final"))


def test_deepspeed_loop_signal_requeue_resume_and_summary(runs: dict[str, Any]) -> None:
    run = _signal_requeue_resume(runs, "ds")
    assert "deepspeed.launcher.runner" in (run / "logs" / "attempt-0.rank-0.log").read_text()
    assert {r.get("tag") for r in records(run)} == {TAG}
    summary = _summary(runs, run)
    last = summary["attempts"][-1]
    assert last["last_step"] == STEPS and last["last_loss"] == pytest.approx(losses(run)[STEPS])
    assert summary["attempts"][0]["failure_class"] == "preempted"
    assert_agrees_with_sacct(summary["attempts"])  # the requeue is one more row, as sacct -D counts it
    _trackers_written_live(run)
    _stacks_are_the_scripts(runs, "ds_ref", "ds_loop.py", world=4)


def test_hf_trainer_zero2_signal_requeue_resume_and_summary(runs: dict[str, Any]) -> None:
    run = _signal_requeue_resume(runs, "hf")
    cfg = json.loads((run / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["stage"] == 2
    assert any(p.name.startswith("checkpoint-") for p in (run / "checkpoints").iterdir())  # the Trainer's own saves
    summary = _summary(runs, run)
    assert summary["attempts"][-1]["last_step"] == STEPS and summary["attempts"][-1]["last_loss"] is not None
    assert_agrees_with_sacct(summary["attempts"])
    _trackers_written_live(run)
    _stacks_are_the_scripts(runs, "hf_ref", "hf_trainer.py", world=2)


def test_a_script_raising_on_rank_1_is_classified_and_not_retried(runs: dict[str, Any]) -> None:
    _, run = runs["raise"]
    wait_until(lambda: any("decision" in n for n in notes(run)), 600, "the supervisor's decision")
    d = next(n for n in notes(run) if "decision" in n)["decision"]
    assert d["action"] == "stop" and d["failure_class"] == "python_exception", d
    assert "example failure on rank 1" in d["reason"] and "not retried" in d["reason"]
    assert [n["attempt"] for n in notes(run) if n.get("state") == "PENDING"] == [0]  # no second attempt
    summary = _summary(runs, run)
    row = summary["attempts"][0]
    assert row["failure_class"] == "python_exception" and row["failure"]["rank"] == 1
    assert "ValueError: example failure on rank 1" in row["failure"]["exception"]
    assert_agrees_with_sacct(summary["attempts"])


def test_accelerate_output_failure_and_stacks_are_the_scripts(runs: dict[str, Any]) -> None:
    """Under accelerate (2 ranks on one CPU node: its --multi_gpu launcher, ACCELERATE_USE_CPU): `stacks` during
    step 1 dumps both ranks with the script's frames; rank 1's ValueError is the failure (rank 0's gloo error and
    accelerate's CalledProcessError printed after it are not), and `logs` shows the script's own output."""
    job, run = runs["acc"]
    thread = runs["acc_stacks"]
    thread.join(timeout=900)
    steps, code, out, err = thread.result
    assert code == 0 and steps < 5, (steps, code, err)
    rep = json.loads(out)
    assert rep["missing"] == [] and rep["dumped"] == [0, 1], rep
    frames = [f for g in rep["groups"] for t in g["threads"] for f in t["frames"]]
    assert any("ds_loop.py" in f for f in frames) and not any("hpctrain/node/" in f for f in frames), frames
    wait_until(lambda: state(job) in FINAL, 600, f"job {job} (acc) to end")
    row = _summary(runs, run)["attempts"][0]
    assert (row["failure_class"], row["failure"]["rank"]) == ("python_exception", 1), row["failure"]
    assert row["failure"]["exception"] == "ValueError: example failure on rank 1 at step 2", row["failure"]
    logs = hpctrain(runs["env"], "logs", str(run), "--grep", "example failure|accelerate.commands.launch").stdout
    assert "accelerate.commands.launch" in logs and "[rank1]: ValueError: example failure on rank 1" in logs, logs
    assert_agrees_with_sacct([row])
