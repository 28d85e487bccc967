"""Running an hpctrain command on the login node, over the site's one shared ssh connection.

`Connection.run` sends a command and streams its output; the first command of a new shared connection also
asks the login node for its hpctrain version and its absolute remote_dir (kept beside the control socket, so
later commands cost one round trip). `submit` sends the files first (hpctrain.remote.travel) and runs the
login node's `hpctrain submit` detached from the connection, its answer written into the upload folder: a
dropped connection loses nothing, and typing the same submit again reads that answer instead of submitting
again (a record per submit under the state dir until its answer is read).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain import __version__
from hpctrain.errors import HpcUsageError
from hpctrain.remote import client, ssh
from hpctrain.remote.serve import socket_for as serve_socket
from hpctrain.remote.site import Remote
from hpctrain.remote.travel import EXCLUDES, Item
from hpctrain.secret import DENIED_FILES

UPLOADS = "uploads"


class RemoteFailure(HpcUsageError):
    """ssh, rsync or the login node failed for a reason the user fixes (one line: cause and fix)."""

    exit_code = 3


@dataclass(frozen=True)
class Probe:
    """What the login node said when the shared connection opened."""

    remote_dir: str  # absolute
    version: str


def compatible(local: str, remote: str) -> bool:
    """Run folders and arguments stay the same within one minor version (0.1.x with 0.1.y)."""
    return local.split(".")[:2] == remote.split(".")[:2]


class Connection:
    """One site's login host, reached through one multiplexed ssh connection."""

    def __init__(self, remote: Remote) -> None:
        self.remote = remote
        self.socket = ssh.socket_path(remote)

    def _argv(self, command: str, tty: bool = False) -> list[str]:
        return ssh.ssh_argv(self.remote, self.socket, command, tty)

    def rsync(self, argv: list[str], what: str) -> None:
        proc = _run(argv, what, stdin=subprocess.DEVNULL, capture_output=True)
        if proc.returncode != 0:
            problem = ssh.failure(self.remote, proc.returncode, proc.stderr, what)
            if problem is None and proc.returncode in ssh.RSYNC_WRITE_FAILED and self._disk_full():
                problem = ssh.disk_full(self.remote, what)
            raise RemoteFailure(problem or f"{what}: rsync failed (rc {proc.returncode}): "
                                f"{proc.stderr.strip()[-400:]}")

    def _disk_full(self) -> bool:
        """Whether remote_dir's filesystem is (nearly) full. The receiving rsync's "No space left on device"
        does not always reach this side (the suite saw rc 11 and an empty stderr in 1 upload of 3, through the
        server and its pipe), while the partial file --partial keeps leaves the disk full: ask the disk."""
        try:
            proc = self.shell(ssh.df_line(self.remote), "df", capture=True, check=False)
        except RemoteFailure:
            return False
        words = (proc.stdout or "").split()
        return proc.returncode == 0 and len(words) == 1 and words[0].isdigit() and int(words[0]) < ssh.FULL_BELOW_KB

    def probe(self) -> Probe:
        """The login node's absolute remote_dir and hpctrain version, asked once per shared connection."""
        # One answer per connection and per (remote_dir, hpctrain): two sites may share a host.
        which = hashlib.sha256(f"{self.remote.remote_dir}\0{self.remote.hpctrain}".encode()).hexdigest()[:8]
        cache = self.socket.with_name(f"{self.socket.name}.{which}.probe")
        with contextlib.suppress(OSError, ValueError, KeyError):
            ino = os.stat(self.socket).st_ino
            kept = json.loads(cache.read_text())
            if kept.get("socket") == ino:
                return Probe(kept["remote_dir"], kept["version"])
        what = f"hpctrain on {self.remote.host}"
        proc = _run(self._argv(ssh.probe_shell(self.remote)), what, stdin=subprocess.DEVNULL, capture_output=True)
        if proc.returncode != 0:
            raise RemoteFailure(ssh.failure(self.remote, proc.returncode, proc.stderr, what)
                                or f"{what}: `hpctrain --version` failed there (rc {proc.returncode}): "
                                   f"{proc.stderr.strip()[-300:]}. Fix: check sites.{self.remote.site}.remote.hpctrain")
        lines = proc.stdout.strip().splitlines()
        got = Probe(lines[0], lines[-1].rsplit(" ", 1)[-1] if len(lines) > 1 else "?")
        self._check_version(got.version)
        with contextlib.suppress(OSError):  # ControlPersist=no: no socket stays, the probe is asked again next time
            cache.write_text(json.dumps({"socket": os.stat(self.socket).st_ino, **got.__dict__}))
        return got

    def _check_version(self, version: str) -> None:
        if not compatible(__version__, version):
            raise RemoteFailure(
                f"hpctrain on {self.remote.host}: version {version}, this one {__version__}: run folders and "
                f"arguments differ between minor versions. Fix: on the login node `pip install "
                f"'hpctrain=={__version__}'` into the environment of {self.remote.hpctrain!r}, or "
                f"`hpctrain remote setup --site {self.remote.site}`")

    # -- the login node's hpctrain server (hpctrain.remote.serve): one fork per command, no session --------

    def server(self) -> socket.socket | None:
        """A connection to the login node's hpctrain server, started (and forwarded) first if none answers;
        None when plain ssh must do (persist = "no", forwarding refused, an hpctrain there without one)."""
        if not client.enabled(self.remote):
            return None
        path = client.local_path(self.socket, self.remote)
        got = client.hello(path) if path.exists() else None
        if got is None:
            if not self._start_server(path):
                return None
            got = client.hello(path)
            if got is None:
                return None
        sock, doc = got
        try:
            self._check_version(str(doc.get("version", "?")))
        except RemoteFailure:
            sock.close()
            raise
        return sock

    def _start_server(self, path: Path) -> bool:
        what = f"hpctrain on {self.remote.host}"
        probe = self.probe()  # opens the shared connection (its failures are one line) and checks the version
        far = serve_socket(probe.remote_dir, client.key(self.remote))
        # Forwarded anew: the master answers "done" to a forward it already has even when its socket file is
        # gone, and refuses to bind over a stale file left by an earlier connection.
        _run(ssh.cancel_argv(self.remote, self.socket, str(path), far), what, stdin=subprocess.DEVNULL,
             capture_output=True)
        path.unlink(missing_ok=True)
        fwd = _run(ssh.forward_argv(self.remote, self.socket, str(path), far), what, stdin=subprocess.DEVNULL,
                   capture_output=True)
        if fwd.returncode != 0:  # the login node forbids socket forwarding (AllowStreamLocalForwarding no)
            return False
        line = ssh.remote_shell(self.remote, ["remote", "serve", "--socket", far, "--idle",
                                              f"{client.idle_s(self.remote):g}"])
        try:
            return client.start(self._argv(line), path.with_suffix(".log")) is not None
        except client.StartFailed as exc:
            raise RemoteFailure(ssh.failure(self.remote, exc.rc, exc.stderr, what)
                                or f"{what}: `hpctrain remote serve` failed there (rc {exc.rc}): "
                                   f"{exc.stderr.strip()[-300:]}. Log: {path.with_suffix('.log')}") from None

    def _served(self, sock: socket.socket, request: dict[str, Any], what: str,
                capture: bool) -> subprocess.CompletedProcess[str]:
        rc, out, err = client.call(sock, request, capture)
        if rc is None:  # cut off before the exit status: the link dropped, or the server was stopped
            raise RemoteFailure(ssh.failure(self.remote, ssh.SSH_FAILED, err + "\nConnection to the login node's "
                                            "hpctrain server closed", what) or what)
        problem = ssh.failure(self.remote, rc, err, what) if rc else None
        if problem:
            raise RemoteFailure(problem)
        return subprocess.CompletedProcess([], rc, out if capture else None, err if capture else None)

    def rsh(self) -> str:
        """rsync's remote shell: through the server when one answers, else "" (ssh over the connection)."""
        sock = self.server()
        if sock is None:
            return ""
        sock.close()
        return client.rsh(client.local_path(self.socket, self.remote))

    # -- commands ---------------------------------------------------------------------------------------

    def run(self, args: list[str], cwd: str = "", tty: bool = False, capture: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """hpctrain ARGS on the login node; output streams to ours unless CAPTURE. A failure of the connection
        raises RemoteFailure; the remote hpctrain's own exit status is returned."""
        what = f"hpctrain {args[0] if args else ''} on {self.remote.host}"
        sock = self.server()
        if sock is not None:
            return self._served(sock, {"argv": args, "cwd": cwd, "env": env or {}, "tty": tty}, what, capture)
        self.probe()
        line = ssh.remote_shell(self.remote, args, cwd, env)
        return self.shell(line, what, tty, capture, served=False)

    def submit(self, args: list[str], cwd: str, stage: str) -> subprocess.CompletedProcess[str]:
        """hpctrain ARGS (a submit) detached from the connection: its answer kept in upload folder STAGE."""
        what = f"submit on {self.remote.host}"
        sock = self.server()
        if sock is not None:
            return self._served(sock, {"argv": args, "cwd": cwd, "stage": stage}, what, False)
        return self.shell(detached_submit(self.remote, args, cwd, stage), what, served=False)

    def shell(self, line: str, what: str, tty: bool = False, capture: bool = False, served: bool = True,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        """One shell LINE on the login node (built from quoted words only); SERVED: through the login node's
        hpctrain server when one answers; CHECK: a failure of ssh raises RemoteFailure."""
        sock = self.server() if served else None
        if sock is not None:
            return self._served(sock, {"shell": line, "tty": tty}, what, capture)
        if capture:
            proc = _run(self._argv(line, tty), what, stdin=subprocess.DEVNULL, capture_output=True)
            err = proc.stderr
        else:
            proc = _run(self._argv(line, tty), what, stdin=None if tty else subprocess.DEVNULL, stderr=subprocess.PIPE)
            err = proc.stderr or ""
            # The remote hpctrain's own messages pass through; ssh's are turned into one line below.
            if proc.returncode not in (ssh.SSH_FAILED, 127) and err:
                sys.stderr.write(err)
        problem = ssh.failure(self.remote, proc.returncode, err, what) if check else None
        if problem:
            raise RemoteFailure(problem)
        return proc

    def upload(self, items: list[Item], stage: str, previous: str = "", served: bool = True) -> None:
        """Send ITEMS into STAGE (absolute, on the login node), mirrored at their local absolute paths; files
        unchanged since upload folder PREVIOUS are linked from there."""
        if not items:
            return
        excludes = [*EXCLUDES, *DENIED_FILES]
        argv = ssh.rsync_up_argv(self.remote, self.socket, [str(i.path) for i in items], stage, excludes, previous,
                                 self.rsh() if served else "")
        self.rsync(argv, f"upload to {self.remote.host}")

    def pull(self, source: str, dest: Path, excludes: list[str]) -> None:
        """Fetch folder SOURCE of the login node into DEST (only what changed travels)."""
        dest.mkdir(parents=True, exist_ok=True)
        self.rsync(ssh.rsync_down_argv(self.remote, self.socket, source, str(dest), excludes, self.rsh()),
                   f"fetch from {self.remote.host}")

    def close(self) -> None:
        subprocess.run(ssh.exit_argv(self.remote, self.socket), capture_output=True, check=False,
                       stdin=subprocess.DEVNULL)


def _run(argv: list[str], what: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """subprocess.run of ssh/rsync; their absence on this machine is a one-line refusal, not a traceback."""
    try:
        return subprocess.run(argv, text=True, check=False, **kw)
    except FileNotFoundError as exc:
        raise RemoteFailure(ssh.missing_program(exc, what)) from None


# --------------------------------------------------------------------------------------------------
# submit: detached on the login node, its answer kept there, found again after a dropped connection

def pending_dir(remote: Remote) -> Path:
    from hpctrain.spec.site import state_dir

    return state_dir() / "remote" / remote.site


def detached_submit(remote: Remote, args: list[str], cwd: str, stage: str) -> str:
    """The shell line of a submit that outlives the connection: hpctrain runs in the background with its
    output in STAGE (out, err, then rc), the foreground waits and prints them. A dropped connection kills
    only the waiting shell."""
    inner = ssh.remote_shell(remote, args, cwd)
    s = shlex.quote(stage)
    return (f"mkdir -p -- {s} {shlex.quote(cwd)} && cd -- {s} && "
            f"( trap '' HUP; sh -c {shlex.quote(inner)} >out 2>err </dev/null; echo $? >rc.part; "
            f"mv rc.part rc ) & echo $! >{s}/pid; wait; cd -- {s} && cat err >&2; cat out; exit \"$(cat rc)\"")


def answer_line(stage: str) -> str:
    """The shell line that reads a detached submit's answer: `done RC` then its output; `running`; `never`
    (it never started: no pid); or `lost` (started, no answer, not running: the login node stopped it)."""
    s = shlex.quote(stage)
    return (f"cd -- {s} 2>/dev/null || {{ echo never; exit 0; }}; if [ -f rc ]; then echo done \"$(cat rc)\"; "
            "cat out; elif [ ! -f pid ]; then echo never; elif kill -0 \"$(cat pid)\" 2>/dev/null; then echo running; "
            "else echo lost; fi")


def last_upload(remote: Remote, stage: str | None = None) -> str:
    """The upload folder of this site's previous submit (rsync links unchanged files from it); with STAGE,
    remember STAGE as that folder. The login node may have removed it: rsync then sends everything."""
    path = pending_dir(remote).parent / f"{remote.site}.last-upload"
    if stage is None:
        try:
            return path.read_text().strip()
        except OSError:
            return ""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(stage)
    return stage


def record(remote: Remote, submit_id: str, digest: str, stage: str) -> Path:
    """The laptop's note that submit SUBMIT_ID was sent: removed once its answer has been read."""
    folder = pending_dir(remote)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{submit_id}.json"
    path.write_text(json.dumps({"id": submit_id, "digest": digest, "stage": stage, "sent": time.time()}))
    return path


def pending(remote: Remote) -> list[dict[str, Any]]:
    folder = pending_dir(remote)
    out = []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            out.append({**json.loads(p.read_text()), "path": str(p)})
        except (OSError, ValueError):
            continue
    return out


def settle(conn: Connection, rec: dict[str, Any], wait_s: float = 600.0) -> tuple[str, str]:
    """Ask the login node what became of a recorded submit: ('done RC', its output), ('never', '') or
    ('lost', ''). A submit still running there is waited for (bounded)."""
    deadline = time.monotonic() + wait_s
    while True:
        proc = conn.shell(answer_line(rec["stage"]), f"reading submit {rec['id']} on {conn.remote.host}", capture=True)
        head, _, rest = proc.stdout.partition("\n")
        if head.startswith("done"):
            return head, rest
        if head != "running" or time.monotonic() > deadline:
            return head if head in ("never", "lost") else "lost", ""
        time.sleep(1.0)
