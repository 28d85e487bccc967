"""CLI: bad input gives one clear message and exit != 0; dry runs write files and submit nothing;
real submits create the run folder atomically and clean up after a refusal; imports stay light."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hpctrain.cli.main import cli
from hpctrain.errors import HpcUsageError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.fixture
def no_dispatch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace dispatch.submit with a recorder (the real one is tested in test_dispatch.py)."""
    from hpctrain.slurm import dispatch

    calls: list[Any] = []

    def fake_submit(run_dirs: list[Path], spec: Any, plan: Any, executor: str = "auto", mode: str = "train",
                    dependency: str = "", **_: Any) -> list[Any]:
        calls.append((run_dirs, spec, plan, executor, mode))
        return [dispatch.Submitted(run_id=d.name, run_dir=d, job_id=str(100 + i), executor="local")
                for i, d in enumerate(run_dirs)]

    monkeypatch.setattr(dispatch, "submit", fake_submit)
    return calls


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


TINY = ["--model", "llama-tiny"]


@pytest.mark.parametrize("args, field, value", [
    (["--zero", "5"], "--zero", "5"),
    (["--nodes", "0"], "resources.nodes", "0"),
    (["--micro-batch", "2", "--grad-accum", "3", "--global-batch", "10"], "train.global_batch", "10"),
    (["--gpus-per-node", "6", "--tp", "4"], "parallel.tp*pp", "4"),
    (["--site", "nosuch"], "site", "'nosuch'"),
    (["--set", "train.nope=1"], "[train]", "'nope'"),
    (["--container", "docker:img"], "--container", "docker:img"),
    (["--time", "1 day"], "resources.time", "'1 day'"),
])
@pytest.mark.parametrize("command", ["plan", "submit"])
def test_bad_flags_one_message(command: str, args: list[str], field: str, value: str, no_dispatch: list[Any]) -> None:
    res = invoke(command, *TINY, *args, *(["--dry-run"] if command == "submit" else []))
    assert res.exit_code != 0
    assert field in res.output and value in res.output, res.output
    if command == "submit" or field != "--zero":  # click's own Choice message for --zero lists the choices
        assert "Fix" in res.output or "is not one of" in res.output
    assert res.output.count("Error") == 1 and "Traceback" not in res.output
    assert no_dispatch == []


def test_bad_run_file_values(tmp_path: Path, no_dispatch: list[Any]) -> None:
    run = write(tmp_path / "r.toml", '[model]\nconfig = "llama-tiny"\n[parallel]\nzero = 5\n')
    res = invoke("submit", run)
    assert res.exit_code != 0 and "parallel.zero = 5" in res.output and "Fix:" in res.output
    run = write(tmp_path / "r2.toml", '[model]\nconfig = "llama-tiny"\n[parallel]\nzreo = 3\n')
    res = invoke("submit", run)
    assert res.exit_code != 0 and "'zreo'" in res.output and "did you mean 'zero'" in res.output
    res = invoke("submit", "--model", str(tmp_path / "no-such-model"))
    assert res.exit_code != 0 and "model.path" in res.output and "no-such-model" in res.output and "Fix:" in res.output
    assert no_dispatch == [] and not (tmp_path / "runs").exists()


