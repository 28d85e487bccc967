#!/usr/bin/env python3
"""`hpctrain status` and `hpctrain submit` from a laptop (issue 30): over hpctrain's shared ssh connection,
on the login node itself, and as plain `ssh login hpctrain ...` (a new connection each time).

The login node is tests/cluster/login_sshd.sh's: a real sshd in its own network namespace on the local SLURM
cluster (tests/cluster/slurm.sh up). The root namespace plays the laptop. Each command is timed --repeat times
per way, alternating the ways, and the median is shown; every submit is cancelled at once (its supervisor job
too). Goals of the issue: status over the open connection within 0.3 s of the login node's, a submit of the
tiny example within 1.5 s. hpctrain's way is timed twice: through the login node's hpctrain server (the
default) and without it (HPCTRAIN_REMOTE_NO_SERVER=1: an ssh session and a Python start there per command).

    python bench/remote_status.py [--repeat 7]
    # beside a test run:
    LOGIN_NS=hpctrain-login-b LOGIN_VETH=vhpcloginb LOGIN_IP=10.77.0.203 python bench/remote_status.py

The machine is shared with other sessions: compare the differences, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SSHD_SH = ROOT / "tests" / "cluster" / "login_sshd.sh"
HPCTRAIN = str(Path(sys.executable).parent / "hpctrain")
# login_sshd.sh's namespace; LOGIN_NS/LOGIN_VETH/LOGIN_IP give a second login node beside the tests' one
LOGIN_NS = f"/run/netns/{os.environ.get('LOGIN_NS', 'hpctrain-login')}"
RUN_FILE = (ROOT / "examples" / "tiny.toml").read_text()


STATUS_LOGIN, STATUS = "status: on the login node", "status: hpctrain --remote (the server, over the open connection)"
SUBMIT_LOGIN = "submit: on the login node"
SUBMIT = "submit: hpctrain submit --site (the server, over the open connection)"


def timed(fn: Callable[[], subprocess.CompletedProcess[str]]) -> float:
    t0 = time.perf_counter()
    proc = fn()
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {proc.args}\n{proc.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--login-hpctrain", default=HPCTRAIN,
                    help="The hpctrain of the login node (all three ways there), e.g. an installed, non-editable "
                         "copy: the server restarts when the files of its hpctrain change, and an editable "
                         "checkout that others edit changes all the time.")
    args = ap.parse_args()
    login_hpctrain = args.login_hpctrain
    with tempfile.TemporaryDirectory(prefix="hpctrain-remote-bench-", ignore_cleanup_errors=True) as tmp:
        base = Path(tmp)
        login, project, remote_dir = base / "login", base / "project", base / "remote"
        project.mkdir()
        remote_dir.mkdir()
        (project / "run.toml").write_text(RUN_FILE)
        subprocess.run(["bash", str(SSHD_SH), "up", str(login)], check=True, timeout=90)
        state = remote_dir / "state"
        site = project / "lab.toml"
        site.write_text(f'partition = "debug"\n[remote]\nhost = "login"\nssh_config = "{login}/ssh_config"\n'
                        f'remote_dir = "{remote_dir}"\nhpctrain = "{shlex.quote(login_hpctrain)}"\n[remote.env]\n'
                        f'HPCTRAIN_STATE_DIR = "{state}"\n')
        laptop_env = {k: v for k, v in os.environ.items() if not k.startswith("HPCTRAIN_")}
        laptop_env.update({"HPCTRAIN_SSH_CONTROL_DIR": str(base / "cm"), "HPCTRAIN_STATE_DIR": str(base / "lap")})
        login_env = {**laptop_env, "HPCTRAIN_STATE_DIR": str(state), "HPCTRAIN_RUNS_DIR": str(remote_dir / "runs")}
        ssh = ["ssh", "-F", str(login / "ssh_config"), "-o", "BatchMode=yes", "login"]
        plain_prefix = (f"cd {shlex.quote(str(project))} && HPCTRAIN_STATE_DIR={shlex.quote(str(state))} "
                        f"HPCTRAIN_RUNS_DIR={shlex.quote(str(remote_dir / 'runs'))} {shlex.quote(login_hpctrain)}")

        def laptop(*a: str, server: bool = True) -> subprocess.CompletedProcess[str]:
            env = laptop_env if server else {**laptop_env, "HPCTRAIN_REMOTE_NO_SERVER": "1"}
            return subprocess.run([HPCTRAIN, *a], cwd=project, env=env, capture_output=True, text=True,
                                  timeout=300, check=False)

        def on_login(*a: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["nsenter", f"--net={LOGIN_NS}", login_hpctrain, *a], cwd=project, env=login_env,
                                  capture_output=True, text=True, timeout=300, check=False)

        def plain(*a: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*ssh, f"{plain_prefix} {shlex.join(a)}"], capture_output=True, text=True,
                                  timeout=300, check=False)

        try:
            first = laptop("submit", "run.toml", "--site", str(site), "--json")  # opens the shared connection
            if first.returncode:
                raise SystemExit(first.stderr)
            rid = json.loads(first.stdout)[0]["run_id"]
            plain_site = str(project / "login.toml")  # the login node's own submits: the site without [remote]
            Path(plain_site).write_text('partition = "debug"\n')
            rows: dict[str, list[float]] = {}
            sock = next(p for p in (base / "cm").iterdir() if p.is_socket() and "." not in p.name)  # not a .srv
            floor = [*ssh[:-1], "-o", f"ControlPath={sock}", "login", "true"]
            ways: list[tuple[str, Callable[[], subprocess.CompletedProcess[str]]]] = [
                ("floor: ssh login true over the shared connection (sshd session + login shell rc)",
                 lambda: subprocess.run(floor, capture_output=True, text=True, timeout=60, check=False)),
                ("part of it: the login shell's rc files alone (bash -c 'source ~/.bashrc')",
                 lambda: subprocess.run(["bash", "-c", "source ~/.bashrc"], capture_output=True, text=True,
                                        timeout=60, check=False)),
                ("laptop: hpctrain --version (Python start, the CLI's imports)", lambda: laptop("--version")),
                (STATUS_LOGIN, lambda: on_login("status", rid)),
                (STATUS, lambda: laptop("--remote", str(site), "status", rid)),
                ("status: hpctrain --remote, no server (an ssh session + Python start there per command)",
                 lambda: laptop("--remote", str(site), "status", rid, server=False)),
                ("status: plain ssh login hpctrain status", lambda: plain("status", rid)),
                (SUBMIT_LOGIN, lambda: on_login("submit", "run.toml", "--site", plain_site)),
                (SUBMIT, lambda: laptop("submit", "run.toml", "--site", str(site))),
                ("submit: hpctrain submit --site, no server (rsync and the submit each an ssh session)",
                 lambda: laptop("submit", "run.toml", "--site", str(site), server=False)),
                ("submit: plain ssh login hpctrain submit", lambda: plain("submit", "run.toml", "--site", plain_site)),
            ]
            for _ in range(args.repeat):
                for name, fn in ways:
                    rows.setdefault(name, []).append(timed(fn))
            _table(rows, args.repeat)
        finally:
            _cancel_all(state)
            for sock in (base / "cm").glob("*"):
                if sock.is_socket():
                    subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "login"], capture_output=True,
                                   check=False)
            subprocess.run(["bash", str(SSHD_SH), "down", str(login)], check=False, timeout=60)


def _cancel_all(state: Path) -> None:
    db = state / "registry.sqlite3"
    if not db.exists():
        return
    sys.path.insert(0, str(ROOT / "toolkit"))
    from hpctrain.runs.registry import Registry

    ids = {a.job_id.split("_")[0] for r in Registry(db).list_runs(limit=None) for a in r.attempts if a.job_id}
    subprocess.run(["scancel", *sorted(ids)], capture_output=True, check=False, timeout=60)
    time.sleep(0.5)
    # the supervisor jobs each submit armed: by name, only those of this bench's runs
    names = {r.run_id for r in Registry(db).list_runs(limit=None)}
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, check=False).stdout
    extra = [ln.split()[0] for ln in out.splitlines() if any(n in ln for n in names)]
    if extra:
        subprocess.run(["scancel", *extra], capture_output=True, check=False, timeout=60)


def _table(rows: dict[str, list[float]], n: int) -> None:
    print(f"\n| command (median of {n}) | seconds | min - max |\n| --- | --- | --- |")
    for name, xs in rows.items():
        print(f"| {name} | {statistics.median(xs):.3f} | {min(xs):.3f} - {max(xs):.3f} |")
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nstatus over the open connection - on the login node: {med[STATUS] - med[STATUS_LOGIN]:+.3f} s "
          "(goal <= 0.3)")
    print(f"submit over the open connection: {med[SUBMIT]:.3f} s (goal <= 1.5); on the login node "
          f"{med[SUBMIT_LOGIN]:.3f} s")


if __name__ == "__main__":
    main()
