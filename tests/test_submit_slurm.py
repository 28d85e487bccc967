"""Dispatch against the REAL local SLURM cluster (tests/cluster/slurm.sh: node1..node4, partition debug).

These submit real jobs; every test cancels what it submitted. Marked `slurm`; skipped when the
cluster does not answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slurm
CANARY = "hf_canaryDISPATCH0123456789abcdefXYZ"
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Any:
    """The CLUSTER engineer's `slurm_cluster` fixture when conftest has one, else a health check."""
    try:
        return request.getfixturevalue("slurm_cluster")
    except pytest.FixtureLookupError:
        pass
    if not shutil.which("sbatch"):
        pytest.skip("no SLURM client tools (run tests/cluster/slurm.sh install && up)")
    ok = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%D %t"], capture_output=True, text=True,
                        timeout=20, check=False)
    if ok.returncode != 0 or not ok.stdout.strip():
        pytest.skip(f"local SLURM cluster not up: {ok.stderr.strip()}")
    return None


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    # Run folders must be visible from the nodes: the lab shares the filesystem, /tmp included.
    paths = {"runs": tmp_path / "runs", "state": tmp_path / "state"}
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(paths["runs"]))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(paths["state"]))
    monkeypatch.setenv("HF_TOKEN", CANARY)
    yield paths
    _cancel_all(paths["state"])


def _cancel_all(state: Path) -> None:
    """scancel every job this test recorded (finished ones are a no-op for scancel)."""
    from hpctrain.runs.registry import Registry

    db = state / "registry.sqlite3"
    if not db.exists():
        return
    ids = {a.job_id.split("_")[0] for r in Registry(db).list_runs(limit=None) for a in r.attempts
           if r.executor == "slurm"}
    if ids:
        subprocess.run(["scancel", *sorted(ids)], capture_output=True, timeout=30, check=False)


def _spec_plan(**flags: Any) -> tuple[Any, Any]:
    from hpctrain.plan import planner as P
    from hpctrain.spec import model as S

    base = {"resources.partition": "debug", "resources.time": "00:05:00", "model.config": "llama-tiny",
            "launch.preflight_timeout_s": 30}
    sp = S.resolve(None, {**base, **flags}, None)
    return sp, P.make_plan(sp)


def _make_runs(sp: Any, pl: Any, runs_dir: Path, n: int = 1) -> list[Path]:
    from hpctrain.render.runfolder import write_run_folder
    from hpctrain.runs import folder as runs

    return [write_run_folder(runs_dir / runs.new_run_id(sp.name), sp, pl, create=True) for _ in range(n)]


def _hpctrain(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy(), check=False)


def _cli_has(command: str) -> bool:
    return f"  {command} " in _hpctrain("--help").stdout


def _wait_final(run_id: str, deadline_s: float = 180, queue_cap_s: float = 900) -> dict[str, Any]:
    """Poll `hpctrain status --json` (refresh = one forced sacct) until the run is final.

    `deadline_s` counts from when the job leaves the queue: time PENDING behind other jobs on the
    shared cluster is not the job's (still bounded, by `queue_cap_s`)."""
    from hpctrain.runs.registry import Registry
    from hpctrain.slurm.refresh import refresh

    start = time.monotonic()
    end = start + deadline_s
    while True:
        reg = Registry()
        run = reg.get_run(run_id)
        refresh(reg, [run])
        if run.attempts and run.attempts[-1].final:
            return run.to_dict()
        now = time.monotonic()
        if run.attempts and run.attempts[-1].state == "PENDING" and now - start < queue_cap_s:
            end = now + deadline_s
        if now > end:
            raise AssertionError(f"run {run_id} not final {deadline_s}s after it started: {run.to_dict()}")
        time.sleep(1.0)


