"""hpctrain.remote without a network: the ssh/rsync command lines (golden), quoting of hostile words through a
real shell, the [remote] table's refusals, the one-line failures, what a submit carries and its size limit.

The whole loop through a real sshd on the test cluster's login node is tests/test_remote_slurm.py.
Regenerate the golden file after an intended change: HPCTRAIN_REGEN_GOLDEN=1 .venv/bin/pytest -q tests/test_remote.py
"""

from __future__ import annotations

import difflib
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from hpctrain.errors import HpcUsageError
from hpctrain.remote import forward, ssh, travel
from hpctrain.remote.site import Remote, remote_of

GOLDEN = Path(__file__).parent / "golden" / "remote-commands.txt"
HOSTILE = ["a b", "it's", '"q"', "$(touch /tmp/pwned-hpctrain)", "`id`", "x;y", "--opt", "ü\tnewline\nend", "*"]
SOCKET = Path("/run/user/1000/hpctrain-ssh/0123456789abcdef")


def _remote(**kw: object) -> Remote:
    base: dict[str, object] = {"site": "lab", "host": "alice@login.cluster", "port": 2222,
                               "remote_dir": "/scratch/alice/hpc train", "hpctrain": "~/venv/bin/hpctrain",
                               "env": {"HPCTRAIN_STATE_DIR": "/scratch/alice/state"}}
    return Remote(**{**base, **kw})  # type: ignore[arg-type]


def test_command_lines_golden() -> None:
    r = _remote(ssh_config="/home/alice/.ssh/cluster config")
    lines = [
        "ssh: " + shlex.join(ssh.ssh_argv(r, SOCKET, ssh.remote_shell(r, ["status", "tiny-1", "--json"]))),
        "ssh -t: " + shlex.join(ssh.ssh_argv(r, SOCKET, "true", tty=True)),
        "check: " + shlex.join(ssh.check_argv(r, SOCKET)),
        "exit: " + shlex.join(ssh.exit_argv(r, SOCKET)),
        "up: " + shlex.join(ssh.rsync_up_argv(r, SOCKET, ["/home/alice/proj/run.toml"], "/scratch/u/1", [".git"],
                                              "/scratch/u/0")),
        "down: " + shlex.join(ssh.rsync_down_argv(r, SOCKET, "runs/tiny-1", "runs/tiny-1", ["checkpoints/"])),
        "submit: " + forward.detached_submit(r, ["submit", "run.toml"], "/scratch/u/1/home/alice", "/scratch/u/1"),
        "answer: " + forward.answer_line("/scratch/u/1"),
        "probe: " + ssh.probe_shell(r),
        "setup: " + ssh.setup_shell(r, "hpctrain==0.1.0"),
        "setup offline: " + ssh.setup_shell(r, "hpctrain==0.1.0", "/opt/py 3/bin/python3", "wheels/home/a/wh", True),
        "forward: " + shlex.join(ssh.forward_argv(r, SOCKET, f"{SOCKET}.k.srv",
                                                  "/scratch/alice/hpc train/.serve/k.sock")),
    ]
    text = "\n".join(lines) + "\n"
    if os.environ.get("HPCTRAIN_REGEN_GOLDEN") or not GOLDEN.exists():
        GOLDEN.write_text(text, encoding="utf-8")
    expected = GOLDEN.read_text(encoding="utf-8")
    assert expected == text, "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True)))


def test_every_option_on_the_shared_connection_and_no_prompt() -> None:
    argv = ssh.ssh_argv(_remote(), SOCKET, "true")
    opts = {argv[i + 1] for i, a in enumerate(argv) if a == "-o"}
    assert {"ControlMaster=auto", f"ControlPath={SOCKET}", "ControlPersist=10m", "BatchMode=yes"} <= opts
    assert argv[-3:] == ["alice@login.cluster", "--", "true"]


def test_hostile_words_reach_hpctrain_unchanged(tmp_path: Path) -> None:
    """The remote line run by a real sh: hpctrain (here a script printing its argv) gets every word as typed,
    in a remote_dir and cwd with hostile names, and nothing is executed."""
    fake = tmp_path / "bin it's" / "hpctrain"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                    "print(json.dumps([sys.argv[1:], os.getcwd(), os.environ['HPCTRAIN_RUNS_DIR'], "
                    "os.environ['HPCTRAIN_ON_LOGIN'], os.environ['X']]))\n")
    fake.chmod(0o755)
    rdir = tmp_path / "remote $(x) 'dir'"
    cwd = f"{rdir}/up load/`id`"
    os.makedirs(cwd)
    r = _remote(remote_dir=str(rdir), hpctrain=shlex.quote(str(fake)), env={"X": "$HOME `id` 'q'"})
    out = subprocess.run(["sh", "-c", ssh.remote_shell(r, HOSTILE, cwd)], capture_output=True, text=True,
                         check=True, timeout=30)
    import json

    args, where, runs, on_login, x = json.loads(out.stdout)
    assert args == HOSTILE and where == cwd and runs == f"{rdir}/runs" and on_login == "1"
    assert x == "$HOME `id` 'q'"
    assert not Path("/tmp/pwned-hpctrain").exists()


