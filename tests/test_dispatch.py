"""Dispatch without a cluster: run folders, sacct parsing, retries, and the submit path against fake
sbatch/srun/sacct executables on PATH (the real-cluster versions are in test_submit_slurm.py)."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import click
import pytest

from hpctrain import slurmcommands as _slurm
from hpctrain.render import sbatch as render_sbatch_mod
from hpctrain.runs import folder as runs
from hpctrain.runs.registry import Registry

# -- run folders ----------------------------------------------------------------------------------


def test_new_run_id_sanitised_and_unique() -> None:
    rid = runs.new_run_id("my run; $(rm -rf /)", now=0)
    assert rid.startswith("my_run_rm_-rf-19700101-000000-")
    assert all(c.isalnum() or c in "_.-" for c in rid)
    assert len({runs.new_run_id("x", now=0) for _ in range(2000)}) == 2000  # a big sweep in one second


def test_run_id_clash_with_another_process_redraws_suffix(tmp_path: Path) -> None:
    rid = "tiny-20261129-120000-abcd"
    first = runs.create_run_folder_atomically(tmp_path, rid, {"spec.toml": "a\n"})
    second = runs.create_run_folder_atomically(tmp_path, rid, {"spec.toml": "b\n"})
    assert first.name == rid and second.name != rid and second.name.startswith("tiny-20261129-120000-")
    assert (first / "spec.toml").read_text() == "a\n" and (second / "spec.toml").read_text() == "b\n"


def test_create_run_folder_atomic_and_private(tmp_path: Path) -> None:
    d = runs.create_run_folder_atomically(tmp_path / "runs", "r-1", {"spec.toml": "a=1\n", "plan.json": "{}"})
    assert (d.stat().st_mode & 0o777) == 0o700
    assert (d / "spec.toml").read_text() == "a=1\n" and ((d / "plan.json").stat().st_mode & 0o077) == 0
    for sub in runs.SUBDIRS:
        assert (d / sub).is_dir()
    with pytest.raises(FileExistsError):
        runs.create_run_folder_atomically(tmp_path / "runs", "r-1", {})
    with pytest.raises(ValueError):
        runs.create_run_folder_atomically(tmp_path / "runs", "r-2", {"../escape": "x"})
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["r-1"]  # no temp dir left behind


def test_attempts_jsonl_roundtrip(tmp_path: Path) -> None:
    f = runs.RunFolder(tmp_path)
    f.append_attempt({"attempt": 0, "job_id": "1"})
    with f.attempts_jsonl.open("a") as fh:
        fh.write('{"attempt": 1, "job_')  # torn line from a killed writer
    assert f.read_attempts() == [{"attempt": 0, "job_id": "1"}]


# -- sacct parsing ----------------------------------------------------------------------------------
SACCT = """\
11|COMPLETED|0:0|node[1-4]|2026-11-29T10:00:00|2026-11-29T10:00:05
12|CANCELLED by 0|0:15|node1|2026-11-29T10:00:00|2026-11-29T10:01:00
13|NODE_FAIL|0:0|node2|2026-11-29T10:00:00|2026-11-29T10:00:30
13|PENDING|0:0|None assigned|Unknown|Unknown
14_0|OUT_OF_MEMORY|0:125|node3|2026-11-29T10:00:00|2026-11-29T10:00:09
14_[1-3%2]|PENDING|0:0|None assigned|Unknown|Unknown
15|TIMEOUT|0:0|node1|2026-11-29T10:00:00|2026-11-29T10:02:00
16|PREEMPTED|0:0|node1|2026-11-29T10:00:00|2026-11-29T10:02:00
17|REQUEUED|0:0|node1|2026-11-29T10:00:00|2026-11-29T10:02:00
18|RUNNING|0:0|node4|2026-11-29T10:00:00|Unknown
18.batch|RUNNING|0:0|node4|2026-11-29T10:00:00|Unknown
19|FAILED|1:0|node1|2026-11-29T10:00:00|2026-11-29T10:00:01
"""


def test_parse_sacct_keeps_states_distinct() -> None:
    recs = _slurm.parse_sacct(SACCT)
    assert {k: r.state for k, r in recs.items()} == {
        "11": "COMPLETED", "12": "CANCELLED", "13": "PENDING", "14_0": "OUT_OF_MEMORY", "14_1": "PENDING",
        "14_2": "PENDING", "14_3": "PENDING", "15": "TIMEOUT", "16": "PREEMPTED", "17": "REQUEUED",
        "18": "RUNNING", "19": "FAILED"}
    assert recs["13"].history == ("NODE_FAIL", "PENDING")  # -D keeps the requeued record
    first = recs["13"].runs[0]  # ... whole: the requeued run's own hosts and times, not the latest run's
    assert (first.state, first.nodelist, first.end - first.start) == ("NODE_FAIL", "node2", 30.0)
    assert len(recs["13"].runs) == 2 and recs["11"].runs == (_slurm.SacctRun("COMPLETED", "0:0", "node[1-4]",
                                                                             recs["11"].start, recs["11"].end),)
    assert recs["11"].nodelist == "node[1-4]" and recs["11"].end and recs["18"].end is None
    assert recs["13"].nodelist == "" and recs["19"].exit_code == "1:0"


# -- fake SLURM binaries ------------------------------------------------------------------------------
FAKE_SBATCH = r"""#!/bin/bash
set -u
dir=$(dirname "$0")
script="${@: -1}"
if grep -q -- 'nosuch' "$script"; then
  echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2; exit 1