def test_test_only_accepts_rendered_scripts(cluster: Any, env: dict[str, Path]) -> None:
    from hpctrain import slurmcommands as _slurm
    from hpctrain.render import sbatch as render

    for flags in ({"resources.nodes": 1, "resources.tasks_per_node": 2}, {"resources.nodes": 4}):
        sp, pl = _spec_plan(**flags)
        run_dir = env["runs"] / "x"
        single = render.render_sbatch(sp, pl, run_dir, render.submitit_command("python3", str(run_dir)))
        assert "to start" in _slurm.test_only(single)
        dirs = [env["runs"] / f"s{i}" for i in range(3)]
        array = render.render_sbatch(sp, pl, dirs[0], "python3 -c pass", array="0-2", run_dirs=dirs)
        assert "to start" in _slurm.test_only(array)


def test_four_node_preflight_completes_and_lists(cluster: Any, env: dict[str, Path]) -> None:
    """`hpctrain submit examples/tiny.toml --nodes 4 --preflight`: 8 ranks on node1..node4 rendezvous."""
    from hpctrain.slurm import dispatch

    if _cli_has("submit"):
        proc = _hpctrain("submit", TINY, "--nodes", "4", "--preflight", "--executor", "slurm", "--json")
        assert proc.returncode == 0, proc.stderr
        (sub,) = json.loads(proc.stdout)
        run_id, job_id, run_dir = sub["run_id"], sub["job_id"], Path(sub["run_dir"])
    else:
        sp, pl = _spec_plan(**{"resources.nodes": 4, "resources.tasks_per_node": 2})
        (run_dir,) = _make_runs(sp, pl, env["runs"])
        (s,) = dispatch.submit([run_dir], sp, pl, "slurm", mode="preflight")
        run_id, job_id = s.run_id, s.job_id
    rec = _wait_final(run_id)
    assert rec["state"] == "COMPLETED", rec
    for _ in range(20):  # slurmdbd may need a moment to record the whole nodelist (see hpctrain.slurm.refresh.SETTLE_S)
        if rec["attempts"][0]["nodes"] == "node[1-4]":
            break
        time.sleep(1)
        rec = _wait_final(run_id)
    assert rec["attempts"][0]["nodes"] == "node[1-4]", rec
    # Every one of the 8 ranks on node1..node4 passed the rendezvous.
    outs = sorted((run_dir / "submitit").glob(f"{job_id}_*_result.pkl"))
    assert len(outs) == 8
    assert (run_dir / "hostfile").read_text().split() == [w for i in range(1, 5) for w in (f"node{i}", "slots=2")]
    if _cli_has("list"):
        listed = json.loads(_hpctrain("list", "--json").stdout)
        assert any(r["run_id"] == run_id and r["state"] == "COMPLETED" for r in listed)
        status = json.loads(_hpctrain("status", run_id[:-2], "--json").stdout)
        assert status["state"] == "COMPLETED" and status["attempts"][0]["job_id"] == job_id
        table = _hpctrain("list").stdout
        assert run_id in table and "COMPLETED" in table
    _assert_no_canary(run_dir, env["state"])


def _assert_no_canary(*roots: Path) -> None:
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file() and not p.is_symlink():
                assert CANARY.encode() not in p.read_bytes(), f"secret leaked into {p}"


def test_unknown_partition_clean_error(cluster: Any, env: dict[str, Path]) -> None:
    import click

    from hpctrain.runs import folder as runs
    from hpctrain.runs.registry import Registry
    from hpctrain.slurm import dispatch

    if _cli_has("submit"):
        proc = _hpctrain("submit", TINY, "--partition", "nosuchpart", "--executor", "slurm")
        assert proc.returncode == 2, proc.stderr
        assert "partition" in proc.stderr and "nosuchpart" in proc.stderr and "debug" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert not env["runs"].exists() or not [p for p in env["runs"].iterdir() if not p.name.startswith(".")]
    sp, pl = _spec_plan(**{"resources.partition": "nosuchpart"})
    (run_dir,) = _make_runs(sp, pl, env["runs"])
    with pytest.raises(click.UsageError) as e:
        dispatch.submit([run_dir], sp, pl, "slurm")
    msg = e.value.format_message()
    assert "resources.partition = 'nosuchpart'" in msg and "Invalid partition" in msg and "debug" in msg
    runs.remove_run_folder(run_dir)  # what the caller (hpctrain submit) does
    assert Registry().list_runs(limit=None) == []


