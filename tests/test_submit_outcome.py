"""Never forget a queued job: sbatch's answer parsed in every format sites print; an unknown outcome
(timeout, killed, lost connection, no job id) keeps the run as SUBMIT_UNKNOWN, and list/status find
its job later by the --comment it was submitted with (fake sbatch/squeue/sacct on PATH)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import test_dispatch as _td
from hpctrain import slurmcommands as _slurm
from hpctrain.runs.registry import SUBMIT_FAILED, SUBMIT_UNKNOWN, Registry

# The fake cluster of test_dispatch: sbatch/sinfo/sacct on PATH, a private state dir, a stand-in render.
fake_slurm, stand_in_render = _td.fake_slurm, _td.stand_in_render
_exe, _folders, _plan, _spec = _td._exe, _td._folders, _td._plan, _td._spec


@pytest.mark.parametrize("answer", [
    "12", "12;cluster1", "Submitted batch job 12", "Submitted batch job 12 on cluster c1",
    "site banner: quota 80% used\nSubmitted batch job 12", "warning: partition busy\n12\n", "12_[0-3]",
    "12_[0-3%2];c1", "  12  \n"])
def test_job_id_in_every_answer_format(answer: str) -> None:
    assert _slurm.job_id_from_sbatch(answer) == "12"


@pytest.mark.parametrize("answer", ["", "queued!", "error: 5 nodes busy", "job twelve"])
def test_answer_without_job_id_is_unknown_not_an_error(answer: str) -> None:
    with pytest.raises(_slurm.SubmitUnknown, match="no job id"):
        _slurm.job_id_from_sbatch(answer)


RECORDING_SBATCH = r"""#!/bin/bash
dir=$(dirname "$0")
printf '%s\n' "$@" > "$dir/sbatch.args"
"""


def _cli() -> click.Group:
    from hpctrain.cli import runs as cli_runs

    group = click.Group()
    cli_runs.register(group)
    return group


def _squeue(bin_dir: Path, lines: str) -> None:
    _exe(bin_dir / "squeue", f"#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/squeue.args\"\nprintf '{lines}'\n")


def test_submission_is_parsable_and_carries_the_run_id(fake_slurm: Path, stand_in_render: None,
                                                      tmp_path: Path) -> None:
    from hpctrain.slurm import dispatch

    _exe(fake_slurm / "sbatch", RECORDING_SBATCH + "echo 555\n")  # a bare id: what --parsable prints
    (d,) = _folders(tmp_path, 1)
    subs = dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    assert [s.job_id for s in subs] == ["555"]
    args = (fake_slurm / "sbatch.args").read_text().splitlines()
    assert "--parsable" in args and "--comment=hpctrain:tiny-0" in args


@pytest.mark.parametrize("how", ["timeout", "killed", "wrapper-killed", "lost-connection", "no-id"])
def test_unknown_outcome_keeps_the_run_and_list_finds_its_job(
        fake_slurm: Path, stand_in_render: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        how: str) -> None:
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.uncertain import SubmitUncertain

    body = {"timeout": "exec sleep 30\n", "killed": "kill -9 $$\n", "wrapper-killed": "exit 137\n",
            "lost-connection": "echo 'sbatch: error: Socket timed out on send/recv operation' >&2; exit 1\n",
            "no-id": "echo 'your job is in the queue'\n"}[how]
    _exe(fake_slurm / "sbatch", RECORDING_SBATCH + body)
    monkeypatch.setenv("HPCTRAIN_SBATCH_TIMEOUT_S", "1")
    _exe(fake_slurm / "sacct", "#!/bin/sh\nexit 0\n")  # accounting knows nothing (no job_comment flag)
    (d,) = _folders(tmp_path, 1)
    with pytest.raises(SubmitUncertain) as e:
        dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    assert e.value.exit_code == 75 and "hpctrain status tiny-0" in e.value.format_message()
    assert (fake_slurm / "sbatch.args").read_text().splitlines().count("--parsable") == 1  # never retried
    run = Registry().get_run("tiny-0")
    assert run.state == SUBMIT_UNKNOWN and run.latest and run.latest.tag == "hpctrain:tiny-0"
    assert d.is_dir() and len(list((d / "submitit").glob("*.pkl"))) == 1  # the job would need its pickle
    line = json.loads((d / "attempts.jsonl").read_text().splitlines()[0])
    assert line["state"] == SUBMIT_UNKNOWN and line["tag"] == "hpctrain:tiny-0"

    _squeue(fake_slurm, "31|other|RUNNING\\n777|hpctrain:tiny-0|PENDING\\n")
    res = CliRunner().invoke(_cli(), ["list", "--json"])
    assert res.exit_code == 0, res.output
    (shown,) = json.loads(res.stdout)
    assert shown["state"] == "PENDING" and shown["attempts"][0]["job_id"] == "777"
    assert (d / "submitit" / "777_submitted.pkl").is_file()  # where submitit on the node looks
    assert Registry().get_run("tiny-0").latest.job_id == "777"  # type: ignore[union-attr]


def test_unknown_submission_not_in_slurm_after_grace_is_submit_failed(
        fake_slurm: Path, stand_in_render: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.uncertain import SubmitUncertain

    _exe(fake_slurm / "sbatch", "#!/bin/sh\nexit 143\n")
    _exe(fake_slurm / "sacct", "#!/bin/sh\nexit 0\n")
    _squeue(fake_slurm, "")
    (d,) = _folders(tmp_path, 1)
    with pytest.raises(SubmitUncertain):
        dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    monkeypatch.setenv("HPCTRAIN_SUBMIT_GRACE_S", "3600")
    res = CliRunner().invoke(_cli(), ["status", "tiny-0"])
    assert res.exit_code == 0 and SUBMIT_UNKNOWN in res.stdout  # too early to say
    monkeypatch.setenv("HPCTRAIN_SUBMIT_GRACE_S", "0")
    res = CliRunner().invoke(_cli(), ["status", "tiny-0", "--json"])
    att = json.loads(res.stdout)["attempts"][0]
    assert att["state"] == SUBMIT_FAILED and "killed" in att["note"] and "not queued" in att["note"]
    assert Registry().get_run("tiny-0").state == SUBMIT_FAILED


def test_squeue_down_resolves_nothing(fake_slurm: Path, stand_in_render: None, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.uncertain import SubmitUncertain

    _exe(fake_slurm / "sbatch", "#!/bin/sh\necho '???'\n")
    _exe(fake_slurm / "squeue", "#!/bin/sh\necho 'squeue: error: Unable to contact slurm controller' >&2\nexit 1\n")
    monkeypatch.setenv("HPCTRAIN_SLURM_RETRIES", "1")
    monkeypatch.setenv("HPCTRAIN_SUBMIT_GRACE_S", "0")
    (d,) = _folders(tmp_path, 1)
    with pytest.raises(SubmitUncertain):
        dispatch.submit([d], _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    res = CliRunner().invoke(_cli(), ["list"])
    assert res.exit_code == 0 and SUBMIT_UNKNOWN in res.stdout and "could not look up" in res.stderr


def test_unknown_sweep_keeps_links_and_each_point_finds_its_task(
        fake_slurm: Path, stand_in_render: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.uncertain import SubmitUncertain

    _exe(fake_slurm / "sbatch", "#!/bin/sh\nexec sleep 30\n")
    _exe(fake_slurm / "sacct", "#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("HPCTRAIN_SBATCH_TIMEOUT_S", "1")
    dirs = _folders(tmp_path, 3)
    with pytest.raises(SubmitUncertain):
        dispatch.submit(dirs, _spec(), _plan(), "slurm")  # type: ignore[arg-type]
    assert (tmp_path / "runs" / ".sweeps" / "tiny-0" / "2").is_dir()  # task 2 resolves its folder through it
    _squeue(fake_slurm, "900|hpctrain:tiny-0|PENDING\\n")
    res = CliRunner().invoke(_cli(), ["list", "--json"])
    jobs = {r["run_id"]: r["attempts"][0]["job_id"] for r in json.loads(res.stdout)}
    assert jobs == {"tiny-0": "900_0", "tiny-1": "900_1", "tiny-2": "900_2"}
    assert all((d / "submitit" / f"900_{i}_submitted.pkl").is_file() for i, d in enumerate(dirs))


def test_submit_removes_the_run_folder_after_any_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only usage errors: an unexpected exception (here a broken executor) leaves no folder."""
    from hpctrain.cli.main import cli
    from hpctrain.slurm import dispatch

    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))

    def broken(*_: object, **__: object) -> None:
        raise OSError("srun: not found")

    monkeypatch.setattr(dispatch, "submit", broken)
    runfile = Path(__file__).parents[1] / "examples" / "tiny.toml"
    for _ in range(2):
        res = CliRunner().invoke(cli, ["submit", str(runfile), "--executor", "local"])
        assert isinstance(res.exception, OSError)
    assert not list((tmp_path / "runs").iterdir())