fi
n=$(( $(cat "$dir/counter" 2>/dev/null || echo 100) + 1 )); echo $n > "$dir/counter"
cp "$script" "$dir/submitted-$n.sh"
env > "$dir/env-$n"
echo "Submitted batch job $n"
"""
# `sinfo -h -o %P` (partition list) or `-o %P|%D|%c|%m` (sizes), as the real one answers.
FAKE_SINFO = r"""#!/bin/bash
case "$*" in
  *"%P|%D"*) printf 'debug*|3|2|8000\ndebug*|1|2|8000\ngpu|2|8+|64000\n' ;;
  *) printf 'debug*\ngpu\n' ;;
esac
"""
FAKE_FLAKY = r"""#!/bin/bash
dir=$(dirname "$0")
n=$(( $(cat "$dir/flaky" 2>/dev/null || echo 0) + 1 )); echo $n > "$dir/flaky"
if [ "$n" -le "${FAIL_TIMES:-2}" ]; then
  echo "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection to \
host:localhost:6819: Connection refused" >&2
  exit 1
fi
printf '7|COMPLETED|0:0|node1|2026-11-29T10:00:00|2026-11-29T10:00:05\n'
"""


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture()
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(bin_dir / "sbatch", FAKE_SBATCH)
    _exe(bin_dir / "srun", "#!/bin/sh\nexit 0\n")
    _exe(bin_dir / "sacct", FAKE_FLAKY)
    _exe(bin_dir / "sinfo", FAKE_SINFO)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCTRAIN_SLURM_BACKOFF_S", "0.01")
    return bin_dir


def test_retry_then_success(fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_TIMES", "2")
    assert _slurm.sacct_states(["7"])["7"].state == "COMPLETED"
    assert (fake_slurm / "flaky").read_text().strip() == "3"


def test_unavailable_after_bounded_retries(fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_TIMES", "99")
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "3")
    t0 = time.monotonic()
    with pytest.raises(_slurm.SlurmUnavailable) as e:
        _slurm.sacct_states(["7"])
    assert time.monotonic() - t0 < 5
    msg = e.value.format_message()
    assert "sacct" in msg and "3 times" in msg and "slurmdbd" in msg
    assert isinstance(e.value, click.ClickException)


def test_not_installed_is_clear(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(_slurm.SlurmUnavailable, match="not on PATH"):
        _slurm.scancel(["1"])


def test_daemon_trouble_is_transient_user_errors_are_not() -> None:
    for msg in ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
                "sacct: error: Problem talking to the database: Connection refused",
                "scancel: error: Munge encode failed: Failed to access \"/run/munge/munge.socket.2\"",
                "squeue: error: Socket timed out on send/recv operation"):
        assert _slurm._TRANSIENT.search(msg), msg
    assert not _slurm._TRANSIENT.search("sbatch: error: Batch job submission failed: Invalid partition name specified")


def test_rejection_maps_to_field() -> None:
    e = _slurm.rejection("sbatch: error: Batch job submission failed: Invalid partition name specified")
    assert e.field == "resources.partition" and "Invalid partition" in e.reason
    assert _slurm.rejection("sbatch: error: Memory specification can not be satisfied").field == "resources.mem"


# -- submit through the fake cluster --------------------------------------------------------------------
def _stand_in_render(spec: object, plan: object, run_dir: Path, command: str, *, array: str | None = None,
                     **_: object) -> str:
    part = spec.resources.partition  # type: ignore[attr-defined]
    lines = ["#!/bin/bash", f"#SBATCH --partition={part}", f"#SBATCH --nodes={plan.nodes}"]  # type: ignore[attr-defined]
    if array:
        lines.append(f"#SBATCH --array={array}")
    return "\n".join(lines + [f"srun {command}", ""])


def _spec(partition: str = "debug", nodes: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        name="tiny", site="", env={"A": "1"}, secret_env=("MY_SECRET",),
        resources=SimpleNamespace(partition=partition, time="00:05:00", gpus_per_node=0, signal_seconds=30,
                                  nodes=nodes, mem="", account="", qos="", cpus_per_task=1, tasks_per_node=2),
        parallel=SimpleNamespace(zero=3, offload="none", pp=1, tp=1),
        model=SimpleNamespace(path="", config="llama-tiny"), data=SimpleNamespace(source="synthetic"),
        train=SimpleNamespace(steps=2, lr=1e-3), launch=SimpleNamespace(launcher="srun"),
        slurm=SimpleNamespace(extra=(), mail_type="", mail_user=""))


def _plan(nodes: int = 1) -> SimpleNamespace:
    return SimpleNamespace(nodes=nodes, ranks_per_node=2, world_size=2 * nodes, zero_stage=3)


@pytest.fixture()
def stand_in_render(monkeypatch: pytest.MonkeyPatch) -> None:
    import hpctrain.render

    mod = types.ModuleType("hpctrain.render.sbatch")
    mod.render_sbatch = _stand_in_render  # type: ignore[attr-defined]
    mod.submitit_command = render_sbatch_mod.submitit_command  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hpctrain.render.sbatch", mod)
    monkeypatch.setattr(hpctrain.render, "sbatch", mod, raising=False)


def _folders(tmp_path: Path, n: int) -> list[Path]:
    return [runs.create_run_folder_atomically(tmp_path / "runs", f"tiny-{i}", {"spec.toml": "x\n"})
            for i in range(n)]


def test_submit_one_job_records_after_sbatch(fake_slurm: Path, stand_in_render: None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch

    monkeypatch.setenv("HF_TOKEN", "hf_canary_secret_value_123")
    monkeypatch.setenv("MY_SECRET", "canary-my-secret-456")
    (d,) = _folders(tmp_path, 1)
    subs = dispatch.submit([d], _spec(), _plan(), "slurm", mode="preflight")  # type: ignore[arg-type]
    assert [s.job_id for s in subs] == ["101"]
    assert (d / "sbatch.sh").read_text() == (fake_slurm / "submitted-101.sh").read_text()
    _assert_pickled_call(d / "submitit" / "101_submitted.pkl", d, "preflight")
    assert (d / "submitit" / "101_submission.sh").read_text() == (d / "sbatch.sh").read_text()
    assert "HF_TOKEN=hf_canary" in (fake_slurm / "env-101").read_text()  # reaches sbatch by environment
    run = Registry().get_run("tiny-0")
    assert run.latest and run.latest.job_id == "101" and run.spec["world_size"] == 2
    intent, settled = map(json.loads, (d / "attempts.jsonl").read_text().splitlines())
    # the intent (before sbatch: no job id yet, the tag it is found by) and the settling line (after it)
    assert (intent["state"], intent["job_id"], intent["tag"]) == ("SUBMIT_UNKNOWN", "", "hpctrain:tiny-0")
    assert (settled["state"], settled["job_id"]) == ("PENDING", "101")
    _assert_no_canary(d, tmp_path / "state")


def _assert_pickled_call(path: Path, run_dir: Path, mode: str) -> None:
    """What submitit's runner (`python -m submitit.core._submit FOLDER`) loads on every task: the node's
    call for this run folder, with the time limit and requeue budget its time-out handler reads."""
    from submitit.helpers import DelayedSubmission

    from hpctrain.node.launch.entry import NodeJob

    call = DelayedSubmission.load(path)
    assert call.function == NodeJob(str(run_dir), mode) and (call.args, call.kwargs) == ((), {})
    assert (call._timeout_min, call._timeout_countdown) == (5, 3)  # --time 00:05:00, SlurmExecutor's default


def _assert_no_canary(*roots: Path) -> None:
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                assert b"hf_canary" not in data and b"canary-my-secret" not in data, p


def test_sweep_is_one_array(fake_slurm: Path, stand_in_render: None, tmp_path: Path) -> None:
    from hpctrain.slurm import dispatch

    dirs = _folders(tmp_path, 3)
    t0 = time.monotonic()
    subs = dispatch.submit(dirs, _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5
    assert [s.job_id for s in subs] == ["101_0", "101_1", "101_2"]
    assert not (fake_slurm / "submitted-102.sh").exists()  # ONE sbatch call
    assert "--array=0-2" in (fake_slurm / "submitted-101.sh").read_text()
    for i, d in enumerate(dirs):
        _assert_pickled_call(d / "submitit" / f"101_{i}_submitted.pkl", d, "train")  # via the .sweeps/%a links
        assert (d / "submitit" / "101_submission.sh").is_file()
        assert (d / "sbatch.sh").is_file()
    assert len(Registry().list_runs(limit=None)) == 3


def test_rejection_is_usage_error_and_records_nothing(fake_slurm: Path, stand_in_render: None,
                                                      tmp_path: Path) -> None:
    from hpctrain.slurm import dispatch

    (d,) = _folders(tmp_path, 1)
    with pytest.raises(click.UsageError) as e:
        dispatch.submit([d], _spec(partition="nosuch"), _plan(), "slurm")  # type: ignore[arg-type]
    msg = e.value.format_message()
    assert "resources.partition = 'nosuch'" in msg and "Invalid partition" in msg and "debug, gpu" in msg
    assert Registry().list_runs(limit=None) == []
    assert not list((d / "submitit").glob("*.pkl"))


def test_secret_in_script_refused(fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hpctrain.render
    from hpctrain.slurm import dispatch

    mod = types.ModuleType("hpctrain.render.sbatch")
    mod.render_sbatch = lambda *a, **k: "#!/bin/bash\nexport T=hf_canary_leak_000\n"  # type: ignore[attr-defined]
    mod.submitit_command = render_sbatch_mod.submitit_command  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hpctrain.render.sbatch", mod)
    monkeypatch.setattr(hpctrain.render, "sbatch", mod, raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_canary_leak_000")
    (d,) = _folders(tmp_path, 1)
    with pytest.raises(click.UsageError, match="secret"):
        dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    assert not (fake_slurm / "counter").exists()


def test_local_needs_one_node(tmp_path: Path) -> None:
    from hpctrain.slurm import dispatch

    (d,) = _folders(tmp_path, 1)
    with pytest.raises(click.UsageError, match="--executor slurm"):
        dispatch.submit([d], _spec(nodes=2), _plan(nodes=2), "local")  # type: ignore[arg-type]


def test_time_minutes() -> None:
    from hpctrain.slurm.dispatch import time_minutes

    assert [time_minutes(t) for t in ("5", "00:05:00", "1:30", "1-00:00:00", "2-3", "00:00:10")] == \
        [5, 5, 2, 1440, 2 * 1440 + 180, 1]


def test_auto_executor(fake_slurm: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hpctrain.slurm.dispatch import resolve_executor

    assert resolve_executor("auto") == "slurm"
    monkeypatch.setenv("PATH", str(tmp_path))
    assert resolve_executor("auto") == "local"


# -- slurmctld down, and the list/status/cancel commands ------------------------------------------------
DOWN = ('#!/bin/sh\necho "sbatch: error: Batch job submission failed: '
        'Unable to contact slurm controller (connect failure)" >&2\nexit 1\n')


def test_submit_with_controller_down_records_nothing(fake_slurm: Path, stand_in_render: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch

    _exe(fake_slurm / "sbatch", DOWN)
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "3")
    (d,) = _folders(tmp_path, 1)
    t0 = time.monotonic()
    with pytest.raises(_slurm.SlurmUnavailable) as e:
        dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5
    assert "3 times" in e.value.format_message() and "slurmctld" in e.value.format_message()
    assert Registry().list_runs(limit=None) == []


def _cli() -> click.Group:
    from hpctrain.cli import runs as cli_runs

    group = click.Group()
    cli_runs.register(group)
    return group


def test_list_status_cancel_commands(fake_slurm: Path, stand_in_render: None, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hpctrain.slurm import dispatch

    dirs = _folders(tmp_path, 2)
    subs = dispatch.submit(dirs, _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    # sacct reports task 0 finished and task 1 running; the parent id is what we asked about.
    _exe(fake_slurm / "sacct", "#!/bin/sh\necho '101_0|COMPLETED|0:0|node1|2026-11-29T10:00:00|2026-11-29T10:00:05'\n"
         "echo '101_1|RUNNING|0:0|node2|2026-11-29T10:00:00|Unknown'\n"
         "echo \"$@\" >> \"$(dirname \"$0\")/sacct.args\"\n")
    _exe(fake_slurm / "scancel", "#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/scancel.args\"\n")
    r = CliRunner().invoke(_cli(), ["list", "--json"])
    assert r.exit_code == 0, r.output
    states = {x["run_id"]: x["state"] for x in json.loads(r.output)}
    assert states == {subs[0].run_id: "COMPLETED", subs[1].run_id: "RUNNING"}
    assert len((fake_slurm / "sacct.args").read_text().splitlines()) == 1  # ONE batched sacct call
    r = CliRunner().invoke(_cli(), ["list"])
    assert "COMPLETED" in r.output and "RUNNING" in r.output
    # the finished attempt is cached: status of it does not ask sacct again
    calls = len((fake_slurm / "sacct.args").read_text().splitlines())
    r = CliRunner().invoke(_cli(), ["status", subs[0].run_id])
    assert r.exit_code == 0 and "node1" in r.output
    assert len((fake_slurm / "sacct.args").read_text().splitlines()) == calls
    r = CliRunner().invoke(_cli(), ["cancel", subs[1].run_id, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["cancelled"] == ["101_1"]
    assert (fake_slurm / "scancel.args").read_text().split() == ["101_1"]
    assert Registry().get_run(subs[1].run_id).state == "CANCELLED"
    lines = [json.loads(x) for x in (dirs[0] / "attempts.jsonl").read_text().splitlines()]
    assert lines[-1]["state"] == "COMPLETED" and lines[-1]["nodes"] == "node1"


def test_unknown_run_lists_close_matches(fake_slurm: Path, stand_in_render: None, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hpctrain.slurm import dispatch

    (d,) = _folders(tmp_path, 1)
    dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    r = CliRunner().invoke(_cli(), ["status", "tiny-9"])
    assert r.exit_code == 2 and "tiny-0" in r.output and "Close matches" in r.output, r.output
    r = CliRunner().invoke(_cli(), ["cancel", "zzz"])
    assert r.exit_code == 2 and "hpctrain list --all" in r.output


def test_status_with_slurmdbd_down_warns_and_shows_cache(fake_slurm: Path, stand_in_render: None, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hpctrain.slurm import dispatch

    (d,) = _folders(tmp_path, 1)
    (sub,) = dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    monkeypatch.setenv("FAIL_TIMES", "99")
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "2")
    r = CliRunner().invoke(_cli(), ["status", sub.run_id, "--json"])
    assert r.exit_code == 0
    assert "PENDING" in r.output and "stale" in r.output and "slurmdbd" in r.output


def test_unsplit_array_state_applies_to_every_task(fake_slurm: Path) -> None:
    """An array cancelled while pending has one sacct line "5"; `-j 5_0` would return nothing."""
    _exe(fake_slurm / "sacct", "#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/sacct.args\"\n"
         "echo '5|CANCELLED by 0|0:0|None assigned|Unknown|2026-11-29T10:00:05'\n")
    recs = _slurm.sacct_states(["5_0", "5_1"])
    assert {k: r.state for k, r in recs.items()} == {"5_0": "CANCELLED", "5_1": "CANCELLED"}
    assert (fake_slurm / "sacct.args").read_text().split()[-1] == "5"  # asked about the parent


def _record_local_run(d: Path, pid: int) -> Path:
    from hpctrain.runs.registry import Attempt

    Registry().add_submitted({"run_id": d.name, "name": "tiny", "folder": str(d), "executor": "local"},
                             Attempt(run_id=d.name, attempt=0, job_id=str(pid)))
    return d


def test_cancel_local_run_stops_its_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from click.testing import CliRunner

    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    d = _folders(tmp_path, 1)[0]
    # Stands in for submitit's local controller: the same argv shape (`-m submitit.local._local RUN/submitit`).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "submitit.local._local",
                             str(d / "submitit")])
    try:
        _record_local_run(d, proc.pid)
        r = CliRunner().invoke(_cli(), ["status", d.name, "--json"])
        assert json.loads(r.output)["state"] == "RUNNING"
        r = CliRunner().invoke(_cli(), ["cancel", d.name])
        assert r.exit_code == 0 and "cancelled" in r.output
        assert proc.wait(timeout=5) != 0
        assert Registry().get_run(d.name).state == "CANCELLED"
    finally:
        proc.kill()
        proc.wait()


def test_cancel_never_signals_a_process_that_reused_the_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local run's controller ended long ago and its PID now belongs to another program: not RUNNING,
    and `cancel` leaves that program alone."""
    import subprocess

    from click.testing import CliRunner

    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        d = _record_local_run(_folders(tmp_path, 1)[0], stranger.pid)
        r = CliRunner().invoke(_cli(), ["status", d.name, "--json"])
        assert json.loads(r.output)["state"] == "FAILED"  # no controller, no result file
        CliRunner().invoke(_cli(), ["cancel", d.name])
        assert stranger.poll() is None  # still running
    finally:
        stranger.kill()
        stranger.wait()