WRITER = """
import sys
from pathlib import Path
from hpctrain.slurm import dispatch
from hpctrain.plan import planner as P
from hpctrain.runs import folder as runs
from hpctrain.spec import model as S
sp = S.resolve(None, {"resources.partition": "debug", "resources.time": "00:05:00", "name": "conc",
                      "model.config": "llama-tiny", "launch.preflight_timeout_s": 20}, None)
pl = P.make_plan(sp)
d = runs.create_run_folder_atomically(sys.argv[1], runs.new_run_id("conc"), {"spec.toml": S.to_toml(sp)})
print(dispatch.submit([d], sp, pl, "slurm", mode="preflight")[0].job_id)
"""


def test_twenty_concurrent_submits_all_recorded(cluster: Any, env: dict[str, Path]) -> None:
    from hpctrain.runs.registry import Registry

    if _cli_has("submit"):
        argv = [[sys.executable, "-m", "hpctrain", "submit", TINY, "--preflight",
                 "--executor", "slurm", "--partition", "debug", "--nodes", "1"]] * 20
    else:
        argv = [[sys.executable, "-c", WRITER, str(env["runs"])]] * 20
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argv]
    results = [(p.wait(timeout=180), *p.communicate()) for p in procs]
    try:
        assert all(rc == 0 for rc, _, _ in results), [err for rc, _, err in results if rc][:2]
        reg = Registry()
        recs = reg.list_runs(limit=None)
        assert len(recs) == 20
        jobs = {r.attempts[0].job_id for r in recs}
        assert len(jobs) == 20
        assert reg.integrity_check() == "ok"
        folders = [p for p in env["runs"].iterdir() if not p.name.startswith(".")]
        assert sorted(p.name for p in folders) == sorted(r.run_id for r in recs)
    finally:
        _cancel_all(env["state"])


