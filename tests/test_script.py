"""`submit --script/--module`: the spec, the launch line (hostile arguments), the dry run, the plan of an
unknown model, the node entry running a user's program, and hpctrain.runtime (no torch, no cluster)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomllib
from click.testing import CliRunner

from hpctrain.cli.main import cli
from hpctrain.errors import HpcUsageError
from hpctrain.spec import launch as L
from hpctrain.spec.model import Launch

HOSTILE = ["a b", "it's", 'say "hi"', "$(touch /tmp/pwned)", "`id`", "x\ny", "tab\there", "é ü 日本", "--flag=1",
           "", "semi;colon", "back\\slash", "*", "~", "-", "--"]
WHERE = L.Where(python="/py", ds_config="/run dir/ds_config.json", hostfile="/run dir/hostfile", nnodes="2",
                ranks_per_node="4", node_rank="1", master_addr="node1", master_port="20001")


pytestmark = pytest.mark.usefixtures("isolated_home")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# -- the command line ----------------------------------------------------------------------------------

@pytest.mark.parametrize("launcher", ["srun", "torchrun", "deepspeed", "accelerate"])
def test_every_launcher_passes_the_arguments_exactly_at_the_end(launcher: str) -> None:
    argv = L.script_command(Launch(launcher=launcher, script="/s/train.py", args=tuple(HOSTILE)), WHERE)  # type: ignore[arg-type]
    assert argv[0] == "/py" and argv[-len(HOSTILE):] == HOSTILE
    assert argv[-len(HOSTILE) - 1] == "/s/train.py"
    with_ds = L.script_command(Launch(launcher=launcher, script="/s/t.py", args=("x",), pass_ds_config=True), WHERE)  # type: ignore[arg-type]
    assert with_ds[-3:] == ["x", "--deepspeed_config", "/run dir/ds_config.json"]


def test_launcher_lines_carry_the_allocation() -> None:
    torchrun = L.script_command(Launch(launcher="torchrun", module="pkg.train"), WHERE)
    assert torchrun == ["/py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4", "--node-rank=1",
                        "--master-addr=node1", "--master-port=20001", "--module", "pkg.train"]
    ds = L.script_command(Launch(launcher="deepspeed", script="/s/t.py"), WHERE)
    assert ds[:4] == ["/py", "-u", "-m", "deepspeed.launcher.runner"] and "--no_ssh" in ds
    assert ds[ds.index("--hostfile") + 1] == "/run dir/hostfile" and ds[ds.index("--node_rank") + 1] == "1"
    acc = L.script_command(Launch(launcher="accelerate", script="/s/t.py"), WHERE)
    assert acc[acc.index("--num_processes") + 1] == "8" and "--multi_gpu" in acc and "--cpu" not in acc
    assert L.script_command(Launch(module="pkg.train", args=("-v",)), WHERE) == ["/py", "-u", "-m", "pkg.train", "-v"]


def test_shell_line_reads_back_as_the_same_words_in_bash() -> None:
    """What the dry run shows is one line that bash turns into exactly the argv (newlines as $'...')."""
    argv = ["printf", "%s\\0", *HOSTILE]
    line = L.shell_line(argv)
    assert "\n" not in line
    out = subprocess.run(["bash", "-c", line], capture_output=True, timeout=30, check=True).stdout
    assert out.decode().split("\0")[:-1] == HOSTILE


# -- the spec ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("launch, field", [
    ({"launcher": "torchrun"}, "launch.launcher"),
    ({"script": "/a.py", "module": "m"}, "launch.script"),
    ({"args": ("x",)}, "launch.args"),
    ({"pass_ds_config": True}, "launch.pass_ds_config"),
    ({"module": "not-a-module"}, "launch.module"),
    ({"script": "-rf"}, "launch.script"),
    ({"script": "/a.py", "args": ("nul\x00",)}, "launch.args"),
])
def test_script_rules_refuse_with_the_field(launch: dict[str, Any], field: str) -> None:
    with pytest.raises(HpcUsageError, match=field.replace(".", r"\.")):
        Launch(**launch)


def test_newlines_and_quotes_are_allowed_in_arguments_only() -> None:
    Launch(script="/a.py", args=("x\ny", "'", "$(id)"))
    with pytest.raises(HpcUsageError, match="launch.script"):
        Launch(script="/a\nb.py")


def _dry(tmp_path: Path, *args: str) -> dict[str, Any]:
    script = tmp_path / "my train.py"
    script.write_text("print('hi')\n")
    res = invoke("submit", "--script", str(script), "--zero", "2", "--nodes", "2",
                 "--set", "resources.tasks_per_node=2", "--dry-run", "--json", *args)
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.output))


def test_dry_run_shows_the_program_and_keeps_the_arguments(tmp_path: Path) -> None:
    out = _dry(tmp_path, "--launcher", "deepspeed", "--pass-ds-config", "--", *HOSTILE)
    sbatch = out["sbatch"]
    line = next(ln for ln in sbatch.splitlines() if "deepspeed.launcher.runner" in ln)
    assert line.startswith("#   ") and str(tmp_path / "my train.py").replace(" ", "' '") not in line
    assert L.shell_line(list(HOSTILE)) in line
    assert line.endswith('--deepspeed_config "$HPCTRAIN_RUN_DIR/ds_config.json"')
    assert "--ntasks-per-node=1" in sbatch and "#SBATCH --ntasks-per-node=1" in sbatch
    assert "#SBATCH --cpus-per-task=2" in sbatch  # the node's task holds both ranks' cores
    assert "--after-first-beat" in sbatch and "submitit.core._submit" in sbatch.splitlines()[-1]
    assert out["plans"][0]["memory"]["known"] is False and out["plans"][0]["param_count"] == 0


def test_written_run_folder_holds_the_exact_arguments(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    res = invoke("submit", "--script", str(script), "--zero", "1", "--dry-run", "--out", str(tmp_path / "o"),
                 "--", *HOSTILE)
    assert res.exit_code == 0, res.output
    spec = tomllib.loads((tmp_path / "o" / "spec.toml").read_text())
    assert spec["launch"]["args"] == HOSTILE and spec["launch"]["script"] == str(script)
    from hpctrain.runs.folder import RunFolder
    from hpctrain.spec.model import from_toml_text

    assert list(from_toml_text((tmp_path / "o" / "spec.toml").read_text()).launch.args) == HOSTILE
    assert RunFolder(tmp_path / "o").sbatch_sh.is_file()
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if shellcheck.exists():
        proc = subprocess.run([str(shellcheck), "-S", "warning", str(tmp_path / "o" / "sbatch.sh")],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout


def test_run_file_launch_table_and_flags(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    run = tmp_path / "run.toml"
    run.write_text(f'[launch]\nscript = "{script}"\nargs = ["--lr", "3e-4"]\nlauncher = "torchrun"\n'
                   '[parallel]\nzero = 2\n')
    out = invoke("submit", str(run), "--dry-run")
    assert "torch.distributed.run" in out.output and "--lr 3e-4" in out.output
    replaced = invoke("submit", str(run), "--dry-run", "--", "--lr", "1")  # `--` replaces the file's arguments
    assert "--lr 1\n" in replaced.output


def test_missing_script_and_zero_auto_are_refused(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["submit", "--script", str(tmp_path / "nope.py"), "--zero", "2", "--dry-run"])
    assert res.exit_code == 2 and "launch.script" in res.output and "not a file" in res.output
    (tmp_path / "t.py").write_text("")
    res = CliRunner().invoke(cli, ["submit", "--script", str(tmp_path / "t.py"), "--zero", "auto", "--dry-run"])
    assert res.exit_code == 2 and "parallel.zero" in res.output and "unknown" in res.output


def test_plan_says_what_is_and_is_not_known(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    out = invoke("plan", "--script", str(tmp_path / "t.py"), "--zero", "2").output
    assert "unknown (your script builds it)" in out and "no memory estimate" in out
    described = invoke("plan", "--script", str(tmp_path / "t.py"), "--zero", "2", "--model", "llama-tiny").output
    assert "as described" in described and "per rank" in described  # with a model, the estimate is made


# -- the node entry running a program (a plain python script: no torch) ----------------------------------

PROBE = """
import json, os, sys, time
from pathlib import Path
env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                       "MASTER_PORT", "HPCTRAIN_RUN_DIR", "HPCTRAIN_DS_CONFIG")}
Path(os.environ["OUT"]).write_text(json.dumps({"argv": sys.argv[1:], "env": env}))
print("probe says hello", flush=True)
if sys.argv[1:2] == ["raise"]:
    raise KeyError("boom on purpose")