def test_unusable_registry_fails_before_sbatch(fake_slurm: Path, stand_in_render: None, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(blocker / "state"))  # a folder below a file
    (d,) = _folders(tmp_path, 1)
    with pytest.raises(click.ClickException, match="HPCTRAIN_STATE_DIR"):
        dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    assert not (fake_slurm / "counter").exists()  # sbatch never ran


@pytest.mark.parametrize(("nodes", "res", "match"), [
    (5, {}, "resources.nodes = 5: partition debug has 4 node"),
    (1, {"cpus_per_task": 2}, "= 4 CPUs per node, but nodes of partition debug have 2"),
    (1, {"mem": "9G"}, "resources.mem = '9G': nodes of partition debug have 8000 MB"),
    (1, {"mem": "8001"}, "resources.mem = '8001': nodes of partition debug have 8000 MB"),  # no unit: MB
])
def test_shape_the_partition_can_never_run_is_refused(fake_slurm: Path, stand_in_render: None, tmp_path: Path,
                                                      nodes: int, res: dict[str, object], match: str) -> None:
    from hpctrain.slurm import dispatch

    spec = _spec(partition="")  # the default partition (debug*)
    spec.resources.__dict__.update(res)
    (d,) = _folders(tmp_path, 1)
    with pytest.raises(click.UsageError, match=re.escape(match)):
        dispatch.submit([d], spec, _plan(nodes=nodes), "slurm")  # type: ignore[arg-type]
    assert not (fake_slurm / "counter").exists()


