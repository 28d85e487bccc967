"""OpenSSH and rsync: every command line hpctrain runs to reach a login host, built here and nowhere else.

The user's own `ssh` runs (their ~/.ssh/config, ProxyJump, agent and keys are honoured), always through one
multiplexed connection: ControlMaster=auto opens it on the first command, ControlPersist keeps it open after
the last, and every later ssh and rsync rides on it (one login, one two-factor prompt, ~10 ms a command
instead of a handshake). BatchMode=yes: a password or passphrase prompt with no terminal fails at once with a
message naming the fix, never hangs. Every word that reaches the remote shell is quoted with shlex.

The builders are pure (tests/golden/remote_*.txt); `failure` turns ssh's exit and stderr into one line naming
the cause and the fix. Environment:
  HPCTRAIN_SSH_CONTROL_DIR   the private (0700) folder of control sockets; default $XDG_RUNTIME_DIR/hpctrain-ssh,
                             else /tmp/hpctrain-ssh-UID (a socket path must stay under ~104 bytes)
  HPCTRAIN_ON_LOGIN          set by the laptop in the remote command: the login node's hpctrain runs the command
                             itself, whatever [remote] its site profile names
  HPCTRAIN_REMOTE_NO_SERVER  set: no hpctrain server on the login node, every command over plain ssh
                             (hpctrain.remote.client.NO_SERVER_ENV)
"""

from __future__ import annotations

import hashlib
import os
import shlex
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpctrain.errors import HpcUsageError
from hpctrain.remote.site import Remote

ON_LOGIN = "HPCTRAIN_ON_LOGIN"
CONTROL_DIR_ENV = "HPCTRAIN_SSH_CONTROL_DIR"
CONNECT_TIMEOUT_S = 15
# A dead link is noticed after ServerAliveInterval x CountMax seconds, not TCP's minutes.
ALIVE_INTERVAL_S, ALIVE_COUNT = 5, 3
# rsync's exit code when ssh itself failed; ssh's own is 255.
SSH_FAILED, RSYNC_STREAM = 255, 12  # rsync says 12 when the ssh under it died


def control_dir() -> Path:
    """The folder of the control sockets: private to this user (0700, owned by us), created if missing."""
    given = os.environ.get(CONTROL_DIR_ENV)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if given:
        path = Path(given)
    else:
        path = Path(runtime) / "hpctrain-ssh" if runtime else Path(f"/tmp/hpctrain-ssh-{os.getuid()}")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise HpcUsageError(f"{CONTROL_DIR_ENV} = {str(path)!r}: cannot be created ({exc.strerror}). "
                            f"Fix: set {CONTROL_DIR_ENV} to a private folder of yours") from None
    # Anyone who can reach the socket can run commands as you on the login node: refuse a shared folder.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise HpcUsageError(f"{CONTROL_DIR_ENV} = {str(path)!r}: not a folder private to you (owner {st.st_uid}, "
                            f"mode {stat.S_IMODE(st.st_mode):o}). Fix: remove it, or set {CONTROL_DIR_ENV} to a "
                            "folder only you can open (chmod 700)")
    return path


def socket_path(remote: Remote) -> Path:
    """The control socket of REMOTE's shared connection: named by host, port and ssh config (not ssh's %C, so
    that hpctrain can keep what the login node said beside the connection it belongs to)."""
    key = f"{remote.host}\0{remote.port}\0{remote.ssh_config}".encode()
    return control_dir() / hashlib.sha256(key).hexdigest()[:16]