def test_sweep_is_one_array_and_cancel(cluster: Any, env: dict[str, Path]) -> None:
    from click.testing import CliRunner

    from hpctrain.cli import runs as cli_runs
    from hpctrain.runs.registry import Registry
    from hpctrain.slurm import dispatch

    sp, pl = _spec_plan(**{"resources.nodes": 1, "resources.time": "00:02:00"})
    dirs = _make_runs(sp, pl, env["runs"], n=3)
    subs = dispatch.submit(dirs, sp, pl, "slurm", mode="preflight")
    base = {s.job_id.split("_")[0] for s in subs}
    assert len(base) == 1 and [s.job_id.split("_")[1] for s in subs] == ["0", "1", "2"]
    rec = _wait_final(subs[2].run_id)
    assert rec["state"] == "COMPLETED", rec
    assert (dirs[2] / "submitit" / f"{subs[2].job_id}_0_result.pkl").is_file()
    for i, d in enumerate(dirs):  # every array task logged into its own point's folder, none into point 0's
        _wait_final(subs[i].run_id)
        assert sorted(p.name for p in (d / "submitit").glob("*_log.out")) == [f"{subs[i].job_id}_0_log.out"]
        assert list((d / "logs").glob("attempt-0.rank-*.log"))
    # cancel on a finished run is a no-op that says so
    import click

    group = click.Group()
    cli_runs.register(group)
    out = CliRunner().invoke(group, ["cancel", subs[2].run_id, "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["cancelled"] == []
    assert Registry().get_run(subs[0].run_id).spec["array_index"] == 0



def test_hostile_runs_dir_single_and_sweep(cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quotes, spaces, $(), backticks and ; in the runs path stay data, for one job and for an array."""
    from hpctrain.slurm import dispatch

    runs_dir = tmp_path / "we ird'$(touch PWNED);`touch PWNED2`" / "runs"
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    try:
        sp, pl = _spec_plan(**{"resources.nodes": 1, "resources.tasks_per_node": 2})
        single = dispatch.submit(_make_runs(sp, pl, runs_dir), sp, pl, "slurm", mode="preflight")
        sweep = dispatch.submit(_make_runs(sp, pl, runs_dir, n=2), sp, pl, "slurm", mode="preflight")
        for s in single + sweep:
            assert _wait_final(s.run_id)["state"] == "COMPLETED"
            assert len(list((s.run_dir / "submitit").glob(f"{s.job_id}_*_result.pkl"))) == 2
        assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))
    finally:
        _cancel_all(tmp_path / "state")


def test_runs_dir_with_percent_and_space_submits_and_completes(cluster: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A runs dir holding '%' (SLURM's pattern character: %x is the job name) and a space, through the CLI: the
    job completes and submitit's logs and results are in the literal folder. A '%j' there is refused before
    anything is submitted."""
    runs = tmp_path / "50%x of runs ü"
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(runs))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))
    try:
        proc = _hpctrain("submit", TINY, "--nodes", "1", "--preflight", "--executor", "slurm", "--json")
        assert proc.returncode == 0, proc.stderr
        (sub,) = json.loads(proc.stdout)
        run_dir, job_id = Path(sub["run_dir"]), sub["job_id"]
        assert run_dir.parent == runs
        rec = _wait_final(sub["run_id"])
        assert rec["state"] == "COMPLETED", rec
        assert len(list((run_dir / "submitit").glob(f"{job_id}_*_result.pkl"))) == 2
        assert (run_dir / "submitit" / f"{job_id}_0_log.out").is_file()
        monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs-%j"))
        proc = _hpctrain("submit", TINY, "--nodes", "1", "--preflight", "--executor", "slurm")
        assert proc.returncode == 2 and "HPCTRAIN_RUNS_DIR = " in proc.stderr and "%j" in proc.stderr, proc.stderr
        assert not (tmp_path / "runs-%j").exists()
    finally:
        _cancel_all(tmp_path / "state")


@pytest.mark.parametrize(("flags", "expect"), [
    (["--nodes", "9"], "resources.nodes = 9: partition debug has 4 node"),
    (["--mem", "999999M"], "resources.mem = '999999M'"),
    (["--set", "resources.constraint=bigmem"], "resources.constraint = 'bigmem'"),
    (["--gpus-per-node", "1", "--set", "resources.tasks_per_node=1"], "resources.gpus_per_node = 1"),
])
def test_impossible_shapes_refused_cleanly(cluster: Any, env: dict[str, Path], flags: list[str], expect: str) -> None:
    """One message naming field and value, exit 2, no run folder, no registry record, no job left."""
    from hpctrain.runs.registry import Registry

    if not _cli_has("submit"):
        pytest.skip("hpctrain submit not available")
    proc = _hpctrain("submit", TINY, "--preflight", "--executor", "slurm", *flags)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert expect in proc.stderr and "Fix:" in proc.stderr and "Traceback" not in proc.stderr
    assert not env["runs"].exists() or not [p for p in env["runs"].iterdir() if not p.name.startswith(".")]
    assert Registry().list_runs(limit=None) == []


