"""The laptop's half of the commands that need more than forwarding: a submit (what travels, the detached
submit, the answer of one cut off earlier) and `summary --plot` (drawn there, fetched here)."""

from __future__ import annotations

import os
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain.remote import forward, travel
from hpctrain.remote.forward import Connection


def settle_pending(conn: Connection, say: Callable[[str], None], show: Callable[[str], None]) -> None:
    """Before any other command: what became of submits cut off earlier (each said once, then forgotten)."""
    for rec in forward.pending(conn.remote):
        settle(conn, rec, False, say, show)


def submit(conn: Connection, args: list[str], run_file: str | None, flags: dict[str, Any], site_file: Path | None,
           job_site: str, say: Callable[[str], None], show: Callable[[str], None]) -> int:
    """Send what the request names, then submit on the login node, detached from the connection (ARGS: the
    words after `submit`; FLAGS: the spec keys they set). SAY prints a note, SHOW the remote answer."""
    from hpctrain.spec.model import resolve_with_defaults

    spec, _ = resolve_with_defaults(run_file, flags, str(site_file or job_site), check=False)
    named = {"launch.script": spec.launch.script, "model.path": spec.model.path, "model.config": spec.model.config,
             "data.source": spec.data.source, "data.tokenizer": spec.data.tokenizer,
             "launch.template_dir": spec.launch.template_dir}
    items = travel.local_items(run_file, site_file, named)
    travel.check_size(conn.remote, items)
    digest = travel.digest(args, items)
    for rec in forward.pending(conn.remote):  # a submit cut off earlier: its answer first, never a second job
        code = settle(conn, rec, rec["digest"] == digest, say, show)
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
    proc = conn.submit(["submit", *words], cwd, stage)
    record.unlink(missing_ok=True)
    return proc.returncode


def settle(conn: Connection, rec: dict[str, Any], same: bool, say: Callable[[str], None],
           show: Callable[[str], None]) -> int | None:
    """Read the answer of a submit recorded earlier (SAME: the one being typed again); its exit status when
    it went through and is the same, else None."""
    head, out = forward.settle(conn, rec)
    Path(rec["path"]).unlink(missing_ok=True)
    if head.startswith("done"):
        say(f"hpctrain: the submit of {time.strftime('%H:%M:%S', time.localtime(rec['sent']))} ({rec['id']}), "
            "cut off by a dropped connection, reached the login node; its answer:")
        # Typed again: its answer is this command's output. Another command's: a note on stderr, so that
        # this command's stdout (JSON, say) stays its own.
        (show if same else say)(out if same else out.rstrip("\n"))
        rc = int(head.split()[1]) if len(head.split()) > 1 and head.split()[1].isdigit() else 1
        return rc if same else None
    if head == "never":
        say(f"hpctrain: the submit {rec['id']}, cut off by a dropped connection, never started on "
            f"{conn.remote.host}: nothing was queued by it")
        return None
    # Started, no answer, no longer running (the login node rebooted?): whether sbatch ran is unknown. Say so
    # once instead of submitting again; the note is gone, so the same submit typed again goes through.
    raise forward.RemoteFailure(
        f"submit {rec['id']}: started on {conn.remote.host} and stopped there before it answered (upload folder "
        f"{rec['stage']}), so a job may be queued. Fix: look with `hpctrain --remote {conn.remote.site} list` "
        f"(`hpctrain --remote {conn.remote.site} registry rebuild` finds a job of unknown outcome by its tag); "
        "if it is not there, run the submit again")


def summary(conn: Connection, args: list[str]) -> int:
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
    conn.shell(f"mkdir -p -- {shlex.quote(folder)}", f"summary on {conn.remote.host}")
    rc = conn.run(["summary", *words, "--plot", there]).returncode
    if rc == 0:
        with tempfile.TemporaryDirectory() as tmp:
            conn.pull(folder, Path(tmp), [])
            Path(plot).parent.mkdir(parents=True, exist_ok=True)
            os.replace(Path(tmp) / Path(plot).name, plot)
    return rc
