"""One resolver from a run reference (id, prefix, name, `last`, folder path) to a run, for every command."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain.errors import HpcUsageError
from hpctrain.runs.registry import Registry
from hpctrain.runs.resolve import resolve_run


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    r = Registry(tmp_path / "state" / "registry.sqlite3")
    for i, (run_id, name) in enumerate([("tiny-20261201-100000-aaaa", "tiny"), ("tiny-20261201-110000-bbbb", "tiny"),
                                        ("big-20261201-120000-cccc", "big")]):
        folder = tmp_path / "runs" / run_id
        folder.mkdir(parents=True)
        (folder / "spec.toml").write_text(f'name = "{name}"\n')
        r.add_run(run_id, name, str(folder), "slurm", {}, created=1000.0 + i)
    return r


def test_every_kind_of_reference(reg: Registry, tmp_path: Path) -> None:
    def run_id(ref: str) -> str | None:
        found = resolve_run(reg, ref)
        return found.run.run_id if found.run else None

    assert run_id("tiny-20261201-100000-aaaa") == "tiny-20261201-100000-aaaa"  # exact id
    assert run_id("big-2026") == "big-20261201-120000-cccc"  # unique prefix
    assert run_id("tiny") == "tiny-20261201-110000-bbbb"  # a name: its newest run, not an ambiguous prefix
    assert run_id("last") == "big-20261201-120000-cccc"
    loose = tmp_path / "elsewhere"
    loose.mkdir()
    (loose / "attempts.jsonl").write_text("")
    found = resolve_run(reg, str(loose))  # a run folder this registry never saw
    assert found.run is None and found.folder == loose.absolute()
    # a registered run's folder, by its path: the registry's record (`hpctrain stacks RUN_DIR` refused it as unknown)
    assert run_id(str(tmp_path / "runs" / "big-20261201-120000-cccc")) == "big-20261201-120000-cccc"
    copy = tmp_path / "copy" / "big-20261201-120000-cccc"  # the same name elsewhere is another folder
    copy.mkdir(parents=True)
    (copy / "attempts.jsonl").write_text("")
    assert run_id(str(copy)) is None


def test_refusals_name_the_fix(reg: Registry, tmp_path: Path) -> None:
    with pytest.raises(HpcUsageError, match="matches several runs: tiny-20261201-100000-aaaa"):
        resolve_run(reg, "tiny-2026")
    with pytest.raises(HpcUsageError, match="no such run .* Close matches: big-20261201-120000-cccc"):
        resolve_run(reg, "big-20261201-120000-cxcc")
    with pytest.raises(HpcUsageError, match="empty run id"):
        resolve_run(reg, " ")
    with pytest.raises(HpcUsageError, match="no runs yet"):
        resolve_run(Registry(tmp_path / "empty.db"), "last")


def test_status_summary_and_resubmit_share_it(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """`status`, `summary` and `resubmit` accept the same references (here `last` and a name)."""
    from hpctrain.cli.main import cli
    from hpctrain.collect.summary import resolve_refs
    from hpctrain.fault.resubmit import run_folder

    monkeypatch.setenv("HPCTRAIN_STATE_DIR", str(reg.path.parent))
    monkeypatch.setattr("hpctrain.slurm.refresh.refresh", lambda reg, runs: [])
    res = CliRunner().invoke(cli, ["status", "last", "--json"])
    assert res.exit_code == 0 and "big-20261201-120000-cccc" in res.output, res.output
    inputs, errors, _ = resolve_refs(reg, ["tiny", "nope"], all_runs=False)
    assert [i.run_id for i in inputs] == ["tiny-20261201-110000-bbbb"] and "no such run" in errors[0]
    folder, _jobs = run_folder("tiny")
    assert folder.name == "tiny-20261201-110000-bbbb"


def test_commands_that_need_the_record_share_one_refusal(reg: Registry, tmp_path: Path) -> None:
    """`hpctrain export ID`, status and the watch find a registered run through runs.resolve.registered_run
    (no wrapper of their own); a folder the registry never saw is refused, naming it and the fix."""
    from hpctrain.runs.resolve import registered_run

    assert registered_run(reg, "big").run_id == "big-20261201-120000-cccc"
    loose = tmp_path / "elsewhere"
    loose.mkdir()
    (loose / "attempts.jsonl").write_text("")
    with pytest.raises(HpcUsageError) as err:
        registered_run(reg, str(loose))
    message = str(err.value)
    assert str(loose) in message and "hpctrain list" in message and f"hpctrain summary {loose}" in message
