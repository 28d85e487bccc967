"""`hpctrain data prepare`: tokenize a corpus once, here or as a SLURM job on a CPU node.

Only click loads with this module; the data stage (numpy, tokenizers, pyarrow) is imported inside the
command, so `hpctrain --help` stays fast.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

import click

SIZE = re.compile(r"(\d+)\s*([KMGT]?)i?B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """"64M" -> 67108864 (K/M/G/T are powers of 1024); refuses anything else."""
    from hpctrain.errors import bad_value

    m = SIZE.fullmatch(text.strip())
    if not m or int(m.group(1)) < 1:
        raise bad_value("--shard-size", text, "not a size", "pass e.g. --shard-size 64M (K, M, G: 1024-based)")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


@click.group("data", short_help="Prepare training data: tokenize once into memory-mapped shards.")
def data_group() -> None:
    """Prepared data: a corpus tokenized once into uint16/uint32 shards + manifest.json, read by every rank."""


@data_group.command("prepare", short_help="Tokenize INPUT... into a prepared folder (shards + manifest).")
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
@click.option("--tokenizer", required=True, help="A local Hugging Face tokenizer folder (tokenizer.json), or 'byte'.")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="The prepared folder (default: the data cache, $HPCTRAIN_DATA_CACHE or <runs dir>/.prepared/KEY).")
@click.option("--val-fraction", type=float, default=0.005, show_default=True,
              help="Fraction of documents for the validation split (chosen by a hash of each document).")
@click.option("--workers", type=int, default=0, help="Tokenizing processes (default: every CPU this process may use).")
@click.option("--text-field", default="text", show_default=True, help="The jsonl field / parquet or arrow column.")
@click.option("--append-eos/--no-append-eos", default=True, show_default=True, help="End every document with eos.")
@click.option("--prepend-bos/--no-prepend-bos", default=False, show_default=True, help="Start every document with bos.")
@click.option("--format", "data_format", type=click.Choice(["text", "alpaca", "chat"]), default="text",
              show_default=True, help="text: documents; alpaca/chat: SFT records, tokens + loss mask (docs/data.md).")
@click.option("--messages-field", default="messages", show_default=True,
              help="--format chat: the message list's field.")
@click.option("--seq-len", type=int, default=0,
              help="--format alpaca/chat: the run's [data] seq_len; longer examples are cut or dropped (--overlong).")
@click.option("--overlong", type=click.Choice(["truncate", "drop"]), default="truncate", show_default=True,
              help="--format alpaca/chat: cut an example longer than --seq-len (the prompt stays) or drop it.")
@click.option("--shard-size", default="64M", show_default=True,
              help="Input bytes per shard (the unit of work and of resume; a compressed file is one shard).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal).")
@click.option("--submit", is_flag=True, help="Run it as a SLURM job on one CPU node instead of here.")
@click.option("--partition", default="", help="With --submit: the partition (default: the cluster's default).")
@click.option("--time", "time_limit", default="04:00:00", show_default=True, help="With --submit: the time limit.")
@click.option("--mem", default="", help="With --submit: memory of the job (SLURM --mem, e.g. 16G).")
def prepare_cmd(inputs: tuple[str, ...], tokenizer: str, out: str | None, val_fraction: float, workers: int,
                text_field: str, append_eos: bool, prepend_bos: bool, data_format: str, messages_field: str,
                seq_len: int, overlong: str, shard_size: str, progress: bool | None,
                submit: bool, partition: str, time_limit: str, mem: str) -> None:
    """Tokenize INPUT... (jsonl[.gz|.zst], txt[.gz|.zst], parquet, arrow, save_to_disk folders, folders of
    them) with the tokenizer into --out: train/ and val/ shards and manifest.json. Unchanged inputs, tokenizer
    and options are a cache hit that returns at once; a killed prepare resumes where it stopped."""
    from hpctrain.data.prepare import Options, prepare

    opts = Options(text_field=text_field, val_fraction=val_fraction, append_eos=append_eos,
                   prepend_bos=prepend_bos, shard_bytes=parse_size(shard_size), format=data_format,
                   messages_field=messages_field, seq_len=seq_len, overlong=overlong)
    if submit:
        tok = tokenizer if tokenizer == "byte" else str(Path(tokenizer).absolute())
        argv = ["--tokenizer", tok, "--val-fraction", repr(val_fraction), "--text-field", text_field,
                "--append-eos" if append_eos else "--no-append-eos",
                "--prepend-bos" if prepend_bos else "--no-prepend-bos", "--shard-size", shard_size]
        if opts.sft:
            argv += ["--format", data_format, "--messages-field", messages_field, "--seq-len", str(seq_len),
                     "--overlong", overlong]
        _submit(argv, [str(Path(i).absolute()) for i in inputs], out, workers, partition, time_limit, mem)
        return
    prepare(list(inputs), tokenizer, out, opts, workers=workers, progress=progress, echo=click.echo)


def _submit(argv: list[str], inputs: list[str], out: str | None, workers: int, partition: str, time_limit: str,
            mem: str) -> None:
    """One batch job on one node: `python -m hpctrain data prepare ARGV --out OUT --workers N -- INPUT...`.

    Every argument is shell-quoted into the script; sbatch's own options go as argv (no shell). The job's log
    is OUT/prepare-JOBID.out (without --out: <cache>/.jobs/, and the log names the folder).
    """
    from hpctrain import slurmcommands as commands
    from hpctrain.data.cache import cache_root
    from hpctrain.render.sbatch import check_job_path, slurm_filename
    from hpctrain.runs.folder import write_private

    folder = Path(out).absolute() if out else cache_root() / ".jobs"
    check_job_path("--out", folder)
    folder.mkdir(parents=True, exist_ok=True)
    cpus = workers or _node_cpus(partition)
    args = [*argv, *(["--out", str(folder)] if out else []), "--no-progress", "--workers", str(cpus), "--", *inputs]
    script = ("#!/bin/bash\n# written by `hpctrain data prepare --submit`\nset -euo pipefail\n"
              "export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false\n"
              f"exec {shlex.quote(sys.executable)} -m hpctrain data prepare "
              + " ".join(shlex.quote(a) for a in args) + "\n")
    path = folder / "prepare.sbatch"
    write_private(path, script)
    log = folder / "prepare-%j.out"
    extra = ["--job-name=hpctrain-prepare", "--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}",
             f"--time={time_limit}", f"--output={slurm_filename(folder)}/prepare-%j.out",
             *([f"--partition={partition}"] if partition else []), *([f"--mem={mem}"] if mem else [])]
    # Held signals (hpctrain.slurm.transaction): a Ctrl-C while sbatch runs still prints the job's id, and the
    # tag finds the job if sbatch's answer is lost (`squeue --me -o '%i %k'`).
    from hpctrain.slurm.transaction import HeldSignals

    job = ""
    with HeldSignals(lambda sig: f"hpctrain: {sig} arrived while submitting; prepare job {job} is queued: "
                                 f"`scancel {job}` stops it" if job else ""):
        answer = commands.sbatch(str(path), extra=extra, comment=f"hpctrain-prepare:{folder}")
        job = commands.job_id_from_sbatch(answer)
        click.echo(f"submitted prepare job {job} ({cpus} CPUs): log {str(log).replace('%j', job)}"
                   + (f", folder {folder}" if out else " (the log names the cache folder)"))


def _node_cpus(partition: str) -> int:
    """CPUs of one node of the partition (sinfo), 1 if unknown."""
    from hpctrain import slurmcommands as commands

    try:
        info = commands.partition_info(partition, tries=1)
    except click.ClickException:
        return 1
    return max(1, info.cpus) if info else 1


def register(cli: Any) -> None:
    cli.add_command(data_group)
