"""The rendered batch script, executed for real with inert stand-ins for SLURM and the container runtimes.

Stand-ins (bash scripts on PATH) record their argv and do nothing else: `srun` drops its own options and runs
the rest, the container runtimes drop theirs up to the image and run the command after it, and `python3`
only records. So every line of sbatch.sh runs (module loads, exports, hostfile, container checks, the launch
line down to the rank's python) and nothing can escape into a real job.

Two classes of issue 14 are checked here:
- a large allocation: `scontrol show hostnames` printing 10,000 hosts must not kill the script (a pipe into
  `head -n 1` under `set -eo pipefail` died with SIGPIPE, 141);
- hostile strings through every string field of the spec, the list of fields taken from the dataclasses
  themselves (a new field is covered without editing this file), for every container runtime: each payload is
  refused with a message naming its field, or rendered into a script that passes `bash -n`, runs, and creates
  no PWNED file.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import pytest

from hpctrain.errors import HpcUsageError
from hpctrain.plan.planner import make_plan
from hpctrain.render.containers import RUNTIMES
from hpctrain.render.sbatch import render_sbatch, submitit_command
from hpctrain.spec.model import Container, Model, Resources, Spec
from hpctrain.spec.presets import PRESETS
from hpctrain.spec.rules import field_types

# Each call of a stand-in leaves one file in $STANDIN_LOG: its name, MASTER_ADDR and its argv, NUL-separated.
_RECORD = ('printf \'%s\\0\' "${0##*/}" "${MASTER_ADDR:-}" "$@" >"$(mktemp -p "$STANDIN_LOG")"\n')
STANDINS: dict[str, str] = {
    # `show hostnames`: $STANDIN_HOSTS hosts node1..nodeN, written in large chunks like the real one.
    "scontrol": ('if [ "$1 $2" = "show hostnames" ]; then exec seq -f "node%g" 1 "${STANDIN_HOSTS:-2}"; fi\n'
                 + _RECORD),
    "srun": ('if [ "${1:-}" = --help ]; then echo "  --container-image=IMAGE (pyxis)"; exit 0; fi\n' + _RECORD
             + 'while [ $# -gt 0 ]; do case $1 in --output|--error) shift 2 ;; --*) shift ;; *) break ;; esac; done\n'
               'exec "$@"\n'),
    # podman: `image exists` succeeds; `run ... -w DIR IMAGE CMD...` runs CMD.
    "podman": ('[ "$1 $2" = "image exists" ] && exit 0\n' + _RECORD
               + 'while [ $# -gt 0 ]; do if [ "$1" = -w ]; then shift 3; exec "$@"; fi; shift; done\n'),
    "apptainer": _RECORD + 'while [ $# -gt 0 ]; do if [ "$1" = --pwd ]; then shift 3; exec "$@"; fi; shift; done\n',
    "ch-run": _RECORD + 'while [ $# -gt 0 ]; do if [ "$1" = -c ]; then shift 4; exec "$@"; fi; shift; done\n',
    "enroot": _RECORD,
    "module": _RECORD,
    "python3": _RECORD,
    "python": _RECORD,
}


def install_standins(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in STANDINS.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)


def run_script(script: str, work: Path, bin_dir: Path, hosts: int = 2) -> tuple[subprocess.CompletedProcess[str],
                                                                                  list[dict[str, Any]]]:
    """Run sbatch.sh with bash in `work` (the job's cwd) as SLURM would start it; returns the result and the
    stand-ins' records."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "sbatch.sh").write_text(script, encoding="utf-8")
    log = work / "standins"
    shutil.rmtree(log, ignore_errors=True)
    log.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(work), "STANDIN_LOG": str(log),
           "STANDIN_HOSTS": str(hosts), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"node[1-{hosts}]",
           "LANG": "C.UTF-8"}
    res = subprocess.run(["bash", str(work / "sbatch.sh")], cwd=work, env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    records = []
    for f in log.iterdir():
        fields = f.read_text(encoding="utf-8").split("\0")[:-1]
        if len(fields) < 2:  # the background watchdog's stand-in, killed by the script's EXIT trap mid-write
            continue
        name, master, *argv = fields
        records.append({"argv": [name, *argv], "master": master})
    return res, records


# --------------------------------------------------------------------------------------------------
# Class 1: a large allocation

def test_master_addr_survives_ten_thousand_hosts(tmp_path: Path) -> None:
    """The real rendered script, `set -eo pipefail`, scontrol printing 10,000 hosts: it reaches srun with
    MASTER_ADDR = the first host, every time (SIGPIPE is a race, so several runs), and writes all hosts."""
    bin_dir = tmp_path / "bin"
    install_standins(bin_dir)
    spec = Spec(name="big", resources=Resources(tasks_per_node=1), model=Model(config="llama-tiny"))
    run_dir = tmp_path / "run"
    script = render_sbatch(spec, make_plan(spec), run_dir, submitit_command("python3", str(run_dir / "submitit")))
    assert "set -eo pipefail" in script
    run_dir.mkdir()
    for attempt in range(5):
        res, records = run_script(script, tmp_path, bin_dir, hosts=10_000)
        assert res.returncode == 0, f"attempt {attempt}: exit {res.returncode}\n{res.stderr[-2000:]}"
        srun = [r for r in records if r["argv"][0] == "srun"]
        assert len(srun) == 1 and srun[0]["master"] == "node1", records[-3:]
        lines = (run_dir / "hostfile").read_text().splitlines()
        assert len(lines) == 10_000 and lines[0] == "node1 slots=1" and lines[-1] == "node10000 slots=1"


# --------------------------------------------------------------------------------------------------
# Hostile strings through every field

PAYLOADS = ("$(touch PWNED)", "`touch PWNED`", "; touch PWNED", "x'\"y", "--privileged", "%a", "a\ntouch PWNED")
# Path-like fields also get the payload as the last component of an absolute path (which exists where the
# field must name something real), so the payload is rendered and not only refused for not being absolute.
PATH_FIELDS = {"model.path", "model.config", "data.source", "data.tokenizer", "launch.template_dir",
               "parallel.nvme_path", "container.image", "container.mounts"}
# A valid image per runtime, where the payload goes for every field but container.image.
IMAGES = {"none": "", "apptainer": "IMG/train.sif", "pyxis": "nvcr.io#nvidia/pytorch:24.05-py3",
          "podman": "localhost/train:1", "charliecloud": "IMG/chimage"}


def _is_stringy(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is str or origin is Literal:
        return True
    if origin in (tuple, dict):
        return True
    return origin is typing.Union and any(_is_stringy(h) for h in typing.get_args(hint))


def string_fields() -> list[str]:
    """Every field of Spec and its sections that holds a string (str, Literal, tuple of str, table), as a dotted
    key: derived from the dataclasses, so a field added later is covered here without a change."""
    keys: list[str] = []
    for f in dataclasses.fields(Spec):
        hint = field_types(Spec)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(hint)
                     if _is_stringy(field_types(typing.cast(type, hint))[g.name])]
        elif _is_stringy(hint):
            keys.append(f.name)
    return keys


def _value_for(key: str, payload: str, current: object) -> object:
    """The field's value holding the payload, in the field's own shape (list entry, table value, key)."""
    if isinstance(current, tuple):
        return (payload,)
    if isinstance(current, dict):
        return {"HOSTILE": payload} if key != "model.overrides" else {"rope_scaling": payload}
    return payload


def _with(spec: Spec, key: str, value: object) -> Spec:
    section, _, name = key.partition(".")
    if not name:
        return dataclasses.replace(spec, **{section: value})
    sub = getattr(spec, section)
    extra: dict[str, object] = {"config": ""} if key == "model.path" else {}
    return dataclasses.replace(spec, **{section: dataclasses.replace(sub, **{name: value}, **extra)})


def _make_real(key: str, path: Path) -> None:
    """Create what a path field must point at for the plan to be made (model folder, config.json, ...)."""
    if key == "model.path":
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(PRESETS["llama-tiny"]))
    elif key == "model.config":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(PRESETS["llama-tiny"]))
    elif key in ("launch.template_dir", "data.tokenizer", "parallel.nvme_path"):
        path.mkdir(parents=True, exist_ok=True)
    elif key == "container.image":  # a directory image for charliecloud; apptainer only checks that it exists
        (path / "bin").mkdir(parents=True, exist_ok=True)