def test_preflight_names_the_node_that_did_not_join(cluster: Any) -> None:
    """3 real nodes, node3's task dies before the rendezvous: ranks on node1/node2 exit non-zero
    within the timeout, naming rank 2 and node3 -- instead of hanging in a collective."""
    from hpctrain.nodelist import rendezvous_port_shell

    code = ("import sys\nfrom hpctrain.node.launch.preflight import run_from_env, PreflightError\n"
            "try:\n    run_from_env(8)\nexcept PreflightError as e:\n    print('PREFLIGHT', e)\n    sys.exit(4)\n")
    task = ('if [ "$SLURM_PROCID" = 2 ]; then exit 0; fi; '
            f'export MASTER_PORT={rendezvous_port_shell()}; exec "$0" -c "$1"')
    # A hang would run into the job's 2-minute limit (srun then fails without PREFLIGHT lines); the
    # subprocess timeout only bounds the wait for an allocation on the shared cluster.
    proc = subprocess.run(["srun", "-p", "debug", "-N3", "-n3", "--time=2", "bash", "-c", task, sys.executable, code],
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PREFLIGHT")]
    assert proc.returncode == 4, (proc.stdout, proc.stderr)
    assert len(lines) == 2 and all("rank(s) 2" in ln and "node3" in ln for ln in lines), lines


def _unreachable_conf(tmp_path: Path) -> Path:
    """The lab's slurm.conf with slurmctld/slurmdbd ports nobody listens on: the real clients then
    fail exactly as with the daemons down, without touching the shared cluster."""
    import re

    text = Path("/etc/slurm/slurm.conf").read_text()
    for key, port in (("SlurmctldPort", 1), ("AccountingStoragePort", 2)):
        text, n = re.subn(rf"(?m)^{key}=.*$", f"{key}={port}", text)
        text += "" if n else f"\n{key}={port}\n"
    conf = tmp_path / "down" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text(text)
    return conf


def test_controller_and_dbd_down(cluster: Any, env: dict[str, Path], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmctld/slurmdbd not answering: submit fails with a clear message and records nothing;
    list shows cached states with a warning; cancel fails without recording CANCELLED."""
    from hpctrain.runs.registry import Registry
    from hpctrain.slurm import dispatch

    if not _cli_has("submit"):
        pytest.skip("hpctrain submit not available")
    sp, pl = _spec_plan(**{"resources.nodes": 1})
    (run_dir,) = _make_runs(sp, pl, env["runs"] / "ok")
    (sub,) = dispatch.submit([run_dir], sp, pl, "slurm", mode="preflight")  # one real, recorded run
    monkeypatch.setenv("SLURM_CONF", str(_unreachable_conf(tmp_path)))
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "2")
    t0 = time.monotonic()
    proc = _hpctrain("submit", TINY, "--preflight", "--executor", "slurm", timeout=120)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1 and "slurmctld" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert [r.run_id for r in Registry().list_runs(limit=None)] == [sub.run_id]
    assert not [p for p in env["runs"].iterdir() if p.name not in ("ok",)]
    listed = _hpctrain("list", "--json")
    assert listed.returncode == 0 and "stale" in listed.stderr and "slurmdbd" in listed.stderr
    assert json.loads(listed.stdout)[0]["run_id"] == sub.run_id
    cancelled = _hpctrain("cancel", sub.run_id, timeout=120)
    assert cancelled.returncode == 1 and "slurmctld" in cancelled.stderr, cancelled.stderr
    assert Registry().get_run(sub.run_id).state != "CANCELLED"


def test_failed_job_shows_failed_with_exit_code(cluster: Any, env: dict[str, Path]) -> None:
    """A run whose spec.toml the ranks cannot read fails on every rank: status says FAILED, exit code kept."""
    from hpctrain.runs import folder as runs
    from hpctrain.slurm import dispatch

    sp, pl = _spec_plan(**{"resources.nodes": 2, "resources.tasks_per_node": 1})
    run_dir = runs.create_run_folder_atomically(env["runs"], runs.new_run_id("broken"),
                                                {"spec.toml": "this is = = not toml\n", "plan.json": pl.to_json()})
    (sub,) = dispatch.submit([run_dir], sp, pl, "slurm", mode="preflight")
    rec = _wait_final(sub.run_id)
    assert rec["state"] == "FAILED", rec
    code = rec["attempts"][0]["exit_code"]
    assert code and code != "0:0", rec  # srun reports the step's code (1 or the rank's), never success
    if _cli_has("status"):
        out = _hpctrain("status", sub.run_id, "--json")
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)
        assert shown["state"] == "FAILED" and shown["attempts"][0]["exit_code"] not in (None, "0:0"), shown
