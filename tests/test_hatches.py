"""Escape hatches (issue 17, item 4): [slurm] extra / --sbatch-arg, --mail-type/--mail-user, --after; their
validation with hostile strings, the golden render, sbatch --test-only's verdict naming the option.

Golden file: tests/golden/hatches.sbatch.sh (HPCTRAIN_REGEN_GOLDEN=1 regenerates it, as in test_render.py)."""

from __future__ import annotations

import difflib
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpctrain import slurmcommands as commands
from hpctrain.cli.main import cli
from hpctrain.errors import HpcUsageError
from hpctrain.plan.planner import make_plan
from hpctrain.render.sbatch import render_sbatch, submitit_command
from hpctrain.runs.folder import append_attempt
from hpctrain.slurm import after, sbatch_check
from hpctrain.spec import sbatch_args
from hpctrain.spec.model import Code, Model, Resources, Slurm, Spec, from_toml_text, resolve, to_toml

GOLDEN = Path(__file__).parent / "golden" / "hatches.sbatch.sh"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"


pytestmark = pytest.mark.usefixtures("isolated_home")


HOSTILE_REFUSED = [
    ("--nodes=9", "hpctrain sets --nodes itself"),
    ("--node=9", "sbatch reads --node as --nodes"),  # getopt's abbreviations
    ("--out=/tmp/x", "sbatch reads --out as --output"),
    ("--signal=USR1@5", "signal_seconds"),
    ("--comment=x", "tags the submission"),
    ("--dependency=afterok:1", "--after"),
    ("--array=0-3", "--sweep"),
    ("--export=NONE", "environment"),
    ("--mail-type=ALL", "--mail-type"),
    ("--wait", "block hpctrain submit"),
    ("-p debug", "a short option"),
    ("-N3", "a short option"),
    ("exclusive", "not an option"),
    ("--exclusive --nodes=9", "a space before any '='"),
    ("--begin now", "a space before any '='"),
    ("--reservation=R --nodes=9", "second option"),
    ("--reservation=R\t-N3", "a tab"),
    ("--reservation=R\n#SBATCH --nodes=9", "newline"),
    ("--reservation=R\x00", "a NUL byte"),
    ("--Exclusive", "sbatch's style"),
    ("--", "sbatch's style"),
    ("", "empty"),
    ("--exclusive", None),  # allowed, for the pair below
]


@pytest.mark.parametrize(("text", "why"), HOSTILE_REFUSED)
def test_each_extra_is_one_option_not_owned_by_hpctrain(text: str, why: str | None) -> None:
    if why is None:
        assert sbatch_args.check_extra([text]) == [("exclusive", None)]
        return
    with pytest.raises(HpcUsageError) as exc:
        Slurm(extra=(text,))
    assert why in str(exc.value) and "slurm.extra" in str(exc.value), exc.value
    assert "Fix:" in str(exc.value)


def test_an_option_twice_is_refused_and_values_pass_through() -> None:
    with pytest.raises(HpcUsageError, match="given twice"):
        Slurm(extra=("--reservation=a", "--reservation=b"))
    odd = "--reservation=a b;$(touch /tmp/pwned)`id`'\"#x"
    assert sbatch_args.check_extra([odd]) == [("reservation", odd.partition("=")[2])]


def test_layers_merge_by_option_name_later_wins(tmp_path: Path) -> None:
    site = tmp_path / "config" / "sites"
    site.mkdir(parents=True)
    (site / "c.toml").write_text('sbatch_extra = ["--reservation=site", "--nice=5"]\n')
    run = tmp_path / "run.toml"
    run.write_text('[model]\nconfig = "llama-tiny"\n[slurm]\nextra = ["--exclusive", "--nice=7"]\n')
    spec = resolve(run, {"slurm.extra": ("--reservation=flag",)}, site="c", check=False)
    assert spec.slurm.extra == ("--exclusive", "--nice=7", "--reservation=flag")
    assert from_toml_text(to_toml(spec)) == spec


def test_typed_gres_replaces_gpus_per_node_with_the_same_count() -> None:
    ok = Spec(resources=Resources(gpus_per_node=8), model=Model(config="llama-tiny"),
              slurm=Slurm(extra=("--gres=gpu:a100:8,nvme:1",)))
    script = render_sbatch(ok, make_plan(ok), Path("/runs/r"), "python -c pass")
    assert "#SBATCH --gres=gpu:a100:8,nvme:1" in script and "--gpus-per-node" not in script
    with pytest.raises(HpcUsageError, match="asks for 4 GPU"):
        Spec(resources=Resources(gpus_per_node=8), slurm=Slurm(extra=("--gres=gpu:a100:4",)))
    with pytest.raises(HpcUsageError, match="asks for 1 GPU"):
        Spec(slurm=Slurm(extra=("--gres=gpu",)))  # CPU ranks, but a GPU asked for
    assert Spec(slurm=Slurm(extra=("--gres=nvme:1",))).slurm.extra == ("--gres=nvme:1",)


