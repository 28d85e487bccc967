"""From a laptop, for real: the root namespace drives hpctrain through a real OpenSSH server (Debian's sshd,
key-only auth) on a login node of the test cluster in its own network namespace (tests/cluster/login_sshd.sh),
and the login node's hpctrain submits to the real SLURM cluster.

One sshd for the module, one tiny run for the loop (submit, status --watch with and without a terminal, logs
and logs --follow, summary --plot fetched back, stacks, sync, export, pull, list, cancel, resubmit), all but the
first through the login node's hpctrain server (hpctrain.remote.serve) that the first started; the server
restarted when it died or hpctrain changed; `hpctrain remote setup` installing hpctrain from uploaded wheels;
then the failures: a missing remote hpctrain, a key the server refuses (BatchMode: no prompt), sshd killed in
the middle of a submit (found again, never queued twice), a changed host key.

Another namespace, veth and address for the login node (LOGIN_NS, LOGIN_VETH, LOGIN_IP of login_sshd.sh) let a
second run of this module share the machine with the first.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, run_cmd, wait_until
from hpctrain.remote import serve as serve_module

pytestmark = pytest.mark.slurm
SSHD_SH = REPO / "tests" / "cluster" / "login_sshd.sh"
HPCTRAIN = str(Path(sys.executable).parent / "hpctrain")
RUN_FILE = """name = "remote-tiny"
[resources]
nodes = 1
gpus_per_node = 0
tasks_per_node = 2
cpus_per_task = 1
time = "00:10:00"
[model]
config = "llama-tiny"
[data]
source = "synthetic"
seq_len = 32
[train]
steps = 4
micro_batch = 1
grad_accum = 1
[parallel]
zero = 2
[checkpoint]
every_steps = 2
"""


@dataclass(frozen=True)
class Laptop:
    """The root namespace as a laptop: its project folder (a hostile name), site file and environment."""

    login: Path  # login_sshd.sh's folder: keys, sshd_config, ssh_config, sshd.log
    project: Path
    remote_dir: Path
    env: dict[str, str]

    def site(self, name: str = "lab", **remote: str) -> Path:
        keys = {"host": "login", "ssh_config": str(self.login / "ssh_config"), "remote_dir": str(self.remote_dir),
                "hpctrain": HPCTRAIN, **remote}
        lines = ['partition = "debug"', "[remote]", *(f"{k} = {json.dumps(v)}" for k, v in keys.items()),
                 "[remote.env]", f'HPCTRAIN_STATE_DIR = "{self.remote_dir}/state"']
        path = self.project / f"{name}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def hpctrain(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([HPCTRAIN, *args], cwd=self.project, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)

    def accepted(self) -> int:
        """Connections sshd accepted so far (one per shared connection, not one per command)."""
        log = self.login / "sshd.log"
        return log.read_text(errors="replace").count("Accepted publickey") if log.exists() else 0


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Laptop]:
    if not Path("/usr/sbin/sshd").exists():
        pytest.fail("no /usr/sbin/sshd: run `bash tests/cluster/login_sshd.sh install` (make install-system does)")
    base = tmp_path_factory.mktemp("remote")
    login = base / "login"
    run_cmd(["bash", SSHD_SH, "up", login], timeout=90)
    project = base / "proj it's $(touch x) `id`"
    project.mkdir()
    (project / "run.toml").write_text(RUN_FILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCTRAIN_")}
    env.update({"HPCTRAIN_SSH_CONTROL_DIR": str(base / "cm"), "HPCTRAIN_STATE_DIR": str(base / "laptop-state")})
    lap = Laptop(login, project, base / "login node 'dir'", env)
    try:
        yield lap
    finally:
        state = lap.remote_dir / "state" / "registry.sqlite3"
        if state.exists():  # scancel what this module queued
            from hpctrain.runs.registry import Registry

            ids = {a.job_id.split("_")[0] for r in Registry(state).list_runs(limit=None) for a in r.attempts}
            subprocess.run(["scancel", *sorted(i for i in ids if i)], capture_output=True, timeout=30, check=False)
        # and the supervisor jobs the submits armed (waiting on those jobs): their scripts lie in our run folders
        queue = subprocess.run(["squeue", "-h", "-o", "%i|%o"], capture_output=True, text=True, timeout=30,
                               check=False).stdout
        ours = [ln.split("|")[0] for ln in queue.splitlines() if f"{lap.remote_dir}/runs/" in ln]
        if ours:
            subprocess.run(["scancel", *ours], capture_output=True, timeout=30, check=False)
        for sock in (base / "cm").glob("*"):
            if sock.is_socket() and "." not in sock.name:  # the control sockets, not the servers' forwards
                subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "login"], capture_output=True,
                               timeout=10, check=False)
        run_cmd(["bash", SSHD_SH, "down", login], timeout=60, check=False)


def _servers(remote_dir: Path) -> dict[int, list[str]]:
    """The hpctrain servers of REMOTE_DIR (hpctrain.remote.serve): pid -> argv, without the children they
    forked for commands still ending."""
    folder = str(Path(serve_module.socket_for(str(remote_dir), "k" * 12)).parent)
    found: dict[int, tuple[int, list[str]]] = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if "serve" in argv and "--socket" in argv and argv[argv.index("--socket") + 1].startswith(folder + "/"):
            found[int(proc.name)] = (ppid, argv)
    return {pid: argv for pid, (ppid, argv) in found.items() if ppid not in found}


def _server_folder(remote_dir: Path) -> Path:
    return Path(serve_module.socket_for(str(remote_dir), "k" * 12)).parent


def _one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "Fix:" in lines[0] and "Traceback" not in proc.stderr and all(w in lines[0] for w in words), lines[0]


def test_whole_loop_from_the_laptop(laptop: Laptop) -> None:
    site = laptop.site()
    before = laptop.accepted()
    sub = laptop.hpctrain("submit", "run.toml", "--site", str(site), "--json")
    assert sub.returncode == 0, sub.stderr
    (run,) = json.loads(sub.stdout)
    assert run["executor"] == "slurm" and Path(run["run_dir"]).parent == laptop.remote_dir / "runs"
    assert (laptop.remote_dir / "uploads").is_dir() and not (laptop.project / "x").exists()
    rid, remote = run["run_id"], ["--remote", str(site)]

    watch = laptop.hpctrain(*remote, "status", rid, "--watch", "--interval", "1", timeout=400)
    assert watch.returncode == 0 and "COMPLETED" in watch.stdout, watch.stdout + watch.stderr
    logs = laptop.hpctrain(*remote, "logs", rid)
    assert logs.returncode == 0 and "finished at step 4" in logs.stdout, logs.stdout[-2000:] + logs.stderr
    # Every command since the submit went to the login node's hpctrain server: one, private, still warm.
    (server,) = _servers(laptop.remote_dir)
    sock = next(_server_folder(laptop.remote_dir).glob("*.sock"))
    assert oct(sock.stat().st_mode & 0o777) == "0o600" and oct(sock.parent.stat().st_mode & 0o777) == "0o700"
    follow = laptop.hpctrain(*remote, "logs", rid, "--follow")  # the job ended: it prints and stops
    assert follow.returncode == 0 and "finished at step 4" in follow.stdout, follow.stderr
    # status --watch on a terminal: the server gives the command a pseudo-terminal, so the live view draws.
    shown = subprocess.run(["script", "-qec", shlex.join([HPCTRAIN, *remote, "status", rid, "--watch"]), "/dev/null"],
                           cwd=laptop.project, env=laptop.env, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, check=False)
    assert shown.returncode == 0 and "COMPLETED" in shown.stdout, shown.stdout[-2000:] + shown.stderr
    stacks = laptop.hpctrain(*remote, "stacks", rid)  # the login node's own refusal comes back as it is
    assert stacks.returncode != 0 and "wait until it runs" in stacks.stderr, stacks.stderr
    assert "connection" not in stacks.stderr
    sync = laptop.hpctrain(*remote, "sync", rid, "--json")
    assert sync.returncode == 0, sync.stderr
    assert any((laptop.remote_dir / "runs" / rid / "metrics").rglob("events.out.tfevents*"))
    export = laptop.hpctrain(*remote, "export", rid, "--out", "exported model", timeout=600)
    assert export.returncode == 0, export.stderr[-2000:]
    assert any(laptop.remote_dir.rglob("exported model/config.json")), export.stdout
    plain = laptop.hpctrain(*remote, "list", env={"HPCTRAIN_REMOTE_NO_SERVER": "1"})  # the ssh-only way
    assert plain.returncode == 0 and rid in plain.stdout, plain.stderr
    summ = laptop.hpctrain(*remote, "summary", rid, "--plot", "plots/loss curve.png")
    assert summ.returncode == 0 and rid in summ.stdout, summ.stderr
    assert (laptop.project / "plots" / "loss curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pull = laptop.hpctrain("remote", "pull", "--site", str(site), rid)
    assert pull.returncode == 0, pull.stderr
    got = laptop.project / "runs" / rid
    assert (got / "spec.toml").is_file() and (got / "metrics").is_dir() and not (got / "checkpoints").exists()
    assert (laptop.remote_dir / "runs" / rid / "checkpoints").is_dir()  # they stay on the cluster unless asked
    listed = laptop.hpctrain(*remote, "list", "--json")
    assert rid in listed.stdout, listed.stderr

    # A second run, cancelled from the laptop.
    second = laptop.hpctrain("submit", "run.toml", "--site", str(site), "--json", "--set", "train.steps=400")
    assert second.returncode == 0, second.stderr
    rid2 = json.loads(second.stdout)[0]["run_id"]
    cancel = laptop.hpctrain(*remote, "cancel", rid2)
    assert cancel.returncode == 0, cancel.stderr

    def cancelled() -> bool:
        doc = json.loads(laptop.hpctrain(*remote, "status", rid2, "--json").stdout)
        return doc["state"] == "CANCELLED"
    wait_until(cancelled, 120, f"{rid2} CANCELLED seen from the laptop", poll=2)
    again = laptop.hpctrain(*remote, "resubmit", rid2, "--json")
    assert again.returncode == 0, again.stderr
    assert laptop.hpctrain(*remote, "cancel", rid2).returncode == 0
    # Every command above rode on one shared connection: sshd accepted at most one login for all of them,
    # and one server answered them all.
    assert laptop.accepted() - before <= 1
    assert list(_servers(laptop.remote_dir)) == [server]


def test_the_server_restarts_by_itself(laptop: Laptop) -> None:
    """A server that died, or whose hpctrain changed on disk, is replaced by the next command unseen."""
    site = str(laptop.site())
    assert laptop.hpctrain("--remote", site, "list").returncode == 0
    (first,) = _servers(laptop.remote_dir)
    os.kill(first, 9)
    wait_until(lambda: first not in _servers(laptop.remote_dir), 30, "the server to go", poll=0.1)
    again = laptop.hpctrain("--remote", site, "list")
    assert again.returncode == 0 and not again.stderr, again.stderr
    (second,) = _servers(laptop.remote_dir)
    # hpctrain changed under the server (a reinstall, an edit): the next command gets a fresh one.
    source = Path(serve_module.__file__)
    stamp = source.stat()
    try:
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
        changed = laptop.hpctrain("--remote", site, "list")
    finally:
        os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert changed.returncode == 0 and not changed.stderr, changed.stderr
    wait_until(lambda: second not in _servers(laptop.remote_dir), 30, "the changed server to stop", poll=0.1)
    assert len(_servers(laptop.remote_dir)) == 1


def _wheelhouse(dest: Path) -> None:
    """What `pip download hpctrain -d DEST` gives, without the network: hpctrain's wheel built from this
    checkout, and each dependency's repacked from the files this venv installed (their RECORD)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    run_cmd([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
             "-w", dest, REPO], timeout=600)
    todo, seen = list(metadata.requires("hpctrain") or []), set()
    while todo:
        req = Requirement(todo.pop())
        if (req.marker and not req.marker.evaluate({"extra": ""})) or canonicalize_name(req.name) in seen:
            continue
        seen.add(canonicalize_name(req.name))
        dist = metadata.distribution(req.name)
        _repack(dist, dest)
        todo += dist.requires or []


