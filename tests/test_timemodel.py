"""hpctrain.plan.timemodel: the predicted step against every step measured on the H200 (within 15%), its
properties, and the planner choosing by it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.plan import memory as M
from hpctrain.plan import timemodel as T
from hpctrain.plan.planner import load_model_config, make_plan, model_arch, param_count
from hpctrain.spec.model import Data, Model, Parallel, Resources, Spec, Train

H200 = Resources(gpus_per_node=1, gpu_mem_gb=139, mem="125G", cpus_per_task=16)


def work(model: str, mb: int, accum: int, ac: bool, offload: bool, ratio: float = 1.0,
         pageable: bool = False) -> T.Work:
    a = model_arch(load_model_config(Model(config=model)))
    n = param_count(a)
    fpt = T.model_flops_per_token(n, a["vocab"], a["hidden"], a["layers"], 4096, a["tied"])
    frac = M.cpu_share(M.sub_groups(a, 1), ratio) if offload else 0.0
    return T.Work(params=n, flops_per_token=fpt, tokens=mb * accum * 4096, hidden=a["hidden"], micro_steps=accum,
                  recompute=ac, offload=offload, cpu_fraction=frac, pageable_copy_back=pageable)


# Measured steps on one H200, seq 4096, bf16 (BENCHMARKS.md, December; issue 18; from 2026-12-02 bench/gpu_suite.py,
# raw rows in bench/results/gpu-2026-12-02/; medians of 3 where n >= 3). ZeRO-3 unless the case says ZeRO-0.
# "fit": a figure a rate of the model was fitted to (efficiency at 2048 / 4096, duplex, the pageable copy-back);
# the others check it.
# (case, model, micro, accum, recompute, offload, ratio, plain DeepSpeed's pageable copy-back, step s)
MEASURED = [
    ("1B mb 4 + AC, entrypoint (fit)", "llama-1b", 4, 1, True, False, 1.0, False, 16384 / 33465),
    ("1B mb 6, entrypoint", "llama-1b", 6, 1, False, False, 1.0, False, 24576 / 45531),
    ("1B ZeRO-0 8x2, entrypoint, the planner's choice (fit)", "llama-1b", 8, 2, False, False, 1.0, False, 1.338),
    ("1B ZeRO-0 8x2, plain", "llama-1b", 8, 2, False, False, 1.0, False, 1.347),
    ("3B ZeRO-0 2x8, entrypoint, the planner's choice", "llama-3b", 2, 8, False, False, 1.0, False, 3.380),
    ("3B ZeRO-0 2x8, plain", "llama-3b", 2, 8, False, False, 1.0, False, 3.417),
    ("3B offload mb 4 + AC, plain (fit)", "llama-3b", 4, 1, True, True, 1.0, True, 3.623),
    ("3B offload mb 4 + AC, plain, 2026-12-02", "llama-3b", 4, 1, True, True, 1.0, True, 4.097),
    ("3B offload mb 4 + AC, entrypoint, synchronous copy-back (12-01)", "llama-3b", 4, 1, True, True, 1.0, False,
     2.486),
    ("3B offload mb 4 + AC, entrypoint, asynchronous copy-back", "llama-3b", 4, 1, True, True, 1.0, False, 2.308),
    ("8B r 0.5 4x4 + AC, plain (fit)", "llama-8b", 4, 4, True, True, 0.5, True, 11.754),
    ("8B r 0.4 4x4 + AC, plain", "llama-8b", 4, 4, True, True, 0.4, True, 11.962),
    ("8B r 0.5 2x8 + AC, plain", "llama-8b", 2, 8, True, True, 0.5, True, 13.126),
    ("8B r 0.4 1x16, plain (fit)", "llama-8b", 1, 16, False, True, 0.4, True, 17.84),
    ("8B r 0.6 8x2 + AC, plain", "llama-8b", 8, 2, True, True, 0.6, True, 12.729),
    ("8B r 0.5 2x1 + AC, plain (Nov)", "llama-8b", 2, 1, True, True, 0.5, True, 4.956),
    ("8B r 0.15 2x8 + AC, entrypoint (the former choice)", "llama-8b", 2, 8, True, True, 0.15, False, 10.841),
    ("8B r 0.15 2x8 + AC, plain", "llama-8b", 2, 8, True, True, 0.15, True, 11.139),
    ("8B r 0.3 4x4 + AC, entrypoint (the planner's choice)", "llama-8b", 4, 4, True, True, 0.3, False, 9.558),
    ("8B r 0.3 4x4 + AC, plain", "llama-8b", 4, 4, True, True, 0.3, True, 11.372),
]


@pytest.mark.parametrize("case, model, mb, accum, ac, offload, ratio, pageable, step_s", MEASURED)
def test_predicted_step_within_15_percent_of_the_h200(case: str, model: str, mb: int, accum: int, ac: bool,
                                                      offload: bool, ratio: float, pageable: bool,
                                                      step_s: float) -> None:
    t = T.step_time(T.H200, work(model, mb, accum, ac, offload, ratio, pageable))
    assert t.total == pytest.approx(step_s, rel=0.15), f"{case}: {t.describe()}"


# The 3B choice runs at -12.7%: the efficiency depends on the hidden size alone, and 3072's was measured at
# micro-batch 4 with recompute (0.67); the choice runs micro-batch 2 without (0.58). Inside goal 4's 15%.
CHOICE_TOLERANCE = {"llama-1b": 0.10, "llama-3b": 0.15, "llama-8b": 0.10}


def test_the_planners_own_choices_within_their_bound() -> None:
    """The steps the planner chose and that then ran (1B, 3B and 8B on one H200, 2026-12-02, n = 3 each)."""
    chosen = [c for c in MEASURED if "the planner's choice" in c[0]]
    assert {c[1] for c in chosen} == set(CHOICE_TOLERANCE)
    for case, model, mb, accum, ac, offload, ratio, pageable, step_s in chosen:
        t = T.step_time(T.H200, work(model, mb, accum, ac, offload, ratio, pageable))
        assert t.total == pytest.approx(step_s, rel=CHOICE_TOLERANCE[model]), f"{case}: {t.describe()}"


WORKS = st.builds(
    T.Work, params=st.integers(10**6, 10**11), flops_per_token=st.floats(1e6, 1e12), tokens=st.integers(1, 10**7),
    hidden=st.integers(64, 16384), micro_steps=st.integers(1, 64), recompute=st.booleans(), offload=st.booleans(),
    cpu_fraction=st.floats(0.0, 1.0), pageable_copy_back=st.booleans(), clipping=st.booleans())


@given(WORKS)
def test_terms_are_positive_and_the_total_covers_compute_and_pcie(w: T.Work) -> None:
    t = T.step_time(T.H200, w)
    assert min(t.compute, t.pcie, t.cpu_adam, t.copy_back, t.unscale, t.gpu_adam) >= 0
    assert t.total >= max(t.compute, t.pcie)
    assert (t.pcie > 0) == w.offload


@given(WORKS, st.floats(0.0, 1.0))
def test_more_on_the_cpu_is_never_faster(w: T.Work, more: float) -> None:
    from dataclasses import replace

    hi = replace(w, cpu_fraction=min(1.0, w.cpu_fraction + more))
    assert T.step_time(T.H200, hi).total >= T.step_time(T.H200, w).total - 1e-9


@given(WORKS)
def test_recompute_and_the_pageable_copy_never_help(w: T.Work) -> None:
    from dataclasses import replace

    base = T.step_time(T.H200, replace(w, recompute=False, pageable_copy_back=False)).total
    assert T.step_time(T.H200, replace(w, recompute=True, pageable_copy_back=False)).total >= base
    assert T.step_time(T.H200, replace(w, recompute=False, pageable_copy_back=True)).total >= base


@given(st.integers(1, 20000))
def test_efficiency_stays_within_the_measured_range(hidden: int) -> None:
    effs = [e for _, e in T.H200.efficiency]
    assert min(effs) <= T.efficiency(T.H200, hidden) <= max(effs)


def test_every_figure_says_where_it_came_from() -> None:
    assert "2026-12-02" in T.H200.measured and "offload_parts.py" in T.H200.measured


def plan_8b() -> object:
    return make_plan(Spec(model=Model(config="llama-8b"), resources=H200, data=Data(seq_len=4096),
                          parallel=Parallel(zero="auto", offload_ratio="auto"),
                          train=Train(global_batch=16, activation_checkpointing="auto")))


def test_planner_chooses_8b_by_predicted_time_not_by_fitting() -> None:
    # Issue 18: micro-batch 1 without recompute fitted and was chosen (17.84 s measured); recompute at a larger
    # micro-batch offloads gradients fewer times per step and was 1.5x faster. The choice below ran at 9.555 s
    # (353 model TFLOPS, 2026-12-02), the former one (ratio 0.15, 2 x 8) at 10.841 s.
    p = plan_8b()
    assert p.activation_checkpointing and p.micro_batch > 1  # type: ignore[attr-defined]
    assert (p.offload_ratio, p.micro_batch, p.grad_accum) == (0.3, 4, 4)  # type: ignore[attr-defined]
    fitting = [o for o in p.options if o["fits"] and o["predicted_step_s"]]  # type: ignore[attr-defined]
    assert p.predicted_step_s == pytest.approx(min(o["predicted_step_s"] for o in fitting), abs=1e-3)  # type: ignore[attr-defined]
    assert any(r.startswith("predicted step") for r in p.reasons)  # type: ignore[attr-defined]


def test_cpu_ranks_have_no_time_model() -> None:
    p = make_plan(Spec(model=Model(config="llama-tiny"), resources=Resources(tasks_per_node=2),
                       data=Data(seq_len=128), train=Train(micro_batch=1)))
    assert p.predicted_step_s == 0.0 and not any(r.startswith("predicted step") for r in p.reasons)