@pytest.mark.parametrize(("mail_type", "user", "why"), [
    ("END,BOGUS", "", "not a SLURM mail type"), ("END;rm", "", "not a SLURM mail type"),
    ("END", "-oProxyCommand=x", "not a mail address"), ("END", "a b@c", "not a mail address"),
    ("", "me@example.org", "sends no mail"),
])
def test_mail_is_checked_against_slurms_types(mail_type: str, user: str, why: str) -> None:
    with pytest.raises(HpcUsageError, match=why):
        Slurm(mail_type=mail_type, mail_user=user)


def test_mail_type_is_normalised() -> None:
    assert Slurm(mail_type="end, fail,time_limit_80", mail_user="me@x.org").mail_type == "END,FAIL,TIME_LIMIT_80"


def _golden_spec() -> Spec:
    return Spec(name="hatches", resources=Resources(nodes=2, time="00:10:00"), model=Model(config="llama-tiny"),
                slurm=Slurm(extra=("--exclusive", "--reservation=my res;$(id)`x`'q'#c", "--nice=10"),
                            mail_type="END,FAIL", mail_user="me+ml@example.org"),
                code=Code(snapshot=True, dir="/runs/r1/code/sub dir"))


def test_golden_render_with_every_hatch(tmp_path: Path) -> None:
    spec = _golden_spec()
    script = render_sbatch(spec, make_plan(spec), Path("/runs/r1"),
                           submitit_command("/opt/venv/bin/python", "/runs/r1/submitit"),
                           dependency="afterok:12,afterany:13_2")
    if os.environ.get("HPCTRAIN_REGEN_GOLDEN") == "1":
        GOLDEN.write_text(script, encoding="utf-8")
    expected = GOLDEN.read_text(encoding="utf-8")
    assert script == expected, "".join(difflib.unified_diff(expected.splitlines(True), script.splitlines(True)))
    header = [ln.removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH ")]
    # sbatch reads each #SBATCH line as shell words: every hatch is exactly one word, its value intact.
    words = [w for ln in header for w in shlex.split(ln, comments=False)]
    assert "--reservation=my res;$(id)`x`'q'#c" in words and "--exclusive" in words
    assert "--dependency=afterok:12,afterany:13_2" in words and "--mail-user=me+ml@example.org" in words
    assert len(words) == len(header)
    path = tmp_path / "s.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    if SHELLCHECK.exists():
        subprocess.run([str(SHELLCHECK), "-S", "warning", str(path)], check=True, timeout=60)


def test_cli_sbatch_arg_and_mail_reach_the_dry_run() -> None:
    res = CliRunner().invoke(cli, ["submit", "--model", "llama-tiny", "--dry-run", "--sbatch-arg=--exclusive",
                                   "--sbatch-arg", "--nice=3", "--mail-type", "all", "--mail-user", "me@x.org"])
    assert res.exit_code == 0, res.output
    assert "#SBATCH --exclusive\n#SBATCH --nice=3\n" in res.output and "#SBATCH --mail-type=ALL" in res.output
    res = CliRunner().invoke(cli, ["submit", "--model", "llama-tiny", "--dry-run", "--sbatch-arg=--output=/x"])
    assert res.exit_code != 0 and "hpctrain sets --output itself" in res.output


# -- sbatch --test-only: sbatch's words, naming the option --------------------------------------------------

def _fake_test_only(monkeypatch: pytest.MonkeyPatch, bad: str, message: str) -> list[str]:
    calls: list[str] = []

    def test_only(script: str) -> str:
        calls.append(script)
        if bad in script:
            err = commands.SlurmCommandError(["sbatch", "--test-only"], 1, message)
            raise commands.rejection(err.stderr) from err
        return "sbatch: Job 3 to start at now"
    monkeypatch.setattr(commands, "test_only", test_only)
    return calls


SCRIPT = "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --exclusive\n#SBATCH --licenses=x\n#SBATCH --reservation=R\n\nrun\n"


def test_a_refusal_names_the_option_from_sbatchs_words(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_test_only(monkeypatch, "--licenses", "sbatch: unrecognized option '--licenses=x'\nTry \"sbatch --help\"")
    with pytest.raises(HpcUsageError) as exc:
        sbatch_check.test_script(SCRIPT, ["--exclusive", "--licenses=x", "--reservation=R"])
    text = str(exc.value)
    assert text.startswith("slurm.extra = '--licenses=x': sbatch --test-only refused it: unrecognized option")
    assert "Try" not in text


def test_a_refusal_that_names_nothing_is_bisected(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_test_only(monkeypatch, "--licenses", "sbatch: error: Invalid license specification")
    with pytest.raises(HpcUsageError, match=r"slurm.extra = '--licenses=x'.*Invalid license specification"):
        sbatch_check.test_script(SCRIPT, ["--exclusive", "--licenses=x"])
    assert len(calls) == 4  # the script, without the extras, then with each alone until the culprit


def test_unavailable_slurm_is_not_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    def down(_script: str) -> str:
        raise commands.SlurmUnavailable("slurmctld down")
    monkeypatch.setattr(commands, "test_only", down)
    sbatch_check.test_script(SCRIPT, ["--exclusive"])
    assert not sbatch_check.needed((), "", "") and sbatch_check.needed((), "", "afterok:1")


# -- --after ----------------------------------------------------------------------------------------------

def _run_folder(tmp_path: Path, name: str, *records: dict[str, Any]) -> Path:
    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    (d / "spec.toml").write_text("")
    for r in records:
        append_attempt(d / "attempts.jsonl", r)
    return d


def test_after_parses_kinds() -> None:
    assert after.parse("last") == ("last", "ok") and after.parse("r1:any") == ("r1", "any")
    assert after.parse("/runs/a:b") == ("/runs/a:b", "ok")
    with pytest.raises(HpcUsageError, match="no run named"):
        after.parse(":ok")


def test_after_waits_on_the_latest_attempts_job(tmp_path: Path) -> None:
    d = _run_folder(tmp_path, "r1", {"attempt": 0, "job_id": "11", "state": "FAILED", "executor": "slurm"},
                    {"attempt": 1, "job_id": "12", "state": "PENDING", "executor": "slurm"})
    w = after._wait("r1", "ok", d, None)
    assert (w.job_id, w.item) == ("12", "afterok:12")
    assert after.dependency([w, after._wait("r1:any", "any", d, None)]) == "afterok:12,afterany:12"


@pytest.mark.parametrize(("records", "kind", "why"), [
    ([{"attempt": 0, "job_id": "11", "state": "FAILED", "executor": "slurm"}], "ok", "already ended FAILED"),
    ([{"attempt": 0, "job_id": "", "state": "SUBMIT_UNKNOWN", "executor": "slurm"}], "ok", "no SLURM job id"),
    ([{"attempt": 0, "job_id": "4242", "state": "RUNNING", "executor": "local"}], "any", "local executor"),
    ([], "ok", "no SLURM job id"),
])
def test_after_refuses_what_slurm_cannot_wait_for(tmp_path: Path, records: list[dict[str, Any]], kind: str,
                                                  why: str) -> None:
    d = _run_folder(tmp_path, "r2", *records)
    with pytest.raises(HpcUsageError, match=why):
        after._wait("r2", kind, d, None)


def test_after_a_run_that_ended_well_adds_no_dependency(tmp_path: Path) -> None:
    d = _run_folder(tmp_path, "r3", {"attempt": 0, "job_id": "11", "state": "COMPLETED", "executor": "slurm"})
    w = after._wait("r3", "ok", d, None)
    assert w.item == "" and "already ended COMPLETED" in w.note
    failed = _run_folder(tmp_path, "r4", {"attempt": 0, "job_id": "9", "state": "TIMEOUT", "executor": "slurm"})
    assert after._wait("r4:any", "any", failed, None).item == ""


def test_after_unknown_run_is_refused_by_the_cli() -> None:
    res = CliRunner().invoke(cli, ["submit", "--model", "llama-tiny", "--dry-run", "--after", "nosuch"])
    assert res.exit_code != 0 and "RUN = 'nosuch'" in res.output


@pytest.mark.parametrize("runtime", ["podman", "apptainer", "charliecloud", "pyxis"])
def test_a_snapshot_is_the_containers_folder_too(runtime: str) -> None:
    from hpctrain.spec.model import Container

    image = "/images/x.sif" if runtime != "podman" else "localhost/x:1"
    spec = Spec(model=Model(config="llama-tiny"), container=Container(runtime=runtime, image=image),  # type: ignore[arg-type]
                code=Code(snapshot=True, dir="/runs/r1/code/sub"))
    line = render_sbatch(spec, make_plan(spec), Path("/runs/r1"), "python -c pass").rstrip().splitlines()[-1]
    flag = {"podman": "-w /runs/r1/code/sub", "apptainer": "--pwd /runs/r1/code/sub",
            "charliecloud": "-c /runs/r1/code/sub", "pyxis": "--container-workdir=/runs/r1/code/sub"}[runtime]
    assert flag in line, line
    assert ("--env PYTHONPATH" in line) == (runtime == "podman")


def test_a_refusal_without_the_hatches_is_left_to_the_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_test_only(monkeypatch, "--nodes=1", "sbatch: error: Invalid partition name specified")
    sbatch_check.test_script(SCRIPT, ["--exclusive"])  # dispatch's own refusal lists the partitions
    assert len(calls) == 2