def _repack(dist: Any, dest: Path) -> None:
    tag = next(ln.split(":", 1)[1].strip() for ln in dist.read_text("WHEEL").splitlines() if ln.startswith("Tag:"))
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    info = f"{name}-{dist.version}.dist-info"
    record = []
    with zipfile.ZipFile(dest / f"{name}-{dist.version}-{tag}.whl", "w") as zf:
        for f in dist.files or []:
            part = str(f)
            if part.startswith("..") or "__pycache__" in part or Path(part).name in (
                    "RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                continue  # scripts (pip makes them again), caches, and what pip wrote when it installed
            arc = f"{info}/{Path(part).name}" if part.split("/")[0].endswith(".dist-info") else part
            data = Path(dist.locate_file(f)).read_bytes()
            zf.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
        zf.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")


def test_remote_setup_installs_hpctrain_there(laptop: Laptop) -> None:
    """`hpctrain remote setup --wheel DIR`: a cluster without PyPI access gets this version of hpctrain in a
    venv under remote_dir from uploaded wheels; the path it prints is a working [remote] hpctrain (its
    server answers the next command); a missing Python is one line with the fix."""
    wheels = laptop.project.parent / "wheels"
    wheels.mkdir(exist_ok=True)
    _wheelhouse(wheels)
    where = laptop.login.parent / "setup 'dir'"
    site = laptop.site("fresh", remote_dir=str(where), hpctrain="~/no/hpctrain")
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))  # the login node's Python
    _one_line_error(laptop.hpctrain("remote", "setup", "--site", str(site), "--python", "/no/python3"),
                    "no '/no/python3'", "--python")
    done = laptop.hpctrain("remote", "setup", "--site", str(site), "--wheel", str(wheels), "--python", python,
                           timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("in the site profile set: [remote] hpctrain = "), done.stdout
    command = json.loads(line.split(" = ", 1)[1])
    assert shlex.split(command) == [str(where / "venv" / "bin" / "hpctrain")]
    used = laptop.site("fresh", remote_dir=str(where), hpctrain=command)
    listed = laptop.hpctrain("--remote", str(used), "list")
    assert listed.returncode == 0, listed.stderr
    (argv,) = _servers(where).values()  # its server runs the venv's hpctrain
    assert argv[:2] == [str(where / "venv" / "bin" / "python"), str(where / "venv" / "bin" / "hpctrain")], argv


def test_what_travels_with_a_script(laptop: Laptop) -> None:
    """--script and the code beside it go to the upload mirror; the login node's run points at the copy."""
    site = laptop.site()
    code = laptop.project / "my code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("import helper\n")
    (code / "helper.py").write_text("X = 1\n")
    (code / ".env").write_text("SECRET=1\n")
    proc = laptop.hpctrain("submit", "run.toml", "--site", str(site), "--script", "my code/train.py", "--dry-run",
                           "--json", "--", "--lr", "it's 1")
    assert proc.returncode == 0, proc.stderr
    sbatch = json.loads(proc.stdout)["sbatch"]
    copies = list((laptop.remote_dir / "uploads").glob(f"*/{str(code).lstrip('/')}/train.py"))
    assert copies and (copies[-1].parent / "helper.py").is_file() and not (copies[-1].parent / ".env").exists()
    assert "/uploads/" in sbatch and "train.py" in sbatch and "--lr" in sbatch
    # The next submit has an upload folder of its own, and what did not change is linked, not sent again.
    pattern = f"*/{str(code).lstrip('/')}/train.py"
    first = {p for p in (laptop.remote_dir / "uploads").glob(pattern) if (p.parent / "helper.py").exists()}
    # Edited to the same size with the same mtime (an edit in the same second as the last upload): still sent.
    before = (code / "helper.py").stat()
    (code / "helper.py").write_text("X = 2\n")
    os.utime(code / "helper.py", ns=(before.st_atime_ns, before.st_mtime_ns))
    again = laptop.hpctrain("submit", "run.toml", "--site", str(site), "--script", "my code/train.py", "--dry-run")
    assert again.returncode == 0, again.stderr
    (newer,) = set((laptop.remote_dir / "uploads").glob(pattern)) - first
    assert newer.stat().st_ino in {p.stat().st_ino for p in first}  # unchanged: one file, two folders
    assert (newer.parent / "helper.py").read_text() == "X = 2\n"
    assert {(p.parent / "helper.py").read_text() for p in first} == {"X = 1\n"}  # earlier copies untouched

    # The login host from --remote, the job's own site profile from --site: each one's keys where they belong.
    job_site = laptop.project / "job.toml"
    job_site.write_text('partition = "debug"\nexclude = "node4"\n')
    proc = laptop.hpctrain("--remote", str(site), "submit", "run.toml", "--site", str(job_site), "--dry-run")
    assert proc.returncode == 0 and "#SBATCH --exclude=node4" in proc.stdout, proc.stderr


def test_failures_are_one_line_with_the_fix(laptop: Laptop) -> None:
    missing = laptop.site("missing", hpctrain="/nonexistent/bin/hpctrain")
    _one_line_error(laptop.hpctrain("--remote", str(missing), "list"), "no hpctrain on", "remote setup")

    old = laptop.login / "old hpctrain"
    old.write_text("#!/bin/sh\necho 'hpctrain, version 9.9.0'\n")
    old.chmod(0o755)
    _one_line_error(laptop.hpctrain("--remote", str(laptop.site("old", hpctrain=shlex.quote(str(old)))), "list"),
                    "version 9.9.0", "pip install 'hpctrain==")

    other_key = laptop.login / "not_authorized"
    if not other_key.exists():
        run_cmd(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other_key])
    cfg = laptop.login / "ssh_config_nokey"
    cfg.write_text((laptop.login / "ssh_config").read_text().replace(str(laptop.login / "client_ed25519"),
                                                                      str(other_key)))
    nokey = laptop.site("nokey", ssh_config=str(cfg))
    proc = laptop.hpctrain("--remote", str(nokey), "list", timeout=60)
    _one_line_error(proc, "password or passphrase", "ssh-add")


