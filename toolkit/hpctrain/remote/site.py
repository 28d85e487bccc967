"""The `[remote]` table of a site profile: which login host runs hpctrain for this laptop.

    [remote]
    host = "alice@login.cluster"     # or a Host alias of ~/.ssh/config (ProxyJump, keys, agent honoured)
    port = 22                         # optional; else ssh's own default or ~/.ssh/config
    remote_dir = "hpctrain"           # run folders, uploaded files; relative = under the remote home
    hpctrain = "hpctrain"             # the command that runs hpctrain there, e.g. "~/venv/bin/hpctrain": words
                                      # split as a shell does ("python3 -m hpctrain"; quote a path with spaces)
    ssh_config = "~/.ssh/config"      # optional: another ssh client config (ssh -F)
    persist = "10m"                   # how long the shared connection stays open after the last command
    max_upload_mb = 50                # what a submit may carry; more is refused with the way to copy it
    [remote.env]                      # variables for the remote hpctrain (e.g. HPCTRAIN_STATE_DIR)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.errors import HpcUsageError, bad_value, unknown_key

REMOTE_KEYS = ("host", "port", "remote_dir", "hpctrain", "ssh_config", "persist", "max_upload_mb", "env")
# ssh reads a host starting with '-' as an option; whitespace or control characters are never a host.
_BAD_HOST = re.compile(r"^-|[\s\x00-\x1f]")
_PERSIST = re.compile(r"^(yes|no|\d+[smhdw]?)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class Remote:
    """A login host and how hpctrain runs there (site profile `[remote]`)."""

    site: str
    host: str
    port: int = 0  # 0: ssh's default (22) or the Port of ~/.ssh/config
    remote_dir: str = "hpctrain"
    hpctrain: str = "hpctrain"
    ssh_config: str = ""
    persist: str = "10m"
    max_upload_mb: float = 50.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"sites.{self.site}.remote"
        if not self.host or _BAD_HOST.search(self.host):
            raise bad_value(f"{where}.host", self.host, "not a host ssh can be given",
                            'write host = "user@login.cluster" or a Host alias of ~/.ssh/config')
        if not 0 <= self.port <= 65535:
            raise bad_value(f"{where}.port", self.port, "not a TCP port", "write a port between 1 and 65535")
        if not self.remote_dir or "\x00" in self.remote_dir or self.remote_dir.startswith("~"):
            raise bad_value(f"{where}.remote_dir", self.remote_dir, "not a folder path for the login node",
                            'write an absolute path, or one relative to the remote home ("hpctrain")')
        if not self.hpctrain.strip():
            raise bad_value(f"{where}.hpctrain", self.hpctrain, "empty", 'write hpctrain = "hpctrain" or its path')
        if not _PERSIST.match(self.persist):
            raise bad_value(f"{where}.persist", self.persist, "not an ssh ControlPersist time",
                            'write e.g. persist = "10m" (or "no" to close after each command)')
        if not self.max_upload_mb > 0:
            raise bad_value(f"{where}.max_upload_mb", self.max_upload_mb, "must be positive", "write e.g. 50")
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise bad_value(f"{where}.env", name, "not an environment variable name", "use A-Z, 0-9 and _")


def remote_of(site: str, profile: dict[str, Any]) -> Remote | None:
    """The profile's `[remote]` as a Remote, or None when it has none. Unknown keys are refused by name."""
    table = profile.get("remote")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise HpcUsageError(f"sites.{site}.remote = {table!r}: must be a table. Fix: write [remote] in the site file")
    for key in table:
        if key not in REMOTE_KEYS:
            raise unknown_key(f"sites.{site}.remote", key, REMOTE_KEYS)
    kinds = {"host": str, "port": int, "remote_dir": str, "hpctrain": str, "ssh_config": str, "persist": str,
             "max_upload_mb": (int, float), "env": dict}
    for key, value in table.items():
        if not isinstance(value, kinds[key]) or isinstance(value, bool):  # type: ignore[arg-type]
            kind = "a table" if key == "env" else "a number" if key in ("port", "max_upload_mb") else "a string"
            raise bad_value(f"sites.{site}.remote.{key}", value, "wrong type", f"write {key} as {kind}")
    env = {str(k): str(v) for k, v in table.get("env", {}).items()}
    fields = {k: v for k, v in table.items() if k != "env"}
    return Remote(site=site, env=env, **fields)


def without_remote(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile the login node's hpctrain reads: the same, without the table that sent the command there."""
    return {k: v for k, v in profile.items() if k != "remote"}


def replace(remote: Remote, **changes: Any) -> Remote:
    """A copy with CHANGES (tests point one profile at another host key or port)."""
    return dataclasses.replace(remote, **changes)


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
    """The [remote] of site SITE (None when it has none) and the file the profile came from."""
    prof, path = load_profile(site, run_file)
    return remote_of(Path(site).stem if site.endswith(".toml") else site, prof), path


def run_file_site(run_file: str | None) -> str | None:
    """The `site` key of RUN_FILE, if it names one."""
    if not run_file or not Path(run_file).is_file():
        return None
    from hpctrain.spec.site import read_toml

    value = read_toml(Path(run_file), "run file").get("site")
    return value if isinstance(value, str) and value else None