def test_dry_run_out_writes_files_and_prints_script(tmp_path: Path, no_dispatch: list[Any]) -> None:
    out = tmp_path / "preview"
    res = invoke("submit", str(EXAMPLES / "tiny.toml"), "--dry-run", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert res.output.startswith("#!/bin/bash") and "#SBATCH --ntasks-per-node=2" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["ds_config.json", "plan.json", "sbatch.sh", "spec.toml"]
    assert (out / "sbatch.sh").read_text() == res.output
    assert json.loads((out / "plan.json").read_text())["world_size"] == 2
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8 and ds["zero_optimization"]["stage"] == 3
    from hpctrain.spec.model import read_resolved

    assert read_resolved(out).checkpoint.every_steps == 5
    assert no_dispatch == []


def test_dry_run_json_and_sweep(tmp_path: Path, no_dispatch: list[Any]) -> None:
    res = invoke("submit", str(EXAMPLES / "tiny.toml"), "--dry-run", "--json", "--sweep", "train.lr=1e-4,3e-4",
                 "--out", str(tmp_path / "sw"))
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert len(data["run_dirs"]) == 2 and "#SBATCH --array=0-1" in data["sbatch"]
    assert [c["optimizer"]["params"]["lr"] for c in data["ds_configs"]] == [1e-4, 3e-4]
    assert (tmp_path / "sw" / "point-1" / "spec.toml").read_text().count("lr = 0.0003") == 1
    res = invoke("submit", *TINY, "--dry-run", "--sweep", "resources.nodes=1,2")
    assert res.exit_code != 0 and "one allocation shape" in res.output


def test_submit_creates_private_run_folder(tmp_path: Path, no_dispatch: list[Any],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_thisIsASecretTokenValue123456")
    res = invoke("submit", str(EXAMPLES / "tiny.toml"), "--executor", "local", "--json")
    assert res.exit_code == 0, res.output
    [(run_dirs, _spec, plan, executor, mode)] = no_dispatch
    assert executor == "local" and mode == "train" and plan.world_size == 2
    run = run_dirs[0]
    assert run.parent == tmp_path / "runs" and stat.S_IMODE(run.stat().st_mode) == 0o700
    for name in ("spec.toml", "plan.json", "ds_config.json", "sbatch.sh", "submitit", "logs", "metrics", "checkpoints"):
        assert (run / name).exists(), name
    for path in run.rglob("*"):
        if path.is_file():
            assert "hf_thisIsASecret" not in path.read_text()
    assert json.loads(res.output)[0]["job_id"] == "100"
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_submit_preflight_mode(no_dispatch: list[Any]) -> None:
    res = invoke("submit", *TINY, "--preflight")
    assert res.exit_code == 0, res.output
    assert no_dispatch[0][4] == "preflight"


def test_dispatch_refusal_removes_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.slurm import dispatch

    def refuse(*_a: Any, **_k: Any) -> list[Any]:
        raise HpcUsageError("resources.partition = 'nope': sbatch rejected the job. Fix: use debug")

    monkeypatch.setattr(dispatch, "submit", refuse)
    res = invoke("submit", *TINY, "--partition", "nope")
    assert res.exit_code != 0 and "resources.partition = 'nope'" in res.output
    assert list((tmp_path / "runs").glob("*")) == []  # the runs folder too, when the submission made it


def test_sweep_submit_is_one_dispatch_call(no_dispatch: list[Any]) -> None:
    res = invoke("submit", *TINY, "--sweep", "train.seed=1,2,3")
    assert res.exit_code == 0, res.output
    assert len(no_dispatch) == 1 and len(no_dispatch[0][0]) == 3


def test_plan_outputs() -> None:
    res = invoke("plan", str(EXAMPLES / "tiny.toml"))
    assert res.exit_code == 0 and "world size" in res.output and "<- chosen" in res.output
    res = invoke("plan", str(EXAMPLES / "tiny.toml"), "--json", "--zero", "auto")
    data = json.loads(res.output)
    assert data["zero_stage"] == 0 and data["dp"] == 2


@pytest.mark.parametrize("example", ["tiny.toml", "finetune-offload.toml", "pretrain-multinode.toml"])
def test_examples_plan(example: str) -> None:
    extra = ["--model", "llama-1b"] if example.startswith("finetune") else []
    res = invoke("plan", str(EXAMPLES / example), "--json", *extra)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    if example.startswith("finetune"):
        assert (data["global_batch"], data["grad_accum"], data["offload"]) == (4, 4, "optimizer")
    if example.startswith("pretrain"):
        assert (data["world_size"], data["grad_accum"], data["zero_stage"]) == (32, 4, 3)


def test_set_and_flags_reach_the_spec(tmp_path: Path, no_dispatch: list[Any]) -> None:
    out = tmp_path / "o"
    res = invoke("submit", *TINY, "--dry-run", "--out", str(out), "--set", "env.NCCL_DEBUG=INFO",
                 "--set", "train.lr=1e-4", "--container", "apptainer:/img.sif", "--launcher", "deepspeed",
                 "--activation-checkpointing", "--job-name", "my run")
    assert res.exit_code == 0, res.output
    from hpctrain.spec.model import read_resolved

    spec = read_resolved(out)
    assert spec.env["NCCL_DEBUG"] == "INFO" and spec.train.lr == 1e-4 and spec.name == "my run"
    assert spec.container.runtime == "apptainer" and spec.train.activation_checkpointing
    assert "export NCCL_DEBUG=INFO" in res.output and "apptainer exec" in res.output


def test_hostfile_command() -> None:
    res = invoke("hostfile", "--nodelist", "node[1-3],gpu[08-09]", "--slots", "8")
    assert res.exit_code == 0
    assert res.output == "".join(f"{h} slots=8\n" for h in ("node1", "node2", "node3", "gpu08", "gpu09"))
    res = invoke("hostfile", "--nodelist", "node[1-2],node1", "--slots", "8")
    assert res.exit_code != 0 and "listed twice" in res.output


def test_cli_import_stays_light() -> None:
    code = ("import sys, hpctrain.cli.main; heavy = ('torch', 'deepspeed', 'transformers', 'submitit', 'datasets', "
            "'jinja2', 'rich', 'numpy'); print([m for m in heavy if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sweep_over_paths_in_container_refused(tmp_path: Path) -> None:
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    res = invoke("submit", *TINY, "--dry-run", "--container", "apptainer:/i.sif",
                 "--sweep", f"data.source={tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}")
    assert res.exit_code != 0 and "container mounts" in res.output


def test_submitit_command_matches_submitit(tmp_path: Path) -> None:
    import shlex

    import submitit

    from hpctrain.render.sbatch import submitit_command

    folder = tmp_path / "we'ird dir" / "submitit"
    ex = submitit.SlurmExecutor(folder=folder)
    assert ex._submitit_command_str == submitit_command(shlex.quote(sys.executable), str(folder))


def test_site_profile_from_config_dir_with_template_override(tmp_path: Path) -> None:
    tpl = tmp_path / "tpl"
    tpl.mkdir()
    (tpl / "sbatch.sh.j2").write_text("#!/bin/bash\n# site template for {{ name|shquote }}\n{{ launch_line }}\n")
    sites = tmp_path / "config" / "sites"
    sites.mkdir(parents=True)
    (sites / "lab.toml").write_text(f'partition = "debug"\nmodules = ["gcc/12"]\ntemplate_dir = "{tpl}"\n'
                                    '[env]\nNCCL_DEBUG = "INFO"\n')
    res = invoke("submit", *TINY, "--site", "lab", "--dry-run", "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    assert res.output.startswith("#!/bin/bash\n# site template for hpctrain\nsrun ")
    from hpctrain.spec.model import read_resolved

    spec = read_resolved(tmp_path / "o")
    assert (spec.site, spec.resources.partition, spec.launch.modules) == ("lab", "debug", ("gcc/12",))
    assert spec.env == {"NCCL_DEBUG": "INFO"}


def test_secret_in_env_flag_refused_without_echoing_it() -> None:
    res = invoke("plan", *TINY, "--set", "env.HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz123456")
    assert res.exit_code != 0 and "secret_env" in res.output and "hf_abcdefghijklmnop" not in res.output


def test_tensor_parallel_renders_autotp_and_plans() -> None:
    """The node trains tp > 1 through DeepSpeed AutoTP (tests/test_node_train.py), so submit renders it."""
    res = invoke("submit", *TINY, "--gpus-per-node", "2", "--tp", "2", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ds_configs"][0]["tensor_parallel"]["autotp_size"] == 2
    res = invoke("plan", *TINY, "--gpus-per-node", "2", "--tp", "2", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["tp"] == 2


# -- one flag <-> spec-key table (hpctrain.spec.flags) -------------------------------------------------

def test_flag_table_drives_options_hints_and_docs() -> None:
    """Every flag in the table is an option of plan/submit, sets its key, is named in that key's refusal
    hint, is in docs/flags.md; a key without a flag is hinted as --set."""
    import typing

    from hpctrain.spec import model as S
    from hpctrain.spec.flags import FLAGS, markdown_table
    from hpctrain.spec.rules import how_to_set

    help_text = invoke("submit", "--help").output
    for f in FLAGS:
        assert f.flag in help_text, f.flag
        assert how_to_set(f.key, 1).startswith(f"pass {f.flag} 1 "), f.key
        section, _, name = f.key.rpartition(".")
        cls = getattr(S, section.capitalize()) if section else S.Spec
        hint = typing.get_type_hints(cls)[name]  # the key exists, and a choice lists the spec's own words
        if typing.get_origin(hint) is typing.Literal:
            assert f.kind == typing.get_args(hint), f.key
        elif isinstance(f.kind, tuple):  # ZeRO: int | Literal["auto"]
            assert set(f.kind) == {"0", "1", "2", "3", "auto"} and f.key == "parallel.zero"
    assert how_to_set("launch.hang_timeout_s", 300) == (
        "pass --set launch.hang_timeout_s=300 or set [launch] hang_timeout_s = 300 in the run file")
    docs = (Path(__file__).resolve().parents[1] / "docs" / "flags.md").read_text(encoding="utf-8")
    assert markdown_table() in docs, "docs/flags.md is stale: regenerate its table from spec.flags.markdown_table()"


# --------------------------------------------------------------------------------------------------
# Option injection, for every container runtime; paths that SLURM or submitit read specially; template_dir

IMAGE_FOR = {"apptainer": "/i.sif", "pyxis": "nvcr.io#nvidia/pytorch:24.05-py3", "podman": "localhost/x:1",
             "charliecloud": "/var/tmp/img"}


@pytest.mark.parametrize("runtime", ["none", "apptainer", "pyxis", "podman", "charliecloud"])
@pytest.mark.parametrize(("args", "field"), [
    (["--container", "{rt}:--privileged"], "container.image"),
    (["--set", "container.mounts=--privileged"], "container.mounts"),
    (["--set", "container.mounts=/scratch:-v"], "container.mounts"),
    (["--set", "launch.modules=-purge"], "launch.modules"),
    (["--model=--help"], "model.path"),
    (["--data=-x"], "data.source"),
    (["--set", "data.tokenizer=--tok"], "data.tokenizer"),
])
def test_leading_dash_refused_for_every_runtime(runtime: str, args: list[str], field: str,
                                                no_dispatch: list[Any]) -> None:
    """`--container podman:--privileged` put --privileged on the podman line; every value that becomes a command
    argument is refused with a leading '-', whatever the runtime, at plan, dry run and submit."""
    if field.startswith("container.") and runtime == "none":
        pytest.skip("no container: no image or mounts")
    container = [] if runtime == "none" else ["--container", f"{runtime}:{IMAGE_FOR[runtime]}"]
    args = [a.replace("{rt}", runtime) for a in args]
    model = [] if field == "model.path" else TINY
    for command in (["plan"], ["submit", "--dry-run"], ["submit"]):
        res = invoke(*command, *model, *container, *args)
        assert res.exit_code != 0 and f"Error: {field} = " in res.output and "starts with '-'" in res.output, \
            res.output
    assert no_dispatch == []


@pytest.mark.parametrize(("where", "odd", "why"), [
    ("HPCTRAIN_RUNS_DIR", "runs %a", "%a"), ("HPCTRAIN_RUNS_DIR", "runs-%j", "%j"),
    ("HPCTRAIN_RUNS_DIR", "back\\slash", "backslash"), ("--out", "out %A", "%A"), ("--out", "o\\ut", "backslash"),
])
def test_runs_dir_and_out_refused_when_slurm_or_submitit_would_misread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, odd: str, why: str,
        no_dispatch: list[Any]) -> None:
    """submitit refuses %a outside an array (and replaces %j/%t/%A in its folder); `set -u` killed the job on
    ${SLURM_ARRAY_TASK_ID}; sbatch drops a backslash. The same refusal at submit and at --dry-run."""
    path = tmp_path / odd
    if where == "HPCTRAIN_RUNS_DIR":
        monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(path))
        attempts = [["submit", *TINY], ["submit", *TINY, "--dry-run"]]
    else:
        attempts = [["submit", *TINY, "--dry-run", "--out", str(path)]]
    for args in attempts:
        res = invoke(*args)
        assert res.exit_code != 0 and f"Error: {where} = " in res.output and why in res.output, res.output
        assert "Fix: " in res.output and "Traceback" not in res.output
    assert not path.exists() and no_dispatch == []


def test_runs_dir_with_percent_space_and_quote_renders_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               no_dispatch: list[Any]) -> None:
    runs = tmp_path / "50% it's ü"
    monkeypatch.setenv("HPCTRAIN_RUNS_DIR", str(runs))
    res = invoke("submit", *TINY, "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    (run_dir,) = data["run_dirs"]
    assert run_dir.startswith(str(runs) + "/")
    output = next(ln for ln in data["sbatch"].splitlines() if ln.startswith("#SBATCH --output="))
    assert "50%% it" in output and "%j_0_log.out" in output
    res = invoke("submit", *TINY)
    assert res.exit_code == 0, res.output
    (call,) = no_dispatch
    assert call[0][0].parent == runs.absolute()


def test_missing_template_dir_in_site_profile_is_refused(tmp_path: Path, no_dispatch: list[Any]) -> None:
    sites = tmp_path / "config" / "sites"
    sites.mkdir(parents=True)
    (sites / "lab.toml").write_text(f'template_dir = "{tmp_path / "no-such-templates"}"\n')
    for args in (["submit", "--dry-run"], ["submit"]):
        res = invoke(*args, *TINY, "--site", "lab")
        assert res.exit_code != 0 and "Error: launch.template_dir = " in res.output and "not a folder" in res.output
        assert "no-such-templates" in res.output and "Traceback" not in res.output
    assert no_dispatch == [] and not (tmp_path / "runs").exists()