def test_full_remote_disk_is_one_line(laptop: Laptop) -> None:
    """remote_dir on a 256 KB tmpfs, a 600 KB data file to carry: rsync fails there, hpctrain says why."""
    small = laptop.login.parent / "small disk"
    small.mkdir(exist_ok=True)
    run_cmd(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", small])
    try:
        corpus = laptop.project / "corpus.jsonl"
        corpus.write_text('{"text": "%s"}\n' % ("x" * 1000) * 600)
        site = laptop.site("small", remote_dir=str(small))
        proc = laptop.hpctrain("submit", "run.toml", "--site", str(site), "--set", f"data.source={corpus}")
        _one_line_error(proc, "disk is full", "free space")
    finally:
        # the server of that remote_dir lives in it (its cwd, its socket): stopped first, or umount is refused
        for pid in _servers(small):
            os.kill(pid, 15)
        wait_until(lambda: not _servers(small), 30, "the small disk's server to stop", poll=0.1)
        run_cmd(["umount", small])


def test_sshd_killed_mid_submit_is_found_again(laptop: Laptop) -> None:
    site = laptop.site()
    uploads = laptop.remote_dir / "uploads"
    seen = set(uploads.glob("*/pid"))
    first = subprocess.Popen([HPCTRAIN, "submit", "run.toml", "--site", str(site), "--json"], cwd=laptop.project,
                             env=laptop.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: set(uploads.glob("*/pid")) - seen, 120, "the remote submit to start", poll=0.02)
        run_cmd(["bash", SSHD_SH, "restart", laptop.login], timeout=60)  # every sshd process killed, then up again
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    stage = (set(uploads.glob("*/pid")) - seen).pop().parent
    if first.returncode == 0:  # the submit finished before the kill reached it: nothing to find again
        pytest.skip("the submit ended before sshd was killed (a very fast machine)")
    _one_line_error(subprocess.CompletedProcess(first.args, first.returncode, out, err), "dropped",
                    "never queued twice")
    wait_until(lambda: (stage / "rc").exists(), 120, "the detached submit to finish on the login node")
    queued = json.loads((stage / "out").read_text())[0]["run_id"]

    again = laptop.hpctrain("submit", "run.toml", "--site", str(site), "--json")
    assert again.returncode == 0, again.stderr
    assert "reached the login node" in again.stderr and json.loads(again.stdout)[0]["run_id"] == queued
    runs = json.loads(laptop.hpctrain("--remote", str(site), "list", "--json", "--all").stdout)
    assert sum(1 for r in runs if r["run_id"] == queued) == 1
    assert len(set(uploads.glob("*/pid"))) == len(seen) + 1  # the second call sent nothing and queued nothing
    laptop.hpctrain("--remote", str(site), "cancel", queued)


def test_changed_host_key_is_refused(laptop: Laptop) -> None:
    site = laptop.site()
    key = laptop.login / "host_ed25519"
    saved = key.read_bytes(), key.with_suffix(".pub").read_bytes()
    try:
        key.unlink()
        key.with_suffix(".pub").unlink()
        run_cmd(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key])
        run_cmd(["bash", SSHD_SH, "restart", laptop.login], timeout=60)
        fresh = {"HPCTRAIN_SSH_CONTROL_DIR": str(laptop.login.parent / "cm-fresh")}
        proc = laptop.hpctrain("--remote", str(site), "list", env=fresh, timeout=60)
        _one_line_error(proc, "host key", "ssh-keygen -R")
    finally:
        key.write_bytes(saved[0])
        key.with_suffix(".pub").write_bytes(saved[1])
        run_cmd(["bash", SSHD_SH, "restart", laptop.login], timeout=60)