if sys.argv[1:2] == ["wait"]:
    from hpctrain import runtime
    Path(os.environ["OUT"] + ".ready").write_text("")
    for step in range(1, 600):
        runtime.report(step=step, loss=1.0 / step)
        if runtime.should_stop():
            ck = runtime.checkpoint_dir() / f"step-{step}"
            ck.mkdir()
            (ck / "state.bin").write_bytes(b"x" * 10)
            runtime.mark_checkpoint(step)
            sys.exit(0)
        time.sleep(0.05)
"""


def _node_run(tmp_path: Path, *args: str) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "run"
    res = invoke("submit", "--script", str(script), "--zero", "0", "--set", "launch.preflight_timeout_s=5",
                 "--dry-run", "--out", str(out), "--", *args)
    assert res.exit_code == 0, res.output
    return out


def _start(run: Path, tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999", "OUT": str(tmp_path / "probe.json"), "SLURM_JOB_ID": "77",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "toolkit")}
    env.pop("SLURM_RESTART_COUNT", None)
    return subprocess.Popen([sys.executable, "-m", "hpctrain.node", str(run)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]


def test_node_entry_runs_the_program_with_exact_arguments_and_variables(tmp_path: Path) -> None:
    run = _node_run(tmp_path, *HOSTILE)
    proc = _start(run, tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert seen["argv"] == HOSTILE
    assert seen["env"] == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "HPCTRAIN_RUN_DIR": str(run),
                           "HPCTRAIN_DS_CONFIG": str(run / "ds_config.effective.json")}
    # The program runs in its own directory: its config names the trackers' folders inside the run folder
    # (the rendered one says "metrics", relative to the run folder, where hpctrain's trainer runs).
    rendered = json.loads((run / "ds_config.json").read_text())
    given = json.loads((run / "ds_config.effective.json").read_text())
    assert rendered["tensorboard"]["output_path"] == "metrics"
    assert given["tensorboard"]["output_path"] == str(run / "metrics")
    assert {k: v for k, v in given.items() if k != "tensorboard"} == \
        {k: v for k, v in rendered.items() if k != "tensorboard"}


def test_a_raising_program_is_a_python_exception_with_its_own_words(tmp_path: Path) -> None:
    run = _node_run(tmp_path, "raise")
    proc = _start(run, tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "KeyError: 'boom on purpose'" in err  # the program's stderr passes through
    # ... and both streams are in the rank's own log, stamped and tagged, where `hpctrain logs` shows them
    (log,) = (run / "logs").glob("attempt-0.rank-0.log")
    text = log.read_text()
    assert re.search(r"^\S+T\S+ rank0 STDOUT probe says hello$", text, re.MULTILINE), text
    assert re.search(r"^\S+T\S+ rank0 STDERR KeyError: 'boom on purpose'$", text, re.MULTILINE), text
    fail = next(e for e in _events(run) if e["kind"] == "failure")
    assert fail["class"] == "python_exception" and fail["exception"] == "KeyError: 'boom on purpose'"
    assert any("Traceback" in line for line in fail["traceback"])
    from hpctrain.collect.classify import classify
    from hpctrain.runs.events import read_events

    verdict = classify("FAILED", [], exit_code="1:0", events=read_events(run))
    assert verdict.failure_class == "python_exception" and "boom on purpose" in verdict.message
    from hpctrain.states import is_retryable

    assert not is_retryable(verdict.failure_class)


def test_usr2_stops_the_program_after_its_checkpoint(tmp_path: Path) -> None:
    """The signal to the node entry reaches the program (forwarded, and through stop-request.json); the program
    checkpoints through hpctrain.runtime and ends; the node entry exits 3 with a stop event."""
    run = _node_run(tmp_path, "wait")
    proc = _start(run, tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "probe.json.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.1)
    _stacks_are_the_programs(run, proc)
    from hpctrain.collect.sync import tensorboard_last_steps

    tb = run / "metrics" / "tensorboard"  # written while the program runs, from its report()s (no `hpctrain sync`)
    while (tensorboard_last_steps(str(tb)).get("train/loss", 0) if tb.is_dir() else 0) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    last = max(json.loads(x)["step"] for x in (run / "metrics" / "metrics.jsonl").read_text().splitlines())
    written = tensorboard_last_steps(str(tb))
    assert written["train/loss"] == written["run/attempt"] == last, (written, last)  # the last report too
    assert [p.name.endswith(".hpctrain-script.attempt-0") for p in tb.iterdir()] == [True]
    stop = next(e for e in _events(run) if e["kind"] == "stop")
    # USR2 long before the job's time limit: a preemption, not the pre-timeout signal (states.stop_class)
    assert stop["class"] == "preempted" and stop["checkpointed"] is True and "checkpoint of step" in stop["message"]
    assert json.loads((run / "stop-request.json").read_text())["job"] == "77"
    from hpctrain.runs.checkpoints import complete_steps

    assert complete_steps(run / "checkpoints") and (run / "metrics" / "metrics.jsonl").is_file()


def _stacks_are_the_programs(run: Path, wrapper: subprocess.Popen[str]) -> None:
    """SIGURG to every process, as `scancel -s URG` sends it to the step: the program's rank process dumps its own
    frames into the rank's file (a pid of its own); the node entry, its wrapper, neither dumps nor dies of it."""
    from hpctrain.collect.stacks import local_sender, request
    from hpctrain.collect.stragglers import newest_job_beats
    from hpctrain.runs.beats import read_beats

    # The signal goes to the pids the beats name: wait until the program's rank has beaten with its own pid
    # (on a busy machine its first beat comes well after probe.json.ready; a signal before it reaches nobody).
    deadline = time.monotonic() + 120
    while not any(b.get("rank") == 0 and int(b.get("pid", 0)) not in (0, wrapper.pid)
                  for b in newest_job_beats(read_beats(run))):
        assert wrapper.poll() is None and time.monotonic() < deadline, "the program's rank never beat"
        time.sleep(0.1)
    beats = local_sender(run)

    def send() -> None:
        wrapper.send_signal(signal.SIGURG)
        beats()

    rep = request(run, send, [0], timeout_s=60)
    assert rep.missing == [] and [d.rank for d in rep.dumps] == [0], rep.to_dict()
    (dump,) = rep.dumps
    assert dump.pid != wrapper.pid and dump.path.name == "attempt-0.rank-0.txt"
    frames = [f for t in dump.threads for f in t.frames]
    assert any("probe.py" in f for f in frames) and not any("hpctrain/node" in f for f in frames), frames
    assert wrapper.poll() is None
    head = (run / "stacks" / "attempt-0.rank-0.txt").read_text().splitlines()
    assert sum(line.startswith("# hpctrain stacks ") for line in head) == 1  # the program's header only