def test_remote_table_refusals() -> None:
    assert remote_of("lab", {"partition": "debug"}) is None
    r = remote_of("lab", {"remote": {"host": "login", "port": 22, "env": {"A": 1}}})
    assert r is not None and r.env == {"A": "1"} and r.remote_dir == "hpctrain"
    for table, words in [({"host": "login", "hots": 1}, "did you mean 'host'"),
                         ({"host": "-oProxyCommand=x"}, "not a host ssh can be given"),
                         ({"host": "login", "port": 70000}, "not a TCP port"),
                         ({"host": "login", "persist": "forever"}, "ControlPersist"),
                         ({"host": "login", "remote_dir": "~/x"}, "remote_dir"),
                         ({"host": "login", "port": "22"}, "wrong type"),
                         ({"host": "login", "max_upload_mb": 0}, "must be positive")]:
        with pytest.raises(HpcUsageError, match=r"(?i)" + words.replace("(", r"\(")):
            remote_of("lab", {"remote": table})


def test_site_profile_with_remote_still_resolves(tmp_path: Path) -> None:
    from hpctrain.spec.model import resolve

    site = tmp_path / "lab.toml"
    site.write_text('partition = "debug"\n[remote]\nhost = "login"\n')
    spec = resolve(None, {"model.config": "llama-tiny"}, str(site), check=False)
    assert spec.resources.partition == "debug"


@pytest.mark.parametrize(("rc", "stderr", "words"), [
    (255, "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.", "ssh-keygen -R"),
    (255, "root@10.77.0.200: Permission denied (publickey).", "ssh-add"),
    (127, "env: 'hpctrain': No such file or directory", "hpctrain remote setup"),
    (1, "mkdir: cannot create directory 'x': No space left on device", "disk is full"),
    (255, "client_loop: send disconnect: Broken pipe", "never queued twice"),
    (12, "rsync: connection unexpectedly closed (0 bytes received so far) [sender]", "failed or dropped"),
    (12, "bash: line 1: rsync: command not found\nrsync: connection unexpectedly closed", "no rsync on"),
])
def test_failures_are_one_line_with_cause_and_fix(rc: int, stderr: str, words: str) -> None:
    msg = ssh.failure(_remote(), rc, stderr, "hpctrain status on alice@login.cluster")
    assert msg is not None and "\n" not in msg and "Fix:" in msg and words in msg


def test_remote_hpctrain_own_error_passes_through() -> None:
    assert ssh.failure(_remote(), 2, "Error: run 'x' not found", "status") is None


def test_control_dir_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "cm"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(ssh.CONTROL_DIR_ENV, str(shared))
    with pytest.raises(HpcUsageError, match="not a folder private to you"):
        ssh.control_dir()
    monkeypatch.setenv(ssh.CONTROL_DIR_ENV, str(tmp_path / "new"))
    assert ssh.control_dir().stat().st_mode & 0o777 == 0o700


def test_what_travels_and_the_size_limit(tmp_path: Path) -> None:
    code = tmp_path / "code"
    (code / ".git").mkdir(parents=True)
    (code / ".git" / "big").write_bytes(b"x" * 5000)
    (code / "train.py").write_text("print(1)\n")
    (code / ".env").write_text("HF_TOKEN=secret\n")
    (code / "util.py").write_text("x = 1\n")
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"{}\n" * 100)
    run = tmp_path / "run.toml"
    run.write_text("name = 'x'\n")
    items = travel.local_items(str(run), None, {"launch.script": str(code / "train.py"), "data.source": str(data),
                                                "model.path": "/cluster/only/model", "model.config": "llama-tiny"})
    assert [(i.key, i.path.name) for i in items] == [("", "run.toml"), ("launch.script", "code"),
                                                    ("data.source", "data.jsonl")]
    assert [f.name for f in travel.files_of(code)] == ["train.py", "util.py"]  # no .git, no .env
    travel.check_size(_remote(max_upload_mb=1), items)
    with pytest.raises(HpcUsageError, match=r"data\.source = .*data\.jsonl.*max_upload_mb.*put it on the cluster"):
        travel.check_size(_remote(max_upload_mb=0.0002), items)
    assert travel.mirrored("/s/u1", "/home/a b/x") == "/s/u1/home/a b/x"
    assert travel.digest(["a"], items) != travel.digest(["b"], items)