def test_partition_info_parses(fake_slurm: Path) -> None:
    info = _slurm.partition_info("gpu")
    assert info is not None and (info.nodes, info.cpus, info.mem_mb) == (2, 8, 64000)
    assert _slurm.partition_info("") == _slurm.PartitionInfo("debug", 4, 2, 8000)
    assert _slurm.partition_info("nope") is None


def test_local_executor_preflight_two_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real local-executor submit (no cluster): 2 ranks run the pre-flight through submitit."""
    from hpctrain.plan import planner as P
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.refresh import refresh
    from hpctrain.spec import model as S

    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_TOKEN", "hf_canary_local_0123456789")
    env = {"runs": tmp_path / "runs", "state": tmp_path / "state"}

    sp = S.resolve(None, {"resources.tasks_per_node": 2, "model.config": "llama-tiny",
                          "launch.preflight_timeout_s": 30}, None)
    pl = P.make_plan(sp)
    run_dir = runs.create_run_folder_atomically(env["runs"], runs.new_run_id("local"),
                                                {"spec.toml": S.to_toml(sp), "plan.json": pl.to_json()})
    (sub,) = dispatch.submit([run_dir], sp, pl, "local", mode="preflight")
    assert sub.executor == "local"
    end = time.monotonic() + 90
    while True:
        reg = Registry()
        run = reg.get_run(sub.run_id)
        refresh(reg, [run])
        if run.state != "RUNNING" and run.state != "PENDING":
            break
        assert time.monotonic() < end, "local preflight did not finish in 90 s"
        time.sleep(0.5)
    assert run.state == "COMPLETED", (run.to_dict(), list((run_dir / "submitit").iterdir()))
    assert len(list((run_dir / "submitit").glob(f"{sub.job_id}_*_result.pkl"))) == 2
    _assert_no_canary(run_dir, env["state"])

    # A new attempt of a local run (hpctrain resubmit, the supervisor) stays on the local executor.
    again = dispatch.submit_attempt(run_dir, sp, pl, 1, mode="preflight")
    assert again.executor == "local" and again.job_id != sub.job_id
    assert runs.RunFolder(run_dir).read_attempts()[-1]["executor"] == "local"
    assert [a.attempt for a in Registry().get_run(sub.run_id).attempts] == [0, 1]
    end = time.monotonic() + 90
    while len(list((run_dir / "submitit").glob(f"{again.job_id}_*_result.pkl"))) < 2:
        assert time.monotonic() < end, "the local attempt 1 did not finish in 90 s"
        time.sleep(0.5)


@pytest.mark.deepspeed
def test_local_run_killed_by_the_fail_hook_reports_its_exit_code(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A real local training run whose rank os._exit(17)s after step 2 (HPCTRAIN_FAIL_AT_STEP): the attempt's
    exit code is the rank's (status --json, summary), and the failure names the local job's state, never SLURM's.
    One rank under ZeRO-0, the cheapest real run: how several ranks' statuses combine is the next test's."""
    pytest.importorskip("deepspeed")
    from click.testing import CliRunner

    from hpctrain.cli import collect as cli_collect
    from hpctrain.plan.planner import make_plan
    from hpctrain.slurm import dispatch
    from hpctrain.spec.model import from_toml_text
    from runkit import make_run

    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    for k, v in {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "3",
                 "HPCTRAIN_FAIL_AT_STEP": "2"}.items():
        monkeypatch.setenv(k, v)  # the local controller and its ranks inherit this environment
    run_dir = make_run(tmp_path / "runs" / runs.new_run_id("crash"), train={"steps": 4},
                       resources={"tasks_per_node": 1}, parallel={"zero": 0})
    sp = from_toml_text(runs.RunFolder(run_dir).spec_toml.read_text())
    (sub,) = dispatch.submit([run_dir], sp, make_plan(sp), "local")
    end = time.monotonic() + 240
    while (state := json.loads(CliRunner().invoke(_cli(), ["status", sub.run_id, "--json"]).output))["state"] in (
            "PENDING", "RUNNING"):
        assert time.monotonic() < end, "the local run did not end in 240 s"
        time.sleep(1)
    assert state["state"] == "FAILED", state
    assert [a["exit_code"] for a in state["attempts"]] == ["17:0"], state  # the rank's os._exit(17)
    assert [h["exit_code"] for h in state["history"]] == ["17:0"], state
    group = click.Group()
    cli_collect.register(group)
    res = CliRunner().invoke(group, ["summary", sub.run_id, "--json"])
    (att,) = json.loads(res.output)["runs"][0]["attempts"]
    assert att["exit_code"] == "17:0", att
    message = att["failure"]["message"]
    assert "SLURM" not in message and "local job state FAILED, exit 17:0" in message, message
    assert "HPCTRAIN_FAIL_AT_STEP=2" in message, message