def _candidates(key: str, payload: str, current: object, root: Path) -> Iterator[object]:
    yield _value_for(key, payload, current)
    if key in PATH_FIELDS and "\n" not in payload:
        path = root / "p" / key / payload.replace("/", "_")
        _make_real(key, path)
        yield _value_for(key, str(path), current)


def _base(runtime: str, root: Path) -> Spec:
    image = IMAGES[runtime].replace("IMG", str(root / "img"))
    return Spec(name="hostile", resources=Resources(tasks_per_node=1), model=Model(config="llama-tiny"),
                container=Container(runtime=runtime, image=image))  # type: ignore[arg-type]


def _hostile_spec(runtime: str, payload: str, root: Path, index: int) -> tuple[Spec, list[str]]:
    """The base spec with the payload put into every string field that accepts it (one field at a time, kept
    when it renders). A refusal must be a usage error naming the field. Returns the spec and the fields it holds.

    model.path and model.config exclude each other: every other payload keeps one of them (the other is tried
    on the base spec only)."""
    base = spec = _base(runtime, root)
    held: list[str] = []
    alone = "model.config" if index % 2 == 0 else "model.path"
    for key in string_fields():
        if key == "container.image" and runtime == "none" or key == "container.runtime":
            continue  # which runtime runs is the axis of this test; an image without one is refused as such
        section, _, name = key.partition(".")
        current = getattr(getattr(spec, section), name) if name else getattr(spec, section)
        for value in _candidates(key, payload, current, root):
            try:
                candidate = _with(base if key == alone else spec, key, value)
                _render(candidate, root)
            except HpcUsageError as exc:
                assert key in str(exc), f"{key} = {value!r} refused without naming the field: {exc}"
                continue
            if key != alone:
                spec = candidate
                held.append(key)
    return spec, held