def test_failure_tail_finds_the_last_exception() -> None:
    from hpctrain.node.launch.script import failure

    tail = ["noise", "Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
            "[rank1]: RuntimeError: Connection closed by peer [10.0.0.2]:123", "more noise"]
    f = failure(1, tail)
    assert f.exception == "RuntimeError: Connection closed by peer [10.0.0.2]:123" and f.tail[0].startswith("Traceback")
    killed = failure(-9, ["Killed"])
    assert "killed by signal SIGKILL" in str(killed) and killed.exception == ""


def test_under_torchrun_the_failure_is_the_scripts_exception_not_the_launchers() -> None:
    """torchrun prints its own ChildFailedError after the rank's traceback: the rank's ValueError is the cause."""
    from hpctrain.node.launch.script import failure

    tail = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "train.py", line 9, in <module>',
            '[rank1]:     raise ValueError("bad batch")', "[rank1]: ValueError: bad batch",
            "E1203 08:00:00.000 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1)",
            "Traceback (most recent call last):", '  File "/usr/bin/torchrun", line 8, in <module>',
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "train.py FAILED",
            "Root Cause (first observed failure):", "  exitcode  : 1 (pid: 42)"]
    f = failure(1, tail)
    assert f.exception == "ValueError: bad batch" and f.tail[0].endswith("Traceback (most recent call last):"), f
    only = failure(1, tail[5:])  # the rank's traceback scrolled out of the tail: the launcher's is all there is
    assert only.exception.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")