def ssh_options(remote: Remote, socket: Path) -> list[str]:
    """The options of every ssh hpctrain runs (also rsync's `-e`): the shared connection and no prompts."""
    opts = ["-o", "ControlMaster=auto", "-o", f"ControlPath={socket}", "-o", f"ControlPersist={remote.persist}",
            "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "-o", f"ServerAliveInterval={ALIVE_INTERVAL_S}", "-o", f"ServerAliveCountMax={ALIVE_COUNT}"]
    if remote.ssh_config:
        opts += ["-F", str(Path(remote.ssh_config).expanduser())]
    if remote.port:
        opts += ["-p", str(remote.port)]
    return opts


def remote_shell(remote: Remote, args: Sequence[str], cwd: str = "", env: Mapping[str, str] | None = None) -> str:
    """The one line the login node's shell runs: into remote_dir (made if missing), then CWD under it, then
    hpctrain ARGS with the site's and the call's variables. HPCTRAIN_RUNS_DIR is absolute (run folders are
    named from it on the nodes); every word is quoted."""
    words = shlex.split(remote.hpctrain)
    variables = {**remote.env, **(env or {}), ON_LOGIN: "1"}
    assign = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
    runs = 'HPCTRAIN_RUNS_DIR="$R"/runs' if "HPCTRAIN_RUNS_DIR" not in variables else ""
    into = f" && cd -- {shlex.quote(cwd)}" if cwd else ""
    program = " ".join([*(_program_word(w) for w in words), *(shlex.quote(a) for a in args)])
    return (f"mkdir -p -- {shlex.quote(remote.remote_dir)} && cd -- {shlex.quote(remote.remote_dir)} && R=$(pwd)"
            f"{into} && exec env {runs} {assign} {program}").replace("env  ", "env ")


def _program_word(word: str) -> str:
    """A word of [remote] hpctrain, quoted; a leading ~/ stays the remote home (`~/venv/bin/hpctrain`)."""
    return f'"$HOME"/{shlex.quote(word[2:])}' if word.startswith("~/") else shlex.quote(word)


def probe_shell(remote: Remote) -> str:
    """The first command of a shared connection: the absolute remote_dir, then `hpctrain --version` there."""
    d = shlex.quote(remote.remote_dir)
    words = " ".join(_program_word(w) for w in shlex.split(remote.hpctrain))
    return f"mkdir -p -- {d} && cd -- {d} && pwd && exec env {ON_LOGIN}=1 {words} --version"


# `hpctrain remote setup`'s steps, each with an exit status of its own so that its failure can be named.
SETUP_NO_PYTHON, SETUP_OLD_PYTHON, SETUP_NO_VENV, SETUP_PIP = 91, 92, 93, 94


def setup_shell(remote: Remote, requirement: str, python: str = "python3", find_links: str = "",
                system_site: bool = False) -> str:
    """`hpctrain remote setup`: a venv under remote_dir (made, or kept and upgraded) with REQUIREMENT
    (hpctrain==X.Y.Z) installed by pip, from the index or only from FIND_LINKS (an uploaded folder of wheels),
    then the path and version of its hpctrain."""
    d, py = shlex.quote(remote.remote_dir), shlex.quote(python)
    index = f"--no-index --find-links {shlex.quote(find_links)} " if find_links else ""
    site = "--system-site-packages " if system_site else ""
    return (f"mkdir -p -- {d} && cd -- {d} || exit 1\n"
            f"command -v {py} >/dev/null 2>&1 || exit {SETUP_NO_PYTHON}\n"
            f"{py} -c 'import sys; sys.exit(sys.version_info < (3, 10))' || exit {SETUP_OLD_PYTHON}\n"
            f"{py} -m venv {site}venv || exit {SETUP_NO_VENV}\n"
            f"venv/bin/python -m pip install -q --disable-pip-version-check --upgrade {index}"
            f"{shlex.quote(requirement)} || exit {SETUP_PIP}\n"
            f'echo "$(pwd)/venv/bin/hpctrain" && venv/bin/hpctrain --version')


def setup_failure(remote: Remote, rc: int, stderr: str, python: str, requirement: str, offline: bool) -> str | None:
    """One line for a failed setup step (None: not one of them; ssh.failure reads the rest)."""
    what, where = f"setup on {remote.host}", f"{remote.host}"
    last = next((x.strip() for x in reversed(stderr.splitlines()) if x.strip()), "no message")
    fix_py = ("Fix: give --python the path of a Python 3.10 or newer there (on clusters with modules: "
              "`module load python`, then `which python3`)")
    if rc == SETUP_NO_PYTHON:
        return f"{what}: no {python!r} on {where}. {fix_py}"
    if rc == SETUP_OLD_PYTHON:
        return f"{what}: {python!r} on {where} is older than Python 3.10, which hpctrain needs. {fix_py}"
    if rc == SETUP_NO_VENV:
        extra = " (Debian/Ubuntu: apt-get install python3-venv)" if "ensurepip" in stderr else ""
        return (f"{what}: {python!r} could not make a venv under {remote.remote_dir} ({last}). Fix: install "
                f"Python's venv module there{extra}, or give --python another Python")
    if rc == SETUP_PIP:
        how = ("the folder given to --wheel must hold hpctrain's wheel and every dependency's (on a machine "
               f"with internet: `pip download {requirement} -d wheels`, then --wheel wheels)" if offline else
               f"if the login node cannot reach PyPI, fetch the wheels elsewhere (`pip download {requirement} -d "
               "wheels`) and run setup again with --wheel wheels")
        return f"{what}: pip could not install {requirement} ({last}). Fix: {how}"
    return None


def ssh_argv(remote: Remote, socket: Path, command: str, tty: bool = False) -> list[str]:
    """`ssh ... HOST -- COMMAND`: COMMAND is one shell line (remote_shell), given as one word."""
    return ["ssh", *ssh_options(remote, socket), "-t" if tty else "-T", remote.host, "--", command]


def check_argv(remote: Remote, socket: Path) -> list[str]:
    """`ssh -O check`: whether the shared connection is open (no network traffic when it is)."""
    return ["ssh", *ssh_options(remote, socket), "-O", "check", remote.host]


def forward_argv(remote: Remote, socket: Path, local: str, far: str) -> list[str]:
    """`ssh -O forward -L LOCAL:FAR`: the shared connection forwards unix socket LOCAL here to FAR on the login
    node (the hpctrain server's). The master binds LOCAL, so a stale file there is removed first (the caller's
    job: the master's StreamLocalBindUnlink was fixed when it started)."""
    return ["ssh", *ssh_options(remote, socket), "-O", "forward", "-L", f"{local}:{far}", remote.host]


def cancel_argv(remote: Remote, socket: Path, local: str, far: str) -> list[str]:
    """`ssh -O cancel -L LOCAL:FAR`: drop that forward (the master refuses to add one it already has)."""
    return ["ssh", *ssh_options(remote, socket), "-O", "cancel", "-L", f"{local}:{far}", remote.host]


def exit_argv(remote: Remote, socket: Path) -> list[str]:
    """`ssh -O exit`: close the shared connection (`hpctrain remote close`)."""
    return ["ssh", *ssh_options(remote, socket), "-O", "exit", remote.host]


def _rsync_e(remote: Remote, socket: Path) -> str:
    return " ".join(shlex.quote(w) for w in ["ssh", *ssh_options(remote, socket)])


def _remote_path(remote: Remote, path: str) -> str:
    """HOST:PATH for rsync: --protect-args (-s) sends PATH to the remote rsync unsplit, so it is not quoted."""
    return f"{remote.host}:{path}"


def rsync_up_argv(remote: Remote, socket: Path, sources: Sequence[str], dest: str,
                  excludes: Sequence[str] = (), link_dest: str = "", rsh: str = "") -> list[str]:
    """Send SOURCES (absolute local paths, kept whole under DEST with -R) to DEST under remote_dir, made if
    missing, over the shared connection. With LINK_DEST (the previous upload folder), a file unchanged since
    then is hard-linked there, not sent: each submit has a folder of its own, and only what changed travels.
    RSH replaces ssh as rsync's remote shell (the login node's hpctrain server: hpctrain.remote.pipe)."""
    # The folder is made by the remote shell that starts rsync there (--rsync-path), not by a round trip of
    # its own; rsync's --mkpath would do it too but is missing before 3.2.3 (RHEL 8 login nodes have 3.1).
    made = f"mkdir -p -- {shlex.quote(_under(remote, dest))} && rsync"
    # --checksum: rsync's quick check (size and whole-second mtime) takes a file edited in the same second as
    # the last upload, to the same size, for unchanged and links the old copy; what travels is small (max_upload_mb).
    return ["rsync", "-a", "-s", "-R", "--checksum", f"--rsync-path={made}", "--partial",
            "--chmod=Du=rwx,Dgo=,Fu=rw,Fgo=",
            *([f"--link-dest={_under(remote, link_dest)}"] if link_dest else []),
            *(f"--exclude={x}" for x in excludes), "-e", rsh or _rsync_e(remote, socket),
            "--", *sources, _remote_path(remote, _under(remote, dest) + "/")]


def rsync_down_argv(remote: Remote, socket: Path, source: str, dest: str, excludes: Sequence[str] = (),
                    rsh: str = "") -> list[str]:
    """Fetch folder SOURCE (under remote_dir) into local DEST: results back on demand."""
    return ["rsync", "-a", "-s", "--partial", *(f"--exclude={x}" for x in excludes),
            "-e", rsh or _rsync_e(remote, socket),
            "--", _remote_path(remote, _under(remote, source).rstrip("/") + "/"), dest.rstrip("/") + "/"]


def _under(remote: Remote, path: str) -> str:
    """PATH as rsync names it: absolute stays, relative is under remote_dir (itself under the remote home)."""
    return path if path.startswith("/") else f"{remote.remote_dir.rstrip('/')}/{path}"


def missing_program(exc: FileNotFoundError, what: str) -> str:
    """ssh or rsync itself is not installed on this machine."""
    name = Path(str(exc.filename or "ssh")).name
    return (f"{what}: no `{name}` on this machine (hpctrain uses your own OpenSSH and rsync). Fix: install "
            "it (Debian/Ubuntu: apt-get install openssh-client rsync; macOS has both; Windows: use WSL)")


def disk_full(remote: Remote, what: str) -> str:
    return (f"{what}: the login node's disk is full under {remote.remote_dir} (sites.{remote.site}.remote."
            "remote_dir). Fix: free space there (old run folders, checkpoints) or point remote_dir at a larger "
            "filesystem")


# rsync's exit codes after a write on the receiving side failed: file I/O, the stream cut, a partial transfer.
RSYNC_WRITE_FAILED = frozenset({11, 12, 23})
# Less than this free under remote_dir after a failed upload: the disk is what stopped it.
FULL_BELOW_KB = 1024


def df_line(remote: Remote) -> str:
    """The shell line that prints the free kilobytes of remote_dir's filesystem (POSIX df)."""
    return f"df -Pk -- {shlex.quote(remote.remote_dir)} | awk 'NR == 2 {{print $4}}'"


def failure(remote: Remote, rc: int, stderr: str, what: str) -> str | None:
    """One line for a failed ssh/rsync, naming cause and fix; None when the remote hpctrain itself failed
    (its own message is already on stderr)."""
    err = stderr.lower()
    where = f"{remote.host}" + (f":{remote.port}" if remote.port else "")
    site = f"sites.{remote.site}.remote"
    if "no space left on device" in err or "disk quota exceeded" in err:
        return disk_full(remote, what)
    if "rsync: command not found" in err or "rsync: not found" in err:
        return (f"{what}: no rsync on {where} (files go to the login node with rsync). Fix: install rsync there "
                "(Debian/Ubuntu: apt-get install rsync; RHEL: dnf install rsync), or ask its admins")
    if rc == 127:  # `exec env hpctrain ...` found no such program
        return (f"{what}: no hpctrain on {where} ({site}.hpctrain = {remote.hpctrain!r}: command not found). "
                f"Fix: `hpctrain remote setup --site {remote.site}` installs it into a venv under "
                f"{remote.remote_dir}, or set {site}.hpctrain to its path there")
    if rc not in (SSH_FAILED, RSYNC_STREAM):  # the remote program's own exit: its message is on stderr already
        return None
    if "remote host identification has changed" in err or "host key verification failed" in err:
        return (f"{what}: the host key of {where} does not match your known_hosts (the host was reinstalled, or "
                f"someone is in between). Fix: confirm the new key with your cluster's admins, then run "
                f"`ssh-keygen -R {shlex.quote(remote.host.rpartition('@')[2])}` and connect once with plain ssh")
    if "permission denied" in err or "passphrase" in err or "password" in err:
        return (f"{what}: {where} asked for a password or passphrase, and hpctrain never prompts (BatchMode). "
                f"Fix: load your key into the agent (ssh-add), or run `hpctrain remote connect --site "
                f"{remote.site}` once: it opens the shared connection with the prompts on your terminal")
    line = next((x.strip() for x in reversed(stderr.splitlines()) if x.strip()), "no answer")
    return (f"{what}: the connection to {where} failed or dropped ({line}). Jobs already queued keep running. "
            "Fix: check the network/VPN and run the command again (a submit that was under way is found again, "
            "never queued twice)")