def _render(spec: Spec, work: Path) -> str:
    run_dir = work / "runs" / "r1"
    return render_sbatch(spec, make_plan(spec), run_dir, submitit_command("python3", str(run_dir / "submitit")))


def _one(runtime: str, index: int, payload: str, root: Path, bin_dir: Path) -> tuple[str, list[str]]:
    work = root / f"{runtime}-{index}"
    (work / "img" / "chimage" / "bin").mkdir(parents=True)
    (work / "img" / "train.sif").write_text("sif")
    spec, held = _hostile_spec(runtime, payload, work, index)
    run_dir = work / "runs" / "r1"
    run_dir.mkdir(parents=True)
    script = _render(spec, work)
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30, check=False)
    assert syntax.returncode == 0, f"{runtime} {payload!r}: bash -n: {syntax.stderr}"
    res, records = run_script(script, work, bin_dir)
    pwned = [str(p) for p in root.rglob("PWNED")]
    assert not pwned, f"{runtime} {payload!r} ran a command: {pwned} (fields {held})"
    ranks = [r["argv"] for r in records if r["argv"][0] == "python3" and "submitit.core._submit" in r["argv"]]
    # Every check passed (the stand-ins are permissive) and the launch line reached the rank's python, through
    # the runtime's wrapping and guard, with the folder as one argument.
    assert res.returncode == 0, f"{runtime} {payload!r} (fields {held}): exit {res.returncode}: {res.stderr[-2000:]}"
    assert ranks and ranks[-1][-1] == str(run_dir / "submitit"), (records, res.stderr)
    return f"{runtime} {payload!r}: exit {res.returncode}, rendered {len(held)} fields", held


def test_hostile_strings_through_every_field_and_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCTRAIN_CONFIG_DIR", str(tmp_path / "config"))
    bin_dir = tmp_path / "bin"
    install_standins(bin_dir)
    keys = string_fields()
    assert {"name", "launch.modules", "container.image", "container.mounts", "data.text_field", "env"} <= set(keys)
    jobs = [(rt, i, p) for rt in RUNTIMES for i, p in enumerate(PAYLOADS)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda j: _one(j[0], j[1], j[2], tmp_path, bin_dir), jobs))
    rendered = {key for _, held in results for key in held}
    # Most fields take most payloads somewhere: the test renders hostile values, it does not only refuse them.
    for key in ("name", "launch.modules", "model.path", "model.config", "data.source", "container.image",
                "container.mounts", "env"):
        assert key in rendered, f"{key} never rendered: {[r for r, _ in results]}"
