"""hpctrain.slurm.submission.Submission without a cluster: the script is rendered once and is what dispatch gets
and sbatch.sh holds; a resubmission keeps the fine-tuning defaults plan.json recorded; attempt numbers read from
a run folder are bounded. (Signals at each point of the transaction: tests/test_submit_transaction.py, on SLURM.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import test_finetune_defaults as ft
from hpctrain.render import sbatch as render_sbatch_mod
from hpctrain.slurm import dispatch
from hpctrain.slurm.submission import Submission, next_attempt_number

TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")


pytestmark = pytest.mark.usefixtures("isolated_home")


def _recording_dispatch(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def fake(run_dirs: list[Path], spec: Any, plan: Any, executor: str = "auto", **kw: Any) -> list[Any]:
        calls.append({"dirs": run_dirs, "spec": spec, **kw})
        subs = [dispatch.Submitted(run_id=d.name, run_dir=d, job_id=str(7 + i), executor="slurm",
                                   array_index=i if len(run_dirs) > 1 else None) for i, d in enumerate(run_dirs)]
        if kw.get("on_settled"):
            kw["on_settled"](subs)
        return subs

    monkeypatch.setattr(dispatch, "submit", fake)
    return calls


@pytest.mark.parametrize("sweep", [(), ("train.seed=1,2,3",)])
def test_the_script_is_rendered_once_and_is_what_sbatch_gets(monkeypatch: pytest.MonkeyPatch,
                                                             sweep: tuple[str, ...]) -> None:
    calls = _recording_dispatch(monkeypatch)
    renders: list[str] = []
    real = render_sbatch_mod.render_sbatch

    def counted(*a: Any, **k: Any) -> str:
        renders.append(real(*a, **k))
        return renders[-1]

    monkeypatch.setattr(render_sbatch_mod, "render_sbatch", counted)
    sub = Submission.prepare(TINY, {"launch.executor": "slurm"}, sweep=sweep)
    settled: list[Any] = []
    subs = sub.submit(on_settled=settled.extend)
    assert len(renders) == 1 and calls[0]["script"] == renders[0]  # no preview rendered and then replaced
    assert settled == subs and [s.run_dir for s in subs] == calls[0]["dirs"]
    for d in calls[0]["dirs"]:
        assert (d / "sbatch.sh").read_text() == renders[0]
    if sweep:
        assert "#SBATCH --array=0-2" in renders[0]


def test_a_failure_before_sbatch_leaves_no_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(*_a: Any, **_k: Any) -> list[Any]:
        raise KeyboardInterrupt  # e.g. a Ctrl-C before the transaction began

    monkeypatch.setattr(dispatch, "submit", refuse)
    with pytest.raises(KeyboardInterrupt):
        Submission.prepare(TINY, {"launch.executor": "slurm"}).submit()
    assert list((tmp_path / "runs").glob("*")) == []


def test_a_resubmission_keeps_the_fine_tuning_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _recording_dispatch(monkeypatch)
    flags = {"model.path": str(ft._model(tmp_path)), "data.source": str(ft._data(tmp_path)),
             "launch.executor": "slurm"}
    (first,) = Submission.prepare(None, flags).submit()
    recorded = json.loads((first.run_dir / "plan.json").read_text())["defaults"]
    assert {d["key"] for d in recorded} == ft.FT_KEYS
    again = Submission.resubmission(first.run_dir, time_limit="00:20:00")
    assert again.plan.defaults == recorded and again.spec.resources.time == "00:20:00"
    from hpctrain.spec.finetune import Default

    assert all(Default(**d).line() in again.plan.reasons for d in recorded)  # each with its reason, as at submit


def test_attempt_numbers_from_a_run_folder_are_bounded(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    lines = [{"attempt": 0}, {"attempt": 10**30}, {"attempt": -5}, {"attempt": True}, {"attempt": 2}]
    (run / "attempts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "logs" / "attempt-99999999999999999999.rank-0.log").write_text("")
    (run / "logs" / "attempt-4.rank-0.log").write_text("")
    assert next_attempt_number(run, [1, 10**40]) == 5


def test_a_job_recorded_after_a_list_gave_up_on_it_is_pending_again(tmp_path: Path) -> None:
    """A `list` elsewhere, with a grace period shorter than this sbatch took, marked the intent SUBMIT_FAILED;
    the job's id arrives after: the attempt is PENDING with that id, not ended."""
    from hpctrain.runs import folder as runs
    from hpctrain.runs.registry import Registry
    from hpctrain.slurm.transaction import Transaction

    d = runs.create_run_folder_atomically(tmp_path / "runs", "tiny-0", {"spec.toml": "x\n"})
    with Transaction([d], staging=d / "submitit", name="tiny", summary={}, mode="train") as tx:
        tx.begin()
        Registry().update_attempt("tiny-0", 0, state="SUBMIT_FAILED", ended=1.0, note="no job with the tag")
        tx.settle([dispatch.Submitted("tiny-0", d, "42", "slurm")])
    att = Registry().get_run("tiny-0").attempts[0]
    assert (att.job_id, att.state, att.ended, att.tag) == ("42", "PENDING", None, "hpctrain:tiny-0")