def test_answer_of_a_detached_submit(tmp_path: Path) -> None:
    """What the laptop reads back after a dropped connection, through a real sh."""
    def answer(stage: Path) -> str:
        return subprocess.run(["sh", "-c", forward.answer_line(str(stage))], capture_output=True, text=True,
                              check=True, timeout=30).stdout

    stage = tmp_path / "up 'load'"
    assert answer(stage) == "never\n"  # the upload folder was never made
    stage.mkdir()
    assert answer(stage) == "never\n"  # the submit line never started
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (stage / "pid").write_text(f"{sleeper.pid}\n")
        assert answer(stage) == "running\n"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert answer(stage) == "lost\n"  # started, stopped, no answer: the outcome is unknown
    (stage / "out").write_text('[{"run_id": "r"}]\n')
    (stage / "rc").write_text("0\n")
    assert answer(stage) == 'done 0\n[{"run_id": "r"}]\n'


def test_which_commands_go_to_the_login_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decided before any connection: plan runs here, a site without [remote] is refused for --remote, a
    command that needs the login node's own files is refused with where to run it."""
    from click.testing import CliRunner

    from hpctrain.cli.main import cli

    monkeypatch.setenv(ssh.CONTROL_DIR_ENV, str(tmp_path / "cm"))
    monkeypatch.delenv("HPCTRAIN_REMOTE", raising=False)
    monkeypatch.delenv(ssh.ON_LOGIN, raising=False)
    lab = tmp_path / "lab.toml"
    lab.write_text('partition = "debug"\n[remote]\nhost = "nobody@host.invalid"\n')
    plain = tmp_path / "plain.toml"
    plain.write_text('partition = "debug"\n')
    run = CliRunner().invoke
    res = run(cli, ["--remote", str(lab), "plan", "--model", "llama-tiny", "--json"])
    assert res.exit_code == 0 and '"world_size"' in res.output, res.output
    res = run(cli, ["--remote", str(plain), "list"])
    assert res.exit_code == 2 and "has no [remote] table" in res.output
    res = run(cli, ["--remote", str(lab), "data", "prepare", "x"])
    assert res.exit_code == 2 and "runs on the login node only" in res.output
    assert "ssh nobody@host.invalid" in res.output
    res = run(cli, ["--remote", str(lab), "list"], env={ssh.ON_LOGIN: "1", "HPCTRAIN_STATE_DIR": str(tmp_path / "s")})
    assert res.exit_code == 0, res.output  # on the login node the [remote] is not followed again


def test_no_ssh_on_this_machine_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither ssh nor rsync to be found
    monkeypatch.setenv(ssh.CONTROL_DIR_ENV, str(tmp_path / "cm"))
    with pytest.raises(forward.RemoteFailure, match=r"no `ssh` on this machine.*Fix: install"):
        forward.Connection(_remote()).probe()


@pytest.mark.parametrize(("rc", "stderr", "words"), [
    (ssh.SETUP_NO_PYTHON, "", "no 'py3' on alice@login.cluster. Fix: give --python"),
    (ssh.SETUP_OLD_PYTHON, "", "older than Python 3.10"),
    (ssh.SETUP_NO_VENV, "The virtual environment was not created successfully because ensurepip is not\navailable.",
     "apt-get install python3-venv"),
    (ssh.SETUP_PIP, "ERROR: No matching distribution found for click>=8.1", "No matching distribution found for click"),
])
def test_setup_failures_are_one_line(rc: int, stderr: str, words: str) -> None:
    text = ssh.setup_failure(_remote(), rc, stderr, "py3", "hpctrain==0.1.0", offline=True)
    assert text is not None and words in text and "Fix:" in text and "\n" not in text
    assert ssh.setup_failure(_remote(), 1, "", "py3", "hpctrain==0.1.0", offline=False) is None


@pytest.mark.parametrize("free_kb, full", [("0", True), ("12", True), ("4096", False), ("df: no such dir", False)])
def test_an_upload_that_fails_without_a_reason_asks_the_disk(monkeypatch: pytest.MonkeyPatch, free_kb: str,
                                                              full: bool) -> None:
    """rsync's rc 11 with an empty stderr (the receiver's "No space left on device" lost on the way): the login
    node's free space under remote_dir decides whether the one line says the disk is full."""
    conn = forward.Connection(_remote(site="small", remote_dir="/scratch/it's full"))
    asked: list[str] = []

    def shell(line: str, what: str, **kw: object) -> subprocess.CompletedProcess[str]:
        asked.append(line)
        return subprocess.CompletedProcess(line, 0, stdout=f"{free_kb}\n", stderr="")

    monkeypatch.setattr(conn, "shell", shell)
    with pytest.raises(forward.RemoteFailure) as exc:
        conn.rsync(["sh", "-c", "exit 11"], "upload to login")
    assert asked == [ssh.df_line(conn.remote)] and shlex.quote("/scratch/it's full") in asked[0]
    if full:
        assert str(exc.value) == ssh.disk_full(conn.remote, "upload to login")
        assert "sites.small.remote.remote_dir" in str(exc.value) and "Fix:" in str(exc.value)
    else:
        assert str(exc.value).startswith("upload to login: rsync failed (rc 11)")
