"""From a laptop: commands forwarded to the login node named by a site's `[remote]` (hpctrain.remote).

`hpctrain --remote SITE COMMAND ...` (or HPCTRAIN_REMOTE=SITE, or `submit --site SITE` whose profile has a
`[remote]`) runs COMMAND on that login host. `plan` needs no cluster and runs here. `hpctrain remote ...`
opens, checks and closes the shared connection, and fetches a run's results.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from hpctrain.remote.forward import Connection
    from hpctrain.remote.site import Remote

REMOTE_ENV = "HPCTRAIN_REMOTE"  # the site whose [remote] every command goes to (as --remote SITE)
FORWARDED = ("submit", "list", "status", "logs", "summary", "stacks", "cancel", "resubmit", "export", "sync",
             "registry")
# Results back on demand: everything but checkpoints and submitit's pickles unless asked.
PULL_EXCLUDES = ["checkpoints/", "submitit/*.pkl"]


def register(group: click.Group) -> None:
    group.add_command(remote_group)


def load_profile(site: str, run_file: str | None = None) -> tuple[dict[str, Any], Path | None]:
    """Site profile SITE as a dict, and the file it came from (None: a [sites.NAME] table of the run file)."""
    from hpctrain.spec import site as config

    by_path = config.site_path(site)
    if by_path is not None:
        return config.read_toml(by_path, f"site file {str(by_path)!r}"), by_path.absolute()
    inline: dict[str, Any] = {}
    near = Path(run_file).parent if run_file else None
    if run_file and Path(run_file).is_file():
        inline = config.read_toml(Path(run_file), "run file").get("sites", {}) or {}
    prof = config.load_site(site, inline, near)
    if site in inline:
        return prof, None
    for cand in (config.config_dir() / "sites" / f"{site}.toml", *([near / "sites" / f"{site}.toml"] if near else [])):
        if cand.is_file():
            return prof, cand.absolute()
    return prof, None


def remote_for(site: str, run_file: str | None = None) -> tuple[Remote | None, Path | None]:
    from hpctrain.remote.site import remote_of

    prof, path = load_profile(site, run_file)
    return remote_of(Path(site).stem if site.endswith(".toml") else site, prof), path


def maybe_forward(ctx: click.Context, cmd_name: str, args: list[str], chosen: str | None,
                  flags_of: Callable[[click.Context], dict[str, Any]]) -> int | None:
    """Run CMD_NAME ARGS on the login node when a [remote] applies (exit status returned); None: run here."""
    from hpctrain.remote.ssh import ON_LOGIN

    if os.environ.get(ON_LOGIN) or cmd_name in ("remote", "plan", "hostfile") or "--help" in args or "-h" in args:
        return None
    site = chosen or os.environ.get(REMOTE_ENV) or None
    sub, job_site = None, ""
    if cmd_name == "submit":
        cmd = ctx.command.get_command(ctx, cmd_name)  # type: ignore[attr-defined]
        sub = cmd.make_context(cmd_name, list(args), parent=ctx)
        # The job's site profile (what SLURM is asked for) may differ from the one naming the login host.
        job_site = sub.params.get("site") or _run_file_site(sub.params.get("runfile")) or ""
        site = site or job_site
    if not site:
        return None
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
    from hpctrain.remote import forward

    conn = forward.Connection(remote)
    if sub is not None:
        job_file = site_file if job_site in ("", site) else load_profile(job_site, sub.params.get("runfile"))[1]
        return _submit(conn, sub, flags_of(sub), args, job_file, job_site or site)
    if cmd_name == "summary":
        return _summary(conn, args)
    for rec in forward.pending(remote):  # a submit cut off earlier: say what became of it
        _settle(conn, rec, same=False)
    tty = sys.stdout.isatty() and (("status" == cmd_name and "--watch" in args) or
                                   ("logs" == cmd_name and ("--follow" in args or "-f" in args)))
    return conn.run([cmd_name, *args], tty=tty).returncode


def _run_file_site(run_file: str | None) -> str | None:
    if not run_file or not Path(run_file).is_file():
        return None
    from hpctrain.spec.site import read_toml

    value = read_toml(Path(run_file), "run file").get("site")
    return value if isinstance(value, str) and value else None


def _submit(conn: Connection, sub: click.Context, flags: dict[str, Any], args: list[str],
            site_file: Path | None, job_site: str) -> int:
    """Send what the request names, then submit on the login node, detached from the connection."""
    from hpctrain.remote import forward, travel
    from hpctrain.spec.model import resolve_with_defaults

    run_file = sub.params.get("runfile")
    spec, _ = resolve_with_defaults(run_file, flags, str(site_file or job_site), check=False)
    named = {"launch.script": spec.launch.script, "model.path": spec.model.path, "model.config": spec.model.config,
             "data.source": spec.data.source, "data.tokenizer": spec.data.tokenizer,
             "launch.template_dir": spec.launch.template_dir}
    items = travel.local_items(run_file, site_file, named)
    travel.check_size(conn.remote, items)
    digest = travel.digest(args, items)
    for rec in forward.pending(conn.remote):  # a submit cut off earlier: its answer first, never a second job
        code = _settle(conn, rec, same=rec["digest"] == digest)
        if rec["digest"] == digest and code is not None:
            return code
    probe = conn.probe()
    submit_id = time.strftime("%Y%m%d-%H%M%S-") + digest[:8]
    stage = f"{probe.remote_dir}/{forward.UPLOADS}/{submit_id}"
    cwd = travel.mirrored(stage, os.getcwd())
    conn.upload(items, stage, forward.last_upload(conn.remote))
    forward.last_upload(conn.remote, stage)
    extra: list[str] = []
    for item in items:
        if item.key:
            extra += ["--set", f"{item.key}={travel.mirrored(stage, named[item.key])}"]
    if site_file is not None:
        extra += ["--site", travel.mirrored(stage, site_file)]
    words = list(args)
    if run_file and Path(run_file).is_absolute():
        words[words.index(run_file)] = travel.mirrored(stage, run_file)
    cut = words.index("--") if "--" in words else len(words)
    words = [*words[:cut], *extra, *words[cut:]]
    record = forward.record(conn.remote, submit_id, digest, stage)
    proc = conn.shell(forward.detached_submit(conn.remote, ["submit", *words], cwd, stage),
                      f"submit on {conn.remote.host}")
    record.unlink(missing_ok=True)
    return proc.returncode


def _settle(conn: Connection, rec: dict[str, Any], same: bool) -> int | None:
    """Read the answer of a submit recorded earlier; its exit status when it went through, else None."""
    from hpctrain.remote import forward

    head, out = forward.settle(conn, rec)
    Path(rec["path"]).unlink(missing_ok=True)
    if head.startswith("done"):
        click.echo(f"hpctrain: the submit of {time.strftime('%H:%M:%S', time.localtime(rec['sent']))} "
                   f"({rec['id']}), cut off by a dropped connection, reached the login node; its answer:", err=True)
        click.echo(out, nl=False)
        rc = int(head.split()[1]) if len(head.split()) > 1 and head.split()[1].isdigit() else 1
        return rc if same else None
    if head == "never":
        click.echo(f"hpctrain: the submit {rec['id']}, cut off by a dropped connection, never started on "
                   f"{conn.remote.host}: nothing was queued by it", err=True)
        return None
    # Started, no answer, no longer running (the login node rebooted?): whether sbatch ran is unknown. Say so
    # once instead of submitting again; the note is gone, so the same submit typed again goes through.
    from hpctrain.remote.forward import RemoteFailure

    raise RemoteFailure(
        f"submit {rec['id']}: started on {conn.remote.host} and stopped there before it answered (upload folder "
        f"{rec['stage']}), so a job may be queued. Fix: look with `hpctrain --remote {conn.remote.site} list` "
        f"(`hpctrain --remote {conn.remote.site} registry rebuild` finds a job of unknown outcome by its tag); "
        "if it is not there, run the submit again")


def _summary(conn: Connection, args: list[str]) -> int:
    """`summary --plot FILE`: the plot is drawn on the login node and fetched to FILE here."""
    words = list(args)
    plot = next((w.split("=", 1)[1] for w in words if w.startswith("--plot=")), None)
    if plot is None and "--plot" in words and words.index("--plot") + 1 < len(words):
        plot = words[words.index("--plot") + 1]
    if plot is None:
        return conn.run(["summary", *words]).returncode
    probe = conn.probe()
    folder = f"{probe.remote_dir}/plots/{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    there = f"{folder}/{Path(plot).name}"
    words = [w for w in words if not w.startswith("--plot=")]
    if "--plot" in words:
        i = words.index("--plot")
        del words[i:i + 2]
    conn.shell(f"mkdir -p -- {_q(folder)}", f"summary on {conn.remote.host}")
    rc = conn.run(["summary", *words, "--plot", there]).returncode
    if rc == 0:
        with tempfile.TemporaryDirectory() as tmp:
            conn.pull(folder, Path(tmp), [])
            Path(plot).parent.mkdir(parents=True, exist_ok=True)
            os.replace(Path(tmp) / Path(plot).name, plot)
    return rc


def _q(text: str) -> str:
    import shlex

    return shlex.quote(text)


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
@click.option("--wheel", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Install this wheel (a cluster without PyPI access) instead of hpctrain==VERSION from the index.")
@click.option("--python", "python", default="python3", show_default=True, help="The login node's Python (3.10+).")
def setup_cmd(site: str, wheel: str | None, python: str) -> None:
    """Create REMOTE_DIR/venv on the login node and install hpctrain there (the same version as here); then
    set [remote] hpctrain to the path it prints."""
    from hpctrain import __version__
    from hpctrain.remote import ssh, travel

    conn = _conn(site)
    requirement = f"hpctrain=={__version__}"
    if wheel:
        # relative: under remote_dir, where the setup line runs
        conn.upload([travel.Item("", Path(wheel).absolute(), Path(wheel).stat().st_size)], "wheels")
        requirement = travel.mirrored("wheels", wheel)
    proc = conn.shell(ssh.setup_shell(conn.remote, requirement, python), f"setup on {conn.remote.host}",
                      capture=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(proc.returncode)
    click.echo(f"installed; in the site profile set: [remote] hpctrain = {proc.stdout.splitlines()[0]!r}" if
               proc.stdout else "installed")
