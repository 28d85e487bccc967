"""Metrics per attempt: torn files, attempt splitting, lost work, GPU/CPU hours."""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.collect import metrics as cm


def rec(step: int, t: float, ckpt: float = 0.0, loss: float | None = None) -> dict[str, object]:
    return {"step": step, "loss": loss if loss is not None else 10.0 - step / 10, "lr": 1e-4, "tokens": 4096,
            "tokens_per_s": 1000.0 + step, "tflops": 0.5, "mfu": None, "gpu_mem_gb": 0.0, "host_mem_gb": 1.2,
            "padding_frac": 0.0, "ckpt_s": ckpt, "time": t}


def write(path: Path, recs: list[dict[str, object]], tail: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in recs) + tail)
    return path


def test_metrics_cut_mid_line(tmp_path: Path) -> None:
    p = write(tmp_path / "m.jsonl", [rec(1, 100), rec(2, 101)], b'{"step": 3, "loss": 9.7, "tok')
    recs, bad = cm.read_metrics(p)
    assert [r["step"] for r in recs] == [1, 2] and bad == 1


def test_metrics_with_junk_and_nan(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_bytes(b'\x00\x00\n{"step": 1, "loss": NaN, "time": 5}\n[1,2]\n{"nostep": 1}\n\xff\xfe\n')
    recs, bad = cm.read_metrics(p)
    assert [r["step"] for r in recs] == [1] and bad == 4
    m = cm.attempt_metrics(recs, [], [])
    assert m.last_loss is None  # NaN is not JSON: reported as unknown


def test_missing_file(tmp_path: Path) -> None:
    assert cm.read_metrics(tmp_path / "nope.jsonl") == ([], 0)


def test_split_by_start_times_and_lost_work() -> None:
    a0 = [rec(s, 100 + s, ckpt=1.0 if s == 10 else 0.0) for s in range(1, 15)]  # ckpt at 10, died at 14
    a1 = [rec(s, 1000 + s, ckpt=1.0 if s == 20 else 0.0) for s in range(11, 21)]  # resumed from 10
    per = cm.split_by_attempt(a0 + a1, [90.0, 1000.0])
    assert [len(p) for p in per] == [14, 10]
    m0 = cm.attempt_metrics(per[0], [], [])
    assert (m0.first_step, m0.last_step, m0.last_checkpoint_step, m0.lost_steps) == (1, 14, 10, 4)
    m1 = cm.attempt_metrics(per[1], per[0], [])
    assert (m1.first_step, m1.last_step, m1.steps_done, m1.lost_steps) == (11, 20, 10, 0)
    assert m1.tokens_per_s == 1000.0 + 16  # median of steps 12..20 (first step skipped)


def test_split_without_times_uses_step_regressions() -> None:
    recs = [{"step": s} for s in (1, 2, 3, 2, 3, 4, 5)]
    per = cm.split_by_attempt(recs, [None, None, None])  # attempt 0 died before step 1
    assert [[r["step"] for r in p] for p in per] == [[], [1, 2, 3], [2, 3, 4, 5]]


def test_resume_point_counts_as_checkpoint() -> None:
    m = cm.attempt_metrics([{"step": s, "ckpt_s": 0.0} for s in range(31, 36)], [], [])
    assert (m.last_checkpoint_step, m.lost_steps) == (30, 5)


def test_disk_checkpoints_when_metrics_lack_ckpt_s(tmp_path: Path) -> None:
    for s, complete in ((5, True), (8, False)):
        d = tmp_path / f"step-{s}"
        d.mkdir()
        if complete:
            (d / "hpctrain.json").write_text("{}")
    (tmp_path / ".tmp-step-9").mkdir()
    ckpts = cm.complete_checkpoints(tmp_path)
    assert ckpts == [5]
    m = cm.attempt_metrics([{"step": s} for s in range(1, 10)], [], ckpts)
    assert (m.last_checkpoint_step, m.lost_steps) == (5, 4)


def test_no_checkpoint_loses_everything() -> None:
    m = cm.attempt_metrics([{"step": s, "ckpt_s": 0} for s in range(1, 8)], [], [])
    assert (m.last_checkpoint_step, m.lost_steps) == (None, 7)


def test_resource_hours() -> None:
    assert cm.resource_hours(3600, 4, 8, 64) == (32.0, 0.0)
    assert cm.resource_hours(1800, 2, 0, 4) == (0.0, 4.0)  # CPU run: CPU-hours, never GPU-hours
    assert cm.resource_hours(None, 2, 8, 1) == (0.0, 0.0)
