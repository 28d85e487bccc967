"""Where hpctrain keeps things, and site profiles.

Paths follow the contract: runs in $HPCTRAIN_RUNS_DIR (else ./runs), the registry in
$HPCTRAIN_STATE_DIR (else $XDG_STATE_HOME/hpctrain, else ~/.local/state/hpctrain), site profiles in
$HPCTRAIN_CONFIG_DIR (else $XDG_CONFIG_HOME/hpctrain, else ~/.config/hpctrain) under sites/NAME.toml.

A site profile is the cluster-specific half of a request (partition, account, module loads, NCCL
variables, container runtime) so that run files stay portable between clusters.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import tomllib

from hpctrain.errors import HpcUsageError, did_you_mean

# Site profile key -> dotted spec key it sets. Tables (env, container) are handled separately.
SITE_KEYS: dict[str, str] = {
    "partition": "resources.partition",
    "account": "resources.account",
    "qos": "resources.qos",
    "constraint": "resources.constraint",
    "gpus_per_node": "resources.gpus_per_node",
    "tasks_per_node": "resources.tasks_per_node",
    "cpus_per_task": "resources.cpus_per_task",
    "mem": "resources.mem",
    "time": "resources.time",
    "gpu_mem_gb": "resources.gpu_mem_gb",
    "exclude": "resources.exclude",
    "signal_seconds": "resources.signal_seconds",
    "modules": "launch.modules",
    "launcher": "launch.launcher",
    "executor": "launch.executor",
    "template_dir": "launch.template_dir",
    "peak_tflops": "train.peak_tflops",
    "secret_env": "secret_env",
    "sbatch_extra": "slurm.extra",  # e.g. ["--reservation=R"]: merged with the run file's and --sbatch-arg
}
SITE_TABLES = ("env", "container", "remote")  # remote: the login host (hpctrain.remote.site)
CONTAINER_KEYS = ("runtime", "image", "mounts")


def _home_fallback(env_var: str, xdg_var: str, xdg_default: str) -> Path:
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    base = os.environ.get(xdg_var) or str(Path.home() / xdg_default)
    return Path(base) / "hpctrain"


def runs_dir() -> Path:
    """Parent folder of run folders: $HPCTRAIN_RUNS_DIR, else ./runs."""
    return Path(os.environ.get("HPCTRAIN_RUNS_DIR") or "runs")


def state_dir() -> Path:
    """Registry location: $HPCTRAIN_STATE_DIR, else $XDG_STATE_HOME/hpctrain, else ~/.local/state/hpctrain."""
    return _home_fallback("HPCTRAIN_STATE_DIR", "XDG_STATE_HOME", ".local/state")


def config_dir() -> Path:
    """Site profiles and template overrides: $HPCTRAIN_CONFIG_DIR, else $XDG_CONFIG_HOME/hpctrain."""
    return _home_fallback("HPCTRAIN_CONFIG_DIR", "XDG_CONFIG_HOME", ".config")


# A run file or site profile is a few kilobytes; reading is capped so that /dev/zero or a huge file
# given by mistake is refused at once instead of filling memory.
MAX_TOML_BYTES = 1 << 20


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file, turning every reason it cannot be read into a usage error naming the file."""
    def refuse(why: str, fix: str) -> HpcUsageError:
        return HpcUsageError(f"{what} = {str(path)!r}: {why}. Fix: {fix}")

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before open: opening a FIFO would block
            raise refuse("not a regular file", "pass a TOML file")
        with open(path, "rb") as fh:
            data = fh.read(MAX_TOML_BYTES + 1)
    except FileNotFoundError:
        raise refuse("file not found", "check the path") from None
    except OSError as exc:  # a loop of symlinks, a name too long, a folder, no permission, ...
        raise refuse(f"cannot be read ({exc.strerror or exc})", "check the path and its permissions") from None
    if len(data) > MAX_TOML_BYTES:
        raise refuse(f"larger than the limit of {MAX_TOML_BYTES} bytes", "pass the run file itself")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise refuse(f"not UTF-8 text (byte {exc.start})", "save the file as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise refuse(f"invalid TOML ({exc})", "correct the syntax") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise refuse("nests arrays or tables too deeply", "flatten the nesting") from None


def known_sites(inline: dict[str, Any]) -> list[str]:
    """Site names available: inline `[sites.NAME]` tables plus $CONFIG_DIR/sites/*.toml."""
    names = set(inline)
    sites = config_dir() / "sites"
    if sites.is_dir():
        names.update(p.stem for p in sites.glob("*.toml"))
    return sorted(names)


def site_path(ref: str) -> Path | None:
    """`--site path/to/NAME.toml`: a site file given by its path (it ends in .toml, or names a file)."""
    from hpctrain.errors import check_path

    check_path("site", ref, "give the name of a site profile, or the path of a site file")  # before is_file()
    p = Path(ref).expanduser()
    return p if (ref.endswith(".toml") or "/" in ref) and p.is_file() else None


def load_site(name: str, inline: dict[str, Any] | None = None, near: Path | None = None) -> dict[str, Any]:
    """Return site profile NAME as a raw dict: the run file's `[sites.NAME]` wins over the config dir, which
    wins over a `sites/NAME.toml` shipped beside the run file (`near`: the run file's folder, so that
    `hpctrain plan examples/llama-8b-h200.toml --site h200-single` works on a fresh clone).

    Unknown site names are refused, listing the known ones; unknown keys inside a profile are
    refused by `site_to_overrides`.
    """
    from hpctrain.spec.rules import check_site_name

    check_site_name(name)  # before it becomes a path: '../x' would read any TOML file
    inline = inline or {}
    if name in inline:
        prof = inline[name]
        if not isinstance(prof, dict):
            raise HpcUsageError(f"sites.{name} = {prof!r}: must be a table. Fix: write [sites.{name}]")
        return dict(prof)
    path = config_dir() / "sites" / f"{name}.toml"
    if path.is_file():
        return read_toml(path, f"site profile {name!r}")
    beside = near / "sites" / f"{name}.toml" if near is not None else None
    if beside is not None and beside.is_file():
        return read_toml(beside, f"site profile {name!r}")
    known = sorted(set(known_sites(inline)) | ({p.stem for p in (near / "sites").glob("*.toml")}
                                               if near is not None and (near / "sites").is_dir() else set()))
    listing = ", ".join(known) if known else "none defined"
    raise HpcUsageError(
        f"site = {name!r}: unknown site profile{did_you_mean(name, known)}. Fix: use one of ({listing}), "
        f"create {path}, pass --site with the path of a site file, or add a [sites.{name}] table to the run file"
    )


def site_to_overrides(name: str, prof: dict[str, Any]) -> dict[str, Any]:
    """Translate a site profile into dotted spec keys (the same shape as CLI flags)."""
    from hpctrain.errors import unknown_key

    out: dict[str, Any] = {}
    for key, value in prof.items():
        if key in SITE_KEYS:
            out[SITE_KEYS[key]] = value
        elif key == "env":
            if not isinstance(value, dict):
                raise HpcUsageError(f"sites.{name}.env = {value!r}: must be a table. Fix: write [sites.{name}.env]")
            for k, v in value.items():
                out[f"env.{k}"] = v
        elif key == "container":
            if not isinstance(value, dict):
                raise HpcUsageError(
                    f"sites.{name}.container = {value!r}: must be a table. Fix: write [sites.{name}.container]")
            for k, v in value.items():
                if k not in CONTAINER_KEYS:
                    raise unknown_key(f"sites.{name}.container", k, CONTAINER_KEYS)
                out[f"container.{k}"] = v
        elif key != "remote":  # [remote] says where hpctrain runs, not what the job is: hpctrain.remote reads it
            raise unknown_key(f"site profile {name!r}", key, [*SITE_KEYS, *SITE_TABLES])
    return out
