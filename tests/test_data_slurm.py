"""A prepared corpus on the local SLURM cluster: a 4-node ZeRO-3 run reads it lazily, evaluates its validation
split across the ranks, is stopped mid-epoch by SLURM's USR2 (checkpoint at the step boundary, requeue) and
resumes with the losses and eval losses of an uninterrupted run started beside it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from datakit import build_tokenizer, stdlib_texts, write_prepared
from hpctrain.data import format as fmt
from test_node_slurm import FINAL, lab, state, steps, submit, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.deepspeed]
__all__ = ["lab"]  # the fixture, shared with test_node_slurm
STEPS = 16  # USR2 after step 8, evaluations at steps 5, 10 and 15 (two of them after the resume)
# The signalled run's attempt 0 sleeps 1 s a step from step 8 on (HPCTRAIN_FAULT_INJECT slow, first=1: no CPU, the
# losses unchanged): still training when the USR2 sent after step 8 lands, 8 steps (8 s or more) later at the least.
SIGNALLED_SLOW = "slow:step=8,s=1,first=1"


def _flags(prep: Path, tok: Path) -> list[str]:
    return ["--nodes", "4", "--zero", "3", "--steps", str(STEPS), "--data", str(prep), "--eval-every", "5",
            "--set", f"data.tokenizer={tok}", "--set", "data.pack=true", "--set", "train.eval_tokens=2048",
            "--set", "checkpoint.every_steps=0"]


def _losses(run: Path) -> dict[int, Any]:
    return {r["step"]: (r["loss"], r.get("eval_loss")) for r in steps(run)}


def test_prepared_zero3_usr2_resume_mid_epoch_matches_uninterrupted(lab: list[str], tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok", vocab_size=320)  # llama-tiny's vocabulary
    prep = tmp_path / "prep"
    m = write_prepared(prep, tok, stdlib_texts(30), val_every=6, shard_docs=8)
    # STEPS x grad_accum 2 x dp 4 micro-batches of 2 packed rows of 64 tokens: a fraction of one epoch
    assert m.train.tokens / 2 > STEPS * 2 * 4 * 2 * 64
    ref_job, ref = submit(lab, *_flags(prep, tok))
    job, run = submit(lab, *_flags(prep, tok), env={**os.environ, "HPCTRAIN_FAULT_INJECT": SIGNALLED_SLOW})
    # The cluster is shared: wait for the job to start (bounded), then for its steps.
    wait_until(lambda: state(job) not in ("", "PENDING"), 900, f"job {job} to start")
    wait_until(lambda: len(steps(run)) >= 8, 400, "8 training steps")
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    wait_until(lambda: state(job) in FINAL and state(ref_job) in FINAL, 600, f"jobs {job} and {ref_job} to end")
    assert (state(job), state(ref_job)) == ("COMPLETED", "COMPLETED"), sorted((run / "logs").glob("*"))
    log0 = (run / "logs" / "attempt-0.rank-0.log").read_text()
    stopped = int(log0.split("signal 12: checkpointed at step ")[1].split(",")[0])
    assert 0 < stopped < STEPS
    assert f"resumed from step-{stopped} at step {stopped}" in (run / "logs" / "attempt-1.rank-0.log").read_text()
    assert "via slurm" in (run / "logs" / "attempt-0.rank-3.log").read_text()
    got, want = _losses(run), _losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for s in got:  # the tolerance of test_fault_slurm's reference comparisons (gloo sums on CPU)
        assert got[s][0] == pytest.approx(want[s][0], rel=1e-5, abs=1e-6), (s, got[s], want[s])
        assert (got[s][1] is None) == (want[s][1] is None), s
        if got[s][1] is not None:
            assert got[s][1] == pytest.approx(want[s][1], rel=1e-5, abs=1e-6), (s, got[s], want[s])
    print("bitwise identical losses:", got == want)
    evals = [v[1] for s, v in sorted(want.items()) if s % 5 == 0]
    assert len(evals) == 3 and all(e is not None for e in evals) and evals[-1] < evals[0]  # every 5 steps, falling
    assert fmt.is_prepared(prep)