# -- hpctrain.runtime ----------------------------------------------------------------------------------

@pytest.fixture
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from hpctrain import runtime

    monkeypatch.setenv("HPCTRAIN_RUN_DIR", str(tmp_path / "r"))
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setattr(runtime, "_signal_seen", 0)
    return runtime


def test_runtime_report_writes_what_the_collector_and_watchdog_read(rt: Any, tmp_path: Path) -> None:
    rt.report(step=3, loss=2.5, lr=1e-3, tokens_per_s=100)
    from hpctrain.collect.metrics import read_metrics
    from hpctrain.runs.beats import read_beats

    recs, bad = read_metrics(tmp_path / "r" / "metrics" / "metrics.jsonl")
    assert bad == 0 and recs[0]["step"] == 3 and recs[0]["loss"] == 2.5
    beat = read_beats(tmp_path / "r", "55", "0")[0]
    assert beat["rank"] == 0 and beat["step"] == 4 and beat["phase"] == "compute"
    assert json.loads((tmp_path / "r" / "metrics" / "heartbeat").read_text())["step"] == 3


def test_runtime_checkpoints_count_by_the_shared_rule(rt: Any, tmp_path: Path) -> None:
    from hpctrain.runs.checkpoints import complete_steps

    assert rt.resume_from() is None and rt.resume_step() == 0
    for step in (2, 4):
        d = rt.checkpoint_dir() / f"step-{step}"
        d.mkdir()
        (d / "w.bin").write_bytes(b"1" * step)
        rt.mark_checkpoint(step)
    half = rt.checkpoint_dir() / "step-6"
    half.mkdir()  # saved but never marked: does not count
    assert complete_steps(tmp_path / "r" / "checkpoints") == [2, 4]
    assert rt.resume_from() == rt.checkpoint_dir() / "step-4" and rt.resume_step() == 4
    (rt.checkpoint_dir() / "step-4" / "w.bin").write_bytes(b"")  # torn: the manifest says 4 bytes
    assert rt.resume_step() == 2
    elsewhere = tmp_path / "hf" / "checkpoint-8"
    elsewhere.mkdir(parents=True)
    (elsewhere / "model.safetensors").write_bytes(b"abc")
    rt.mark_checkpoint(8, elsewhere)
    assert rt.resume_from() == elsewhere and rt.resume_step() == 8
    with pytest.raises(FileNotFoundError):
        rt.mark_checkpoint(9)


