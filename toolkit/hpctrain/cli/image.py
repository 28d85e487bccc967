"""`hpctrain image build`: build the node image with the engine this machine has, convert it on request.

A thin front to containers/build.sh (the one implementation, also used by `make image` and the tests):
the engine is docker when its daemon answers, else podman; `--cpu` builds the CPU test image from a local
Debian base. `register(group)` adds the `image` group to the main CLI. Only click at module level.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import click

from hpctrain.errors import HpcUsageError


def register(group: click.Group) -> None:
    group.add_command(image)


@click.command("check", short_help="Start an image the way a rank would; print what it holds.")
@click.argument("container", metavar="RUNTIME:IMAGE")
@click.option("--gpu", is_flag=True, help="Add the runtime's GPU flags (--nv, CDI devices), as for a GPU job.")
@click.option("--print-only", is_flag=True, help="Print the command instead of running it.")
def check(container: str, gpu: bool, print_only: bool) -> None:
    """Run the image's python through the runtime (same wrapping and in-image guard as the rendered
    launch line) and print the hpctrain, DeepSpeed and torch versions inside. pyxis needs srun: the probe
    then runs as a one-task job step.

    \b
    hpctrain image check podman:localhost/hpctrain:cpu
    hpctrain image check charliecloud:/shared/images/hpctrain
    """
    from hpctrain.errors import bad_value
    from hpctrain.render import containers
    from hpctrain.spec.flags import RUNTIMES
    from hpctrain.spec.model import Container, Launch, Resources, Spec

    runtime, _, name = container.partition(":")
    if runtime not in RUNTIMES[1:] or not name:
        raise bad_value("RUNTIME:IMAGE", container, "not a runtime and an image",
                        "write e.g. podman:localhost/hpctrain:cpu (runtimes: " + ", ".join(RUNTIMES[1:]) + ")")
    spec = Spec(container=Container(runtime=runtime, image=name),  # type: ignore[arg-type]
                resources=Resources(gpus_per_node=1 if gpu else 0), launch=Launch(executor="slurm"))
    containers.check_submit(spec, executor="slurm")
    line = containers.probe_line(spec)
    if runtime == "charliecloud":
        line = 'export USER="${USER:-$(id -un)}"; ' + line
    if print_only:
        click.echo(f"HPCTRAIN_GUARD={shlex.quote(containers.guard(spec))} bash -c {shlex.quote(line)}")
        return
    env = {**os.environ, "HPCTRAIN_GUARD": containers.guard(spec)}
    proc = subprocess.run(["bash", "-c", line], env=env, check=False, capture_output=True, text=True)
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith("hpctrain ")]
    if proc.returncode != 0 or not out:
        raise click.ClickException(f"{runtime} image {name} failed the check (exit {proc.returncode}):\n"
                                   + (proc.stderr.strip() or proc.stdout.strip())[-2000:])
    click.echo(f"{runtime}:{name}: {out[-1]}")


def _context(given: str | None) -> Path:
    """The build context: --context, else the source checkout this package runs from, else the cwd."""
    candidates = [Path(given)] if given else [Path(__file__).resolve().parents[3], Path.cwd()]
    for c in candidates:
        if (c / "Dockerfile").is_file() and (c / "containers" / "build.sh").is_file():
            return c
    where = given or f"{candidates[0]} or {candidates[1]}"
    raise HpcUsageError(f"image build: no Dockerfile and containers/build.sh in {where}. Fix: run it from an "
                        "hpctrain source checkout, or pass --context PATH_TO_CHECKOUT")


@click.group("image", short_help="Build the node container image.")
def image() -> None:
    """Build and convert the container image every rank runs in (see containers/README.md)."""


image.add_command(check)


@image.command("build", short_help="Build the image with docker or podman; convert it if asked.")
@click.option("--cpu", is_flag=True, help="CPU test image: local Debian base (debootstrap), no ops prebuilt.")
@click.option("--engine", type=click.Choice(["docker", "podman"]), default=None,
              help="Default: docker when its daemon answers, else podman.")
@click.option("--tag", default=None, help="Image tag (default hpctrain:latest, or localhost/hpctrain:cpu with --cpu).")
@click.option("--base", "base_image", default=None, help="BASE_IMAGE build argument (a CUDA PyTorch image).")
@click.option("--charliecloud", "ch_dir", default=None, metavar="DIR",
              help="Also write the image as a Charliecloud directory image at DIR.")
@click.option("--apptainer", "sif", default=None, metavar="SIF", help="Print the commands that make a SIF.")
@click.option("--enroot", "sqsh", default=None, metavar="SQSH", help="Print the command that makes an enroot squashfs.")
@click.option("--context", default=None, type=click.Path(file_okay=False), help="hpctrain source checkout.")
@click.option("--dry-run", is_flag=True, help="Print the build command; build nothing.")
def build(cpu: bool, engine: str | None, tag: str | None, base_image: str | None, ch_dir: str | None,
          sif: str | None, sqsh: str | None, context: str | None, dry_run: bool) -> None:
    """Build ./Dockerfile (multi-stage: DeepSpeed ops prebuilt, hpctrain[node] installed).

    \b
    hpctrain image build                      # GPU image, hpctrain:latest
    hpctrain image build --cpu --charliecloud /var/tmp/hpctrain-cpu
    hpctrain image build --apptainer hpctrain.sif
    """
    ctx = _context(context)
    script = str(ctx / "containers" / "build.sh")
    env = {**os.environ, **({"ENGINE": engine} if engine else {})}
    tag = tag or ("localhost/hpctrain:cpu" if cpu else "hpctrain:latest")
    args = ["bash", script, "build", "--tag", tag]
    args += ["--cpu"] if cpu else []
    args += ["--base", base_image] if base_image else []
    args += ["--dry-run"] if dry_run else []
    steps = [args]
    if cpu and not dry_run:
        steps.insert(0, ["bash", script, "base"])  # the local Debian base the CPU image builds FROM
    if ch_dir:
        steps.append(["bash", script, "charliecloud", tag, ch_dir])
    if sif:
        steps.append(["bash", script, "apptainer", tag, sif])
    if sqsh:
        steps.append(["bash", script, "enroot", tag, sqsh])
    for step in steps:
        if dry_run and step is not args and step[2] == "charliecloud":
            click.echo("+ " + shlex.join(step))
            continue
        rc = subprocess.run(step, env=env, check=False).returncode
        if rc != 0:
            raise click.ClickException(f"`{shlex.join(step)}` failed (exit {rc}); its output is above")