@pytest.mark.parametrize(("rank1", "code"), [("os._exit(0)", "17:0"), ("os.kill(os.getpid(), signal.SIGKILL)", "0:9")])
def test_local_controller_records_how_its_tasks_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       rank1: str, code: str) -> None:
    """submitit's controller exits 0 whatever its tasks did; hpctrain's (hpctrain.slurm.localctl) records their
    exit statuses, and the refresh gives the attempt the job's exit code in sacct's form (a signal wins: 0:9)."""
    import shlex

    from hpctrain.runs.registry import Attempt
    from hpctrain.slurm import dispatch, localctl
    from hpctrain.slurm.refresh import refresh

    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    (d,) = _folders(tmp_path, 1)
    task = f"import os, signal; os._exit(17) if os.environ['SUBMITIT_LOCAL_GLOBALID'] == '0' else {rank1}"
    proc = localctl.start_controller(runs.RunFolder(d).submitit_dir, shlex.join([sys.executable, "-c", task]),
                                     tasks_per_node=2, cuda_devices="", timeout_min=1, signal_delay_s=5)
    Registry().add_submitted({"run_id": d.name, "name": "tiny", "folder": str(d), "executor": "local"},
                             Attempt(run_id=d.name, attempt=0, job_id=str(proc.pid)))
    assert proc.wait(timeout=30) == 0  # the controller's own status says nothing of its tasks'
    assert dispatch.local_state(d, str(proc.pid)) == ("FAILED", f"exit {code}")
    record = json.loads(localctl.exit_record(runs.RunFolder(d).submitit_dir, str(proc.pid)).read_text())
    assert record["task_statuses"] == [17, 0 if code == "17:0" else -9]
    reg = Registry()
    refresh(reg, [reg.get_run(d.name)])
    att = Registry().get_run(d.name).latest
    assert att is not None and (att.state, att.exit_code) == ("FAILED", code)
    assert runs.RunFolder(d).read_attempts()[-1]["exit_code"] == code  # attempts.jsonl: summary of a bare folder