def test_submit_keeps_the_run_folder_when_the_job_may_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.cli.main import cli
    from hpctrain.slurm import dispatch
    from hpctrain.slurm.uncertain import SubmitUncertain

    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(tmp_path / "state"))

    def lost(*_: object, **__: object) -> None:
        raise SubmitUncertain("run x: sbatch got no answer")

    monkeypatch.setattr(dispatch, "submit", lost)
    runfile = Path(__file__).parents[1] / "examples" / "tiny.toml"
    res = CliRunner().invoke(cli, ["submit", str(runfile), "--executor", "local"])
    assert res.exit_code == 75 and "no answer" in res.output
    assert len(list((tmp_path / "runs").iterdir())) == 1


def test_sbatch_without_srun_is_a_clear_error_and_leaves_no_folder(fake_slurm: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.cli.main import cli

    (fake_slurm / "srun").unlink()
    monkeypatch.setenv("PATH", str(fake_slurm))  # sbatch and sinfo, no srun anywhere
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(tmp_path / "runs"))
    runfile = Path(__file__).parents[1] / "examples" / "tiny.toml"
    for _ in range(2):
        res = CliRunner().invoke(cli, ["submit", str(runfile), "--executor", "slurm"])
        assert res.exit_code == 1 and "`srun` is not on PATH" in res.output, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    assert not (fake_slurm / "counter").exists()  # nothing reached sbatch