def test_runtime_should_stop_on_signal_or_request_of_this_run_only(rt: Any, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert rt.should_stop() is False
    req = tmp_path / "r" / "stop-request.json"
    req.parent.mkdir(parents=True, exist_ok=True)
    req.write_text(json.dumps({"job": "55", "restart": "1", "signal": 12}))  # an earlier run of the job
    assert rt.should_stop() is False
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert rt.should_stop() is True
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert rt.should_stop() is False
    os.kill(os.getpid(), signal.SIGUSR2)  # the handler installed at import only notes it
    assert rt.should_stop() is True


def test_runtime_imports_no_torch() -> None:
    code = "import sys, hpctrain.runtime; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_hf_training_args_follow_the_rendered_config() -> None:
    pytest.importorskip("transformers")
    from hpctrain.runtime.hf import training_args_from_ds_config

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "optimizer": {"params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                              "weight_decay": 0.1}}}
    assert training_args_from_ds_config(cfg) == {
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "bf16": True, "fp16": False,
        "max_grad_norm": 1.0, "learning_rate": 1e-3, "weight_decay": 0.1, "adam_epsilon": 1e-8,
        "adam_beta1": 0.9, "adam_beta2": 0.95}


def test_watchdog_waits_for_a_first_beat_of_a_script(tmp_path: Path) -> None:
    from hpctrain.fault.watchdog import Watchdog

    dog = Watchdog(tmp_path, "1", timeout_s=10, world=2, grace_s=10, after_first_beat=True,
                   started=0.0, last_change=0.0)
    assert dog.check(now=1e6) is None  # never beat: a script that does not report, not a hang
    plain = Watchdog(tmp_path, "1", timeout_s=10, world=2, grace_s=10, started=0.0, last_change=0.0)
    assert plain.check(now=1e6) is not None


FAILURES = Path(__file__).resolve().parent / "golden" / "script-failures"


def _stderr_tail(name: str) -> list[str]:
    """What the node's entry kept of the program's stderr (its tail, before the rank log's stamp), from a real
    run's rank log (tests/golden/script-failures: ds_loop.py --fail-on-rank 1, 1 node x 2 ranks, 2026-12-03)."""
    mark = " rank0 STDERR "
    return [ln.split(mark, 1)[1] for ln in (FAILURES / f"{name}.log").read_text().splitlines() if mark in ln]


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "accelerate"])
def test_under_every_launcher_the_failure_is_the_raising_ranks_own_exception(launcher: str) -> None:
    """Rank 1 raised; rank 0's collective then failed on the closed connection and printed its RuntimeError after
    it, and the launcher its own error last: the failure is rank 1's ValueError (it was rank 0's gloo error under
    DeepSpeed's launcher and torchrun), with its own traceback."""
    from hpctrain.node.launch.script import failure

    f = failure(1, _stderr_tail(launcher))
    assert f.exception == "ValueError: example failure on rank 1 at step 2", f.exception
    assert f.rank == 1 and f.tail[0].endswith("Traceback (most recent call last):"), (f.rank, f.tail)
    assert f.tail[-1].endswith(f.exception) and not any("Connection closed by peer" in ln for ln in f.tail)