def test_local_job_exit_code_in_sacct_form() -> None:
    from hpctrain.slurm.localctl import job_exit_code

    assert job_exit_code([0, 0]) == "0:0"
    assert job_exit_code([17, 1, None]) == "17:0"  # srun's rule: the highest status
    assert job_exit_code([1, -9]) == "0:9"  # a rank killed by a signal is the cause, its peer's exit 1 the consequence
    assert job_exit_code([None]) is None and job_exit_code([]) is None


def test_just_finished_job_is_read_again_until_settled(fake_slurm: Path, stand_in_render: None,
                                                       tmp_path: Path) -> None:
    """slurmdbd may list a just-finished 4-node job on one node for a moment: re-read it for a while."""
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.refresh import refresh

    (d,) = _folders(tmp_path, 1)
    (sub,) = dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    for nodes in ("node1", "node[1-4]"):
        _exe(fake_slurm / "sacct", f"#!/bin/sh\necho '{sub.job_id}|COMPLETED|0:0|{nodes}|{end}|{end}'\n")
        reg = Registry()
        refresh(reg, [reg.get_run(sub.run_id)])
    assert Registry().get_run(sub.run_id).latest.nodes == "node[1-4]"  # type: ignore[union-attr]


def test_a_requeued_jobs_runs_are_recorded_for_the_history(fake_slurm: Path, stand_in_render: None,
                                                          tmp_path: Path) -> None:
    """sacct -D lists a requeued job's runs (node[1,4] requeued, then node[2-3]): the refresh writes them to
    attempts.jsonl while the job runs again (once) and with its final state, for hpctrain.runs.history."""
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.refresh import refresh

    (d,) = _folders(tmp_path, 1)
    (sub,) = dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    first = f"{sub.job_id}|REQUEUED|0:0|node[1,4]|2026-11-29T10:00:00|2026-11-29T10:00:40"
    for last in ("RUNNING|0:0|node[2-3]|2026-11-29T10:01:00|Unknown",
                 "RUNNING|0:0|node[2-3]|2026-11-29T10:01:00|Unknown",
                 "COMPLETED|0:0|node[2-3]|2026-11-29T10:01:00|2026-11-29T10:02:00"):
        _exe(fake_slurm / "sacct", f"#!/bin/sh\necho '{first}'\necho '{sub.job_id}|{last}'\n")
        reg = Registry()
        refresh(reg, [reg.get_run(sub.run_id)])
    got = [r["sacct_runs"] for r in runs.RunFolder(d).read_attempts() if "sacct_runs" in r]
    assert len(got) == 2 and [r["nodelist"] for r in got[0]] == ["node[1,4]", "node[2-3]"]  # running, then final
    assert [r["state"] for r in got[-1]] == ["REQUEUED", "COMPLETED"] and got[-1][0]["end"] - got[-1][0]["start"] == 40
