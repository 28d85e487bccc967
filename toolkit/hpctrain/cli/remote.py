"""From a laptop: commands forwarded to the login node named by a site's `[remote]` (hpctrain.remote).

`hpctrain --remote SITE COMMAND ...` (or HPCTRAIN_REMOTE=SITE, or `submit --site SITE` whose profile has a
`[remote]`) runs COMMAND on that login host. `plan` needs no cluster and runs here. `hpctrain remote ...`
opens, checks and closes the shared connection, and fetches a run's results.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from hpctrain.remote.forward import Connection

REMOTE_ENV = "HPCTRAIN_REMOTE"  # the site whose [remote] every command goes to (as --remote SITE)
FORWARDED = ("submit", "list", "status", "logs", "summary", "stacks", "cancel", "resubmit", "export", "sync",
             "registry")
# Results back on demand: everything but checkpoints and submitit's pickles unless asked.
PULL_EXCLUDES = ["checkpoints/", "submitit/*.pkl"]


def register(group: click.Group) -> None:
    group.add_command(remote_group)


def maybe_forward(ctx: click.Context, cmd_name: str, args: list[str], chosen: str | None,
                  flags_of: Callable[[click.Context], dict[str, Any]]) -> int | None:
    """Run CMD_NAME ARGS on the login node when a [remote] applies (exit status returned); None: run here."""
    from hpctrain.remote.ssh import ON_LOGIN

    if os.environ.get(ON_LOGIN) or cmd_name in ("remote", "plan", "hostfile") or "--help" in args or "-h" in args:
        return None
    site = chosen or os.environ.get(REMOTE_ENV) or None
    sub, job_site = None, ""
    if cmd_name == "submit":
        from hpctrain.remote.site import run_file_site

        cmd = ctx.command.get_command(ctx, cmd_name)  # type: ignore[attr-defined]
        sub = cmd.make_context(cmd_name, list(args), parent=ctx)
        # The job's site profile (what SLURM is asked for) may differ from the one naming the login host.
        job_site = sub.params.get("site") or run_file_site(sub.params.get("runfile")) or ""
        site = site or job_site
    if not site:
        return None
    from hpctrain.remote.site import load_profile, remote_for

    remote, site_file = remote_for(site, sub.params.get("runfile") if sub else None)
    if remote is None:
        if chosen or os.environ.get(REMOTE_ENV):
            from hpctrain.errors import bad_value

            raise bad_value("--remote", site, "the site profile has no [remote] table",
                            'add [remote] host = "user@login.cluster" to it (docs/remote.md)')
        return None
    if cmd_name not in FORWARDED:
        from hpctrain.errors import bad_value

        raise bad_value("--remote", site, f"`hpctrain {cmd_name}` runs on the login node only",
                        f"run it there (ssh {remote.host})")
    from hpctrain.remote import commands, forward

    conn = forward.Connection(remote)
    if sub is not None:
        run_file = sub.params.get("runfile")
        job_file = site_file if job_site in ("", site) else load_profile(job_site, run_file)[1]
        return commands.submit(conn, args, run_file, flags_of(sub), job_file, job_site or site, _say, _show)
    commands.settle_pending(conn, _say, _show)
    if cmd_name == "summary":
        return commands.summary(conn, args)
    tty = sys.stdout.isatty() and ((cmd_name == "status" and "--watch" in args) or
                                   (cmd_name == "logs" and ("--follow" in args or "-f" in args)))
    return conn.run([cmd_name, *args], tty=tty).returncode


def _say(text: str) -> None:
    click.echo(text, err=True)


def _show(text: str) -> None:
    click.echo(text, nl=False)


# --------------------------------------------------------------------------------------------------
# hpctrain remote ...

@click.group("remote", short_help="The login host of a site's [remote]: connect, check, pull results.")
def remote_group() -> None:
    """Work from a laptop: the site's [remote] names a login host reached through your own OpenSSH
    (docs/remote.md)."""


def _site_option(fn: Any) -> Any:
    return click.option("--site", required=True, envvar=REMOTE_ENV, help="Site profile with a [remote] table.")(fn)


def _conn(site: str) -> Connection:
    from hpctrain.errors import bad_value
    from hpctrain.remote.forward import Connection
    from hpctrain.remote.site import remote_for

    remote, _ = remote_for(site)
    if remote is None:
        raise bad_value("--site", site, "the site profile has no [remote] table",
                        'add [remote] host = "user@login.cluster" to it (docs/remote.md)')
    return Connection(remote)


@remote_group.command("check", short_help="Open the shared connection; print the login node's hpctrain.")
@_site_option
def check_cmd(site: str) -> None:
    from hpctrain import __version__

    conn = _conn(site)
    probe = conn.probe()
    click.echo(f"{conn.remote.host}: hpctrain {probe.version} (here {__version__}), remote_dir {probe.remote_dir}")


@remote_group.command("connect", short_help="Open the shared connection with prompts on this terminal.")
@_site_option
def connect_cmd(site: str) -> None:
    """For a login that asks for a password or a second factor: answer once here; every later command
    rides on this connection until it has been idle for the site's `persist` time."""
    import subprocess

    from hpctrain.remote import ssh

    conn = _conn(site)
    argv = _without_batch(ssh.ssh_argv(conn.remote, conn.socket, "true"))
    raise SystemExit(subprocess.run(argv, check=False).returncode)


