"""The `hpctrain` command line. Nothing heavy is imported at module level (`hpctrain --help` stays fast).

Only click and the package version load with this module: spec/plan/render/dispatch are imported
inside the commands that use them, so `hpctrain --help` costs about as much as `python -c pass`
and a login node without torch runs every command.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpctrain import __version__
from hpctrain.cli.options import hatch_options
from hpctrain.spec.flags import FLAGS

if TYPE_CHECKING:
    from hpctrain.plan.model import Plan
    from hpctrain.slurm.submission import Submission
    from hpctrain.spec.model import Spec

# Secret variable names of the requests this process resolved (their secret_env): their values are
# redacted from every message too, beside ALWAYS_SECRET and names that look secret.
_SECRET_NAMES: set[str] = set()


class _RedactingGroup(click.Group):
    """Every refusal this CLI prints, hpctrain's (errors.HpcUsageError) and click's own ("'...' is not a
    valid integer"), has the value of every secret variable of the environment replaced by <redacted:NAME>,
    wherever the message got it from, and no word longer than errors.MAX_WORD (errors.bound_message)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            if ctx._protected_args:  # a [remote] site: the command runs on its login node (hpctrain.cli.remote)
                forwarded = _forwarded(ctx)
                if forwarded is not None:
                    ctx.exit(forwarded)
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise  # unexpected: the traceback stays
            # A path no file system can hold, from an input no check above knew to be a path: a refusal.
            from hpctrain.errors import HpcUsageError, path_problem

            name = str(exc.filename)
            why = path_problem(name) or "too long for the file system"
            raise _shown(HpcUsageError(f"path = {name!r}: {why}. Fix: give a shorter path")) from None
        except click.ClickException as exc:
            _shown(exc)
            raise


def _forwarded(ctx: click.Context) -> int | None:
    """The exit status of the command run on the login node, or None when it runs here. Only a command that
    names a site (--remote, HPCTRAIN_REMOTE, submit --site) loads hpctrain.cli.remote."""
    args = [*ctx._protected_args, *ctx.args]
    name = args[0]
    if not (ctx.params.get("remote") or os.environ.get("HPCTRAIN_REMOTE") or name == "submit"):
        return None
    os.umask(0o077)  # as cli() does: the records of sent submits are private
    from hpctrain.cli.remote import maybe_forward

    return maybe_forward(ctx, name, args[1:], ctx.params.get("remote"), _flags_of)


def _flags_of(sub: click.Context) -> dict[str, Any]:
    """The dotted spec keys a parsed `submit` context sets (the remote submit resolves its paths with them)."""
    params = dict(sub.params)
    if SCRIPT_ARGS in sub.meta:
        params[SCRIPT_ARGS] = sub.meta[SCRIPT_ARGS]
    return flags_from_options(params)


def _shown(exc: click.ClickException) -> click.ClickException:
    """EXC with its message as the CLI may print it: secrets redacted first, then bounded (a long secret is
    never cut into pieces that no longer match it)."""
    from hpctrain.errors import bound_message
    from hpctrain.secret import redact_environment

    # `message` is Final in click's types; rewriting it here is the one place that does.
    vars(exc)["message"] = bound_message(redact_environment(exc.message, _SECRET_NAMES))
    return exc


@click.group(cls=_RedactingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpctrain")
@click.option("--remote", default=None, metavar="SITE", help="Run the command on the login node of site SITE's "
              "[remote] over your ssh (also HPCTRAIN_REMOTE; docs/remote.md).")
def cli(remote: str | None) -> None:
    """Launch DeepSpeed training on SLURM clusters."""
    # Everything hpctrain writes is private to the user (run folders are 0700/0600): the run
    # folder's files, dry-run output, the registry; sbatch records this umask for the job (SLURM_UMASK),
    # so the job's logs are created 0600 too, and the batch script and the node entry set it again.
    os.umask(0o077)


# --------------------------------------------------------------------------------------------------
# Flags shared by `plan` and `submit`: each sets one dotted spec key (the table is hpctrain.spec.flags).

SCRIPT_ARGS = "script_args"


class ScriptArgsCommand(click.Command):
    """`hpctrain submit [OPTIONS] [RUNFILE] -- ARGS...`: every word after the first bare `--` is the user
    script's (launch.args), kept apart before click parses the rest, so that RUNFILE stays the only positional."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta[SCRIPT_ARGS] = args[:cut], tuple(args[cut + 1:])
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        if SCRIPT_ARGS in ctx.meta:
            ctx.params[SCRIPT_ARGS] = ctx.meta[SCRIPT_ARGS]
        return super().invoke(ctx)


def _click_type(kind: type | tuple[str, ...]) -> Any:
    return click.Choice(list(kind)) if isinstance(kind, tuple) else kind


def spec_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Attach every spec flag (and RUNFILE) to a command."""
    extra = [
        click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
                     help="Override any spec key, e.g. --set train.lr=1e-4 (repeatable)."),
        click.option("--site", default=None,
                     help="Site profile: NAME ($HPCTRAIN_CONFIG_DIR/sites/NAME.toml, [sites.NAME], "
                     "or sites/NAME.toml beside the run file) or the path of a site file."),
        click.option("--container", default=None, metavar="RUNTIME:IMAGE",
                     help="Container runtime and image, e.g. apptainer:/images/train.sif."),
        click.option("--model", default=None, help="Local model folder, a config.json, or a preset (llama-tiny...)."),
        click.option("--activation-checkpointing/--no-activation-checkpointing", default=None,
                     help="Recompute activations in the backward pass (--set train.activation_checkpointing=auto: "
                          "only when the run does not fit without it)."),
        click.option("--pass-ds-config/--no-pass-ds-config", default=None,
                     help="With --script/--module: append `--deepspeed_config RUN/ds_config.json` to its arguments."),
    ]
    for f in reversed(FLAGS):
        fn = click.option(f.flag, default=None, type=_click_type(f.kind), help=f.help)(fn)
    for opt in reversed(extra):
        fn = opt(fn)
    return click.argument("runfile", required=False, type=click.Path(dir_okay=False))(fn)


def flags_from_options(opts: dict[str, Any]) -> dict[str, Any]:
    """Click option values -> dotted spec keys (None = not given, so lower layers stay): the translation the
    Python API shares (hpctrain.spec.flags.keys_from_options)."""
    from hpctrain.spec.flags import keys_from_options

    return keys_from_options({**opts, "set": opts.get("overrides"), "script_args": opts.get(SCRIPT_ARGS)})


def _prepare(runfile: str | None, opts: dict[str, Any], *, check: bool = True, sweep: tuple[str, ...] = (),
             mode: str = "train", out: str | None = None) -> Submission:
    """The command's request as one Submission (hpctrain.slurm.submission); its notes on stderr."""
    from hpctrain.slurm.submission import Submission

    sub = Submission.prepare(runfile, flags_from_options(opts), site=opts.get("site"), sweep=sweep, mode=mode,
                             check=check, out=out, secrets_seen=_SECRET_NAMES)
    _print_notes(sub)
    return sub


def _print_notes(sub: Submission) -> None:
    for note in sub.notes:
        click.echo(note, err=True)
    sub.notes.clear()


# --------------------------------------------------------------------------------------------------
# plan

@cli.command("plan", cls=ScriptArgsCommand, short_help="Validate a request and print its plan.")
@spec_options
@click.option("--json", "as_json", is_flag=True, help="Print plan.json instead of a table.")
def plan_cmd(runfile: str | None, as_json: bool, **opts: Any) -> None:
    """Print world size, parallel degrees, batch arithmetic, memory estimate and ZeRO choice.

    Data and tokenizer paths are not checked here (they may live only on the cluster); submit checks them.
    """
    sub = _prepare(runfile, opts, check=False)
    spec, plan = sub.spec, sub.plan
    if as_json:
        click.echo(plan.to_json(), nl=False)
        return
    print_plan(spec, plan)


def print_defaults(spec: Spec, plan: Plan) -> None:
    """On stderr (stdout may be the batch script): each fine-tuning default chosen for the user, with its reason,
    and the fine-tuning warnings: the plan's own lines (hpctrain.plan.planner.default_reasons)."""
    from hpctrain.plan.planner import fine_tuning_lines

    for line in fine_tuning_lines(spec, plan):
        click.echo(f"hpctrain: {line}", err=True)


def print_plan(spec: Spec, plan: Plan) -> None:
    """Rich tables: the facts, every ZeRO/offload option, and the reasons."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    facts = Table(title=f"plan: {spec.name}", show_header=False)
    rows = [
        ("world size", f"{plan.world_size} = {plan.nodes} nodes x {plan.ranks_per_node} ranks ({plan.device})"),
        ("dp / tp / pp", f"{plan.dp} / {plan.tp} / {plan.pp}"),
        *([("spare nodes", (f"{plan.spare_nodes} (job allocates {plan.nodes + plan.spare_nodes} nodes; "
                            f"up to {plan.in_job_restarts} in-job restart(s))"))] if plan.spare_nodes else []),
        ("batch", f"global {plan.global_batch} = micro {plan.micro_batch} x accum {plan.grad_accum} x dp {plan.dp}"),
        ("model", f"{spec.model.path or spec.model.config}: {plan.param_count:,} parameters"),
        ("ZeRO / offload", f"stage {plan.zero_stage} / {plan.offload}"
         + (f" ratio {plan.offload_ratio:g}" if plan.offload_ratio < 1 else "")),
        ("activation ckpt", "on" if plan.activation_checkpointing else "off"),
        *([("predicted step", f"{plan.predicted_step_s:.2f} s (hpctrain.plan.timemodel)")]
          if plan.predicted_step_s else []),
        ("memory", f"{plan.memory['per_rank_gb']:.2f} GiB per rank, {plan.memory['per_host_gb']:.2f} GiB per host"
         if plan.memory.get("known", True) else "unknown: your script's model is not described (--model)"),
    ]
    if spec.launch.script or spec.launch.module:
        rows[3] = ("model", f"{spec.model.path or spec.model.config}: {plan.param_count:,} parameters (as described; "
                   "your script builds its own)" if plan.param_count else "unknown (your script builds it)")
        rows.insert(0, ("program", f"{spec.launch.script or '-m ' + spec.launch.module} via {spec.launch.launcher}"))
    for k, v in rows:
        facts.add_row(k, v)
    console.print(facts)
    if not plan.options:  # nothing estimated: no table of choices
        for reason in plan.reasons:
            console.print(f"- {reason}", markup=False, highlight=False)
        return
    opts = Table(title="memory by ZeRO stage and offload (GiB)")
    timed = any(o.get("predicted_step_s") for o in plan.options)  # GPU plans: the time model's step per option
    for col in ("zero", "offload", "ratio", "micro", "ckpt", "per rank", "per host", *(["step s"] if timed else []),
                "fits"):
        opts.add_column(col)
    for o in plan.options:
        same = (o["zero"], o["offload"], o["offload_ratio"]) == (plan.zero_stage, plan.offload, plan.offload_ratio)
        mark = "<- chosen" if same else ""
        ratio = f"{o['offload_ratio']:g} ({o['cpu_fraction']:.0%} CPU)" if o["offload"] in ("optimizer", "all") else "-"
        step = [f"{o['predicted_step_s']:.2f}" if o.get("predicted_step_s") else "-"] if timed else []
        opts.add_row(str(o["zero"]), o["offload"], ratio, str(o["micro_batch"]),
                     "on" if o["activation_checkpointing"] else "off", f"{o['device_gb']:.2f}",
                     f"{o['host_gb']:.2f}", *step, ("yes " if o["fits"] else "no ") + mark)
    console.print(opts)
    for reason in plan.reasons:
        console.print(f"- {reason}", markup=False, highlight=False)


# --------------------------------------------------------------------------------------------------
# hostfile

@cli.command("hostfile", short_help="Print a DeepSpeed hostfile for a SLURM nodelist.")
@click.option("--nodelist", required=True, help="SLURM hostlist, e.g. 'node[1-4]' (default: $SLURM_JOB_NODELIST).",
              envvar="SLURM_JOB_NODELIST")
@click.option("--slots", required=True, type=int, help="Ranks per host (GPUs per node).")
def hostfile_cmd(nodelist: str, slots: int) -> None:
    """Expand NODELIST and print `host slots=N` lines (duplicates and empty lists are errors)."""
    from hpctrain.errors import bad_value
    from hpctrain.nodelist import expand
    from hpctrain.render.sbatch import render_hostfile
    from hpctrain.spec.rules import MAX_RANKS_PER_NODE

    if slots > MAX_RANKS_PER_NODE:
        raise bad_value("--slots", slots, f"more than the limit of {MAX_RANKS_PER_NODE} ranks per node",
                        "pass --slots with the ranks per node (GPUs per node)")

    click.echo(render_hostfile(expand(nodelist), slots), nl=False)


# --------------------------------------------------------------------------------------------------
# submit

@cli.command("submit", cls=ScriptArgsCommand, short_help="Validate, render and submit a training run (or your own "
             "script: --script PATH -- ARGS).")
@spec_options
@click.option("--sweep", multiple=True, metavar="KEY=V1,V2", help="Sweep a key; one job array (repeatable).")
@click.option("--preflight", is_flag=True, help="Only run the rendezvous + all-reduce check on every rank.")
@click.option("--dry-run", is_flag=True, help="Render and print the script; submit nothing.")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="With --dry-run: write the files here.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@hatch_options
def submit_cmd(runfile: str | None, sweep: tuple[str, ...], preflight: bool, dry_run: bool, out: str | None,
               as_json: bool, **opts: Any) -> None:
    """Resolve RUNFILE + flags into a spec and plan, write the run folder(s), submit one job
    (or one job array for --sweep). With --dry-run, print the sbatch script instead.

    With --script PATH (or --module pkg.mod) hpctrain runs your own training script on every rank instead of
    its trainer; the words after `--` are its arguments, passed exactly."""
    if out and not dry_run:
        from hpctrain.errors import bad_value

        raise bad_value("--out", out, "only a dry run writes into a chosen folder",
                        "add --dry-run, or set HPCTRAIN_RUNS_DIR to choose where run folders are created")
    sub = _prepare(runfile, opts, sweep=sweep, mode="preflight" if preflight else "train", out=out)
    if not as_json:  # --json carries them in each plan's "defaults" and "reasons"
        print_defaults(sub.spec, sub.plan)
    _warn_unapplied(sub.spec, opts)
    from hpctrain.cli import options

    sub.dependency = options.dependency(opts)  # --after: resolved before anything is written
    if dry_run:
        _print_dry_run(sub, out, as_json)
        return
    from hpctrain.fault.supervisor import arm_submitted  # the job that resubmits failed attempts

    # Armed inside the submission's transaction: a Ctrl-C after sbatch still leaves the retries armed.
    subs = sub.submit(on_settled=lambda subs: arm_submitted(subs, sub.spec, sub.mode))
    _print_notes(sub)
    _report(subs, as_json)


def _warn_unapplied(spec: Spec, opts: dict[str, Any]) -> None:
    """On stderr: flags given to a --script/--module run that its program may never see (--zero, --micro-batch
    ... when it builds its own DeepSpeed config), each named (hpctrain.spec.launch.unapplied_flags)."""
    from hpctrain.spec.flags import option_name
    from hpctrain.spec.launch import unapplied_flags

    la = spec.launch
    try:
        text = Path(la.script).read_text(encoding="utf-8", errors="replace") if la.script else None
    except OSError:
        text = None  # a path on the cluster only: say that hpctrain cannot tell
    given = {f.flag: opts.get(option_name(f.flag)) for f in FLAGS}
    for line in unapplied_flags(la, given, text):
        click.echo(f"hpctrain: {line}", err=True)


def _print_dry_run(sub: Submission, out: str | None, as_json: bool) -> None:
    done = sub.dry_run(Path(out) if out else None)
    if not as_json:
        click.echo(done.script, nl=False)
        return
    from hpctrain.render.deepspeed import build_ds_config

    click.echo(json.dumps({"dry_run": True, "run_dirs": [str(d) for d in done.run_dirs], "sbatch": done.script,
                           "plans": [json.loads(p.to_json()) for _, p in done.points],
                           "ds_configs": [build_ds_config(s, p) for s, p in done.points]}, indent=2))


def _report(subs: list[Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps([{"run_id": s.run_id, "run_dir": str(s.run_dir), "job_id": s.job_id,
                                "executor": s.executor, "array_index": s.array_index} for s in subs], indent=2))
        return
    for s in subs:
        click.echo(f"submitted {s.run_id}: job {s.job_id} ({s.executor}), folder {s.run_dir}")


def main() -> None:
    """Console-script entry point."""
    cli()


# Command groups of their own modules, each importing only click at module level:
# list/status/cancel, logs/summary, data prepare, image, resubmit/supervise, export, registry, stacks, sync.
from hpctrain.cli import collect as cli_collect
from hpctrain.cli import data as cli_data
from hpctrain.cli import export as cli_export
from hpctrain.cli import fault as cli_fault
from hpctrain.cli import image as cli_image
from hpctrain.cli import registry as cli_registry
from hpctrain.cli import remote as cli_remote
from hpctrain.cli import runs as cli_runs
from hpctrain.cli import sync as cli_sync
from hpctrain.cli import watch as cli_watch

for _module in (cli_runs, cli_collect, cli_data, cli_image, cli_fault, cli_export, cli_registry, cli_watch, cli_sync,
                cli_remote):
    _module.register(cli)