def test_a_chained_exception_is_the_last_of_its_chain_and_a_peer_error_alone_is_the_cause() -> None:
    from hpctrain.node.launch.script import failure

    chain = ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>', "KeyError: 'x'", "",
             "The above exception was the direct cause of the following exception:", "",
             "Traceback (most recent call last):", '  File "t.py", line 5, in <module>', "ValueError: no x"]
    assert failure(1, chain).exception == "ValueError: no x"
    peer = _stderr_tail("deepspeed")
    only_peer = [ln for ln in peer if not ln.startswith("[rank1]")]  # the raising rank's output lost
    assert "Connection closed by peer" in failure(1, only_peer).exception


@pytest.mark.parametrize("launcher", ["srun", "torchrun", "deepspeed", "accelerate"])
def test_the_programs_rank_variables_are_the_launchers_to_set_under_a_per_node_launcher(
        launcher: str, tmp_path: Path) -> None:
    """Under a per-node launcher the node entry's child (the launcher) gets no RANK: the launcher sets each rank's,
    and the stack dumps register in the ranks, not in the launcher (a RANK left there made DeepSpeed's runner dump as
    rank 0/1 and ranks 2-3 go missing). accelerate on CPU ranks gets ACCELERATE_USE_CPU."""
    from hpctrain.node.dist import DistEnv
    from hpctrain.node.launch.script import child_env
    from hpctrain.runs.folder import RunFolder
    from hpctrain.spec.model import resolve

    (tmp_path / "t.py").write_text("pass\n")
    (tmp_path / "ds_config.json").write_text("{}\n")
    spec = resolve(None, {"launch.script": str(tmp_path / "t.py"), "launch.launcher": launcher})
    d = DistEnv(rank=1, local_rank=0, world_size=2, master_addr="node1", master_port=20001, source="slurm",
                node_rank=1)
    env = child_env(spec, d, RunFolder(tmp_path), 1, 0.0, base={"RANK": "1", "PATH": "/bin"})
    assert env.get("RANK") == ("1" if launcher == "srun" else None) and env["NODE_RANK"] == "1"
    assert env.get("ACCELERATE_USE_CPU") == ("true" if launcher == "accelerate" else None)