def _without_batch(argv: list[str]) -> list[str]:
    out: list[str] = []
    for a in argv:
        if a.startswith("BatchMode="):
            out[-1:] = []  # drop its -o too
            continue
        out.append(a)
    return out


@remote_group.command("close", short_help="Close the shared connection.")
@_site_option
def close_cmd(site: str) -> None:
    _conn(site).close()


@remote_group.command("pull", short_help="Fetch a run's results (metrics, summary, logs; checkpoints if asked).")
@_site_option
@click.argument("run")
@click.option("--to", "dest", type=click.Path(file_okay=False), default=None,
              help="Local folder (default: ./runs/RUN_ID).")
@click.option("--checkpoints", is_flag=True, help="Also fetch the checkpoints (large).")
def pull_cmd(site: str, run: str, dest: str | None, checkpoints: bool) -> None:
    """Copy RUN's folder from the login node; a second pull sends only what changed."""
    import json

    conn = _conn(site)
    proc = conn.run(["status", run, "--json"], capture=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(proc.returncode)
    doc = json.loads(proc.stdout)
    target = Path(dest) if dest else Path("runs") / doc["run_id"]
    conn.pull(doc["folder"], target, [] if checkpoints else PULL_EXCLUDES)
    click.echo(f"fetched {doc['run_id']} into {target}" + ("" if checkpoints else " (without checkpoints)"))


@remote_group.command("setup", short_help="Install this hpctrain's version into a venv on the login node.")
@_site_option
@click.option("--wheel", type=click.Path(exists=True), default=None,
              help="A folder of wheels (hpctrain's and its dependencies'; a cluster without PyPI access) or one "
                   "wheel file, uploaded and installed instead of hpctrain==VERSION from the index.")
@click.option("--python", "python", default="python3", show_default=True, help="The login node's Python (3.10+).")
@click.option("--system-site-packages", is_flag=True,
              help="The venv also sees that Python's own packages "
                   "(a cluster module that already has the dependencies).")
def setup_cmd(site: str, wheel: str | None, python: str, system_site_packages: bool) -> None:
    """Create REMOTE_DIR/venv on the login node (or upgrade the one there) and install hpctrain of the same
    version as here; then set [remote] hpctrain to the path it prints. Runs over plain ssh: no hpctrain is
    needed there yet."""
    import json
    import shlex

    from hpctrain import __version__
    from hpctrain.remote import ssh, travel
    from hpctrain.remote.forward import RemoteFailure

    conn = _conn(site)
    requirement, links = f"hpctrain=={__version__}", ""
    if wheel:
        local = Path(wheel).absolute()
        # relative: under remote_dir, where the setup line runs
        conn.upload([travel.Item("", local, 0)], "wheels", served=False)
        there = travel.mirrored("wheels", local)
        requirement, links = (requirement, there) if local.is_dir() else (there, "")
    line = ssh.setup_shell(conn.remote, requirement, python, links, system_site_packages)
    proc = conn.shell(line, f"setup on {conn.remote.host}", capture=True, served=False, check=False)
    if proc.returncode != 0:
        raise RemoteFailure(ssh.setup_failure(conn.remote, proc.returncode, proc.stderr, python, requirement,
                                              bool(links))
                            or ssh.failure(conn.remote, proc.returncode, proc.stderr, f"setup on {conn.remote.host}")
                            or f"setup on {conn.remote.host} failed (rc {proc.returncode}): "
                               f"{proc.stderr.strip()[-300:]}")
    path, _, version = proc.stdout.strip().partition("\n")
    # [remote] hpctrain is split as a shell splits words: a path with spaces goes in quoted
    click.echo(f"{conn.remote.host}: {version.strip() or 'hpctrain'} in {path}\n"
               f"in the site profile set: [remote] hpctrain = {json.dumps(shlex.quote(path))}")


@remote_group.command("serve", hidden=True, short_help="(login node) The warm server of remote commands.")
@click.option("--socket", "path", required=True, help="The unix socket to listen on (its folder is made 0700).")
@click.option("--idle", type=float, default=600.0, show_default=True,
              help="Stop after this many seconds without a request (0: never).")
def serve_cmd(path: str, idle: float) -> None:
    """Started by the laptop over the shared connection (hpctrain.remote.serve): one fork per command."""
    from functools import partial

    from hpctrain.remote import serve

    _warm()
    # the `hpctrain` group itself, found from here (cli.main registers this module: no import back)
    root = click.get_current_context().find_root().command
    raise SystemExit(serve.serve(path, idle, partial(_run_cli, root)))


# The packages a forwarded command loads (torch-free by the layer contracts): imported once by the server, so
# that each forked command finds them loaded.
_WARM = ("cli", "api", "spec", "plan", "render", "runs", "slurm", "collect", "fault")


def _warm() -> None:
    import importlib
    import pkgutil
    from contextlib import suppress

    for name in _WARM:
        pkg = importlib.import_module(f"hpctrain.{name}")
        for mod in pkgutil.walk_packages(pkg.__path__, f"hpctrain.{name}."):
            with suppress(ImportError):  # an optional extra that is not installed: loaded on use, as before
                importlib.import_module(mod.name)


def _run_cli(root: click.Command, argv: list[str]) -> int:
    """ARGV as `hpctrain ARGV` would run it (ROOT: the hpctrain group), in this forked process; its exit status."""
    try:
        root.main(args=argv, prog_name="hpctrain", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
