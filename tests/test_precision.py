"""Precision plugins: the fp16 loss scaler, overflow agreement across ranks, loss curves, validation.

- The scaler's state machine (growth, backoff, hysteresis, floor, checkpoint round trip) and the plugin
  pieces (exact unscale, inf detection, fp32 master weights), in this process.
- fp16 under ddp, zero3, tp=2 and pp=2, one 2-process torchrun launch: an inf put into ONE rank's
  gradients at step 3 makes every rank skip step 3 and halve the loss scale, leaves every rank's
  parameters bitwise unchanged by that step, and training goes on.
- 100 steps of the tiny model (same data and initial weights as fp32): fp16 within 1% of fp32's loss at
  every step, bf16 and fp16 within 1% over 5-step windows, bf16_true within 3% over 10-step windows (the
  measured gaps are noted at the tests). These run in the session's launch of one process.
- Incompatible precision/strategy picks fail at validation with one line naming both.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.launch_pool import POOL
from trainer.plugins.precision import BF16Mixed, BF16True, DynamicLossScaler, FP16Mixed, FP32MasterWeights, FP32Precision
from trainer.plugins.precision.scaler import unscale_and_check_
from trainer.config import ConfigError, compose, validate
from trainer.run import build_trainer

REPO = Path(__file__).resolve().parent.parent


# ---- the scaler's state machine ---------------------------------------------------------------------------
def test_scale_grows_after_interval_of_clean_steps() -> None:
    scaler = DynamicLossScaler(initial_scale=2.0**10, growth_factor=2.0, growth_interval=3)
    for expected in (2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**12):
        scaler.update(found_inf=False)
        assert scaler.scale == expected


def test_overflow_backs_off_and_restarts_the_growth_count() -> None:
    scaler = DynamicLossScaler(initial_scale=2.0**10, backoff_factor=0.5, growth_interval=3)
    scaler.update(False)
    scaler.update(False)
    scaler.update(True)  # default hysteresis 1: one overflow halves the scale
    assert scaler.scale == 2.0**9 and scaler.skipped_steps == 1
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 2.0**9  # two clean steps since the overflow, not three
    scaler.update(False)
    assert scaler.scale == 2.0**10


def test_hysteresis_counts_consecutive_overflows() -> None:
    scaler = DynamicLossScaler(initial_scale=2.0**10, hysteresis=2, growth_interval=100)
    scaler.update(True)
    assert scaler.scale == 2.0**10  # tolerated (but the step is still skipped)
    scaler.update(False)  # a clean step restores the tolerance
    scaler.update(True)
    assert scaler.scale == 2.0**10
    scaler.update(True)  # the second consecutive overflow backs off...
    assert scaler.scale == 2.0**9
    scaler.update(True)  # ...and so does every further one until a clean step
    assert scaler.scale == 2.0**8
    assert scaler.skipped_steps == 4


def test_scale_never_goes_below_min_scale() -> None:
    scaler = DynamicLossScaler(initial_scale=8.0, min_scale=2.0)
    for _ in range(5):
        scaler.update(True)
    assert scaler.scale == 2.0


def test_scaler_state_dict_round_trip() -> None:
    scaler = DynamicLossScaler(initial_scale=2.0**16, hysteresis=3, growth_interval=5)
    for found_inf in (False, False, True, False, True, True):
        scaler.update(found_inf)
    restored = DynamicLossScaler(initial_scale=2.0**16, hysteresis=3, growth_interval=5)
    restored.load_state_dict(json.loads(json.dumps(scaler.state_dict())))  # survives a text checkpoint
    assert restored.state_dict() == scaler.state_dict()
    for found_inf in (True, False, False, False, False, False):  # and behaves the same afterwards
        scaler.update(found_inf)
        restored.update(found_inf)
        assert restored.scale == scaler.scale


@pytest.mark.parametrize("options", [dict(hysteresis=0), dict(growth_factor=1.0), dict(backoff_factor=1.0),
                                     dict(growth_interval=0), dict(initial_scale=0.5, min_scale=1.0)])
def test_scaler_rejects_meaningless_options(options: dict) -> None:
    with pytest.raises(ValueError):
        DynamicLossScaler(**options)


# ---- plugin pieces ------------------------------------------------------------------------------------------
def test_unscale_is_exact_and_finds_inf_and_nan() -> None:
    grads = [torch.randn(5) * 2.0**16, torch.randn(3, 2, dtype=torch.float64) * 2.0**16]
    expected = [g / 2.0**16 for g in grads]
    assert unscale_and_check_(grads, 2.0**-16).item() == 0.0
    for grad, want in zip(grads, expected, strict=True):
        assert torch.equal(grad, want)  # a power-of-two scale divides exactly
    assert unscale_and_check_([torch.ones(4), torch.tensor([1.0, float("inf")])], 0.5).item() == 1.0
    assert unscale_and_check_([torch.tensor([float("nan")])], 0.5).item() == 1.0


def test_fp16_plugin_skips_the_step_on_overflow_and_saves_its_scale() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    precision = FP16Mixed(initial_scale=2.0**8)
    model = torch.nn.Module()
    model.weight = param
    precision.scale_loss(param.sum()).backward()
    assert torch.equal(param.grad, torch.full((3,), 2.0**8))
    precision.unscale_gradients(optimizer, [model])
    assert torch.equal(param.grad, torch.ones(3)) and precision.optimizer_step(optimizer)
    assert torch.allclose(param.detach(), torch.full((3,), 0.9))

    param.grad = torch.tensor([1.0, float("inf"), 1.0])
    before = param.detach().clone()
    precision.unscale_gradients(optimizer, [model])
    assert not precision.optimizer_step(optimizer) and torch.equal(param.detach(), before)
    assert precision.metrics() == {"loss_scale": 2.0**7}
    restored = FP16Mixed(initial_scale=2.0**8)
    restored.load_state_dict(precision.state_dict())
    assert restored.metrics() == {"loss_scale": 2.0**7}


def test_fp32_master_weights_keep_updates_that_bf16_rounds_away() -> None:
    """SGD steps of 1e-4 on a weight of 1.0 are below bf16's resolution there (2^-8): lost without a
    master copy, accumulated with one."""
    plain, mastered = (torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)) for _ in range(2))
    plain_opt, master_opt = torch.optim.SGD([plain], lr=1e-4), torch.optim.SGD([mastered], lr=1e-4)
    masters = FP32MasterWeights(master_opt)
    for _ in range(100):
        plain.grad = torch.ones(4, dtype=torch.bfloat16)
        mastered.grad = torch.ones(4, dtype=torch.bfloat16)
        plain_opt.step()
        masters.step(master_opt)
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.bfloat16))
    master = master_opt.param_groups[0]["params"][0]
    assert master.dtype == torch.float32 and torch.allclose(master, torch.full((4,), 0.99))
    assert torch.equal(mastered.detach(), torch.full((4,), 0.99).to(torch.bfloat16))


def test_fsdp_policies_follow_the_precision() -> None:
    assert FP32Precision().fsdp_mixed_precision() == MixedPrecisionPolicy()
    assert BF16Mixed().fsdp_mixed_precision() == MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32)
    assert BF16Mixed(reduce_dtype="bf16").fsdp_mixed_precision().reduce_dtype == torch.bfloat16
    assert FP16Mixed().fsdp_mixed_precision() == MixedPrecisionPolicy(param_dtype=torch.float16,
                                                                       reduce_dtype=torch.float32)
    # bf16_true's sharded parameters are bf16 already: only the reduction may be upcast
    assert BF16True().fsdp_mixed_precision() == MixedPrecisionPolicy()
    assert BF16True(reduce_dtype="fp32").fsdp_mixed_precision() == MixedPrecisionPolicy(reduce_dtype=torch.float32)


# ---- validation ---------------------------------------------------------------------------------------------
def validation_error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        validate(compose(overrides))
    return caught.value


@pytest.mark.parametrize(("overrides", "names"), [
    # DistributedDataParallel all-reduces the gradients in their own dtype: it cannot honour another one
    (["strategy=ddp", "trainer.devices=2", "precision=bf16", "precision.reduce_dtype=bf16"],
     ["precision=bf16", "strategy=ddp", "reduce_dtype=bf16"]),
    (["strategy=zero1", "trainer.devices=2", "precision=bf16_true", "precision.reduce_dtype=fp32"],
     ["precision=bf16_true", "strategy=zero1", "reduce_dtype=fp32"]),
    (["strategy=ddp", "trainer.devices=2", "precision=fp16", "precision.reduce_dtype=fp16"],
     ["precision=fp16", "strategy=ddp"]),
])
def test_a_reduce_dtype_ddp_cannot_honour_fails_naming_both(overrides: list[str], names: list[str]) -> None:
    error = validation_error(overrides)
    assert error.key == "precision" and "\n" not in str(error)
    for name in names:
        assert name in error.message, (name, error.message)


@pytest.mark.parametrize("overrides", [
    ["strategy=zero3", "trainer.devices=2", "precision=bf16", "precision.reduce_dtype=bf16"],
    ["strategy=zero2", "trainer.devices=2", "precision=bf16_true", "precision.reduce_dtype=fp32"],
    # 3d's replicating flavours use FSDP2's replicate, which takes the policy
    ["strategy=3d", "trainer.devices=2", "strategy.data_parallel=ddp", "precision=bf16", "precision.reduce_dtype=bf16"],
    ["strategy=ddp", "trainer.devices=2", "precision=fp16", "strategy.comm_hook=fp16"],
    ["strategy=tp", "tp=2", "trainer.devices=2", "model.n_kv_heads=4", "precision=bf16_true"],
])
def test_picks_the_strategy_honours_validate(overrides: list[str]) -> None:
    validate(compose(overrides))


@pytest.mark.parametrize(("overrides", "words"), [
    (["precision=bf16", "precision.reduce_dtype=fp16"], ["precision=bf16", "reduce_dtype", "fp32, bf16"]),
    (["precision=fp16", "precision.hysteresis=0"], ["hysteresis must be >= 1"]),
    (["precision=fp16", "precision.backoff_factor=2.0"], ["backoff_factor"]),
    (["precision=fp16", "precision.initial_scale=1e12"], ["initial_scale must be a power of two", "1.09951e+12"]),
])
def test_bad_precision_options_fail_in_one_line(overrides: list[str], words: list[str]) -> None:
    error = validation_error(overrides)
    assert error.key == "precision" and "\n" not in str(error)
    for word in words:
        assert word in error.message, (word, error.message)


# ---- runs: fp16 overflow in 2 processes, loss curves in this one -------------------------------------------
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# 6 steps of 8 sequences x 16 tokens in 2 micro-batches per data-parallel rank; every step logged
OVERFLOW_LOOP = ["trainer.seq_len=16", "trainer.global_batch_size=8", "trainer.max_steps=6", "trainer.log_every=1",
                 "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=1",
                 "data.max_bytes=100000", "callbacks=none", "trainer.peak_flops=1e12", "trainer.devices=2",
                 "precision=fp16"]
OVERFLOW_STEP, OVERFLOW_RANK = 3, 1
OVERFLOW_RUNS = {
    "ddp": ["strategy=ddp", "trainer.micro_batch_size=2"],
    "zero3": ["strategy=zero3", "trainer.micro_batch_size=2"],
    "tp": ["strategy=tp", "tp=2", "trainer.micro_batch_size=4"],
    "pp": ["strategy=pp", "pp=2", "trainer.micro_batch_size=4"],
}
# The tiny model (kept) on single 16-token sequences: fp16 matmuls run at ~1 GFLOP/s on this CPU (no
# AVX512-FP16/AMX-FP16), about 100x slower than fp32. A peak LR of 1e-3 (not 3e-3) keeps 100 steps on
# such small batches from turning chaotic, where any perturbation (fp32 with other thread counts too)
# sends per-step losses apart.
CURVE_LOOP = ["trainer.seq_len=16", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
              "trainer.max_steps=100", "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1",
              "optimizer.lr=1e-3", "lr_schedule.warmup_steps=10", "data.max_bytes=200000", "callbacks=none",
              "trainer.peak_flops=1e12", "trainer.num_threads=1"]
# At the default initial scale 2^16, a 16-token batch's scaled gradients overflow at step 2 (each token
# carries 1/16 of the loss gradient, and the RMSNorm backward multiplies it by ~1/rms = 50 at init): the
# scaler skips that update, as it must (tested above), and the curve then runs one update behind fp32's.
# Starting at 2^12, which does not overflow, compares fp16 arithmetic itself.
CURVES = {"fp32": [], "bf16": [], "bf16_true": [], "fp16": ["precision.initial_scale=4096"]}


def column(run_dir: Path, name: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


_OUT = POOL.directory("precision")
POOL.add("precision", 2, [{"name": name, "overrides": SMALL + OVERFLOW_LOOP + strategy + [
    "+callbacks.overflow._target_=tests.helpers.InjectOverflow",
    f"+callbacks.overflow.directory={_OUT / 'overflow' / name}",
    f"+callbacks.overflow.step={OVERFLOW_STEP}", f"+callbacks.overflow.rank={OVERFLOW_RANK}"]}
    for name, strategy in OVERFLOW_RUNS.items()])


# The curves are single-process runs: in the shared launches too (a launch of one process), where they run
# beside this process's tests instead of after them (the same numbers: trainer.num_threads=1 either way).
POOL.add("precision", 1, [{"name": name, "overrides": CURVE_LOOP + [f"precision={name}"] + options}
                          for name, options in CURVES.items()])


@pytest.fixture(scope="module")
def runs() -> Path:
    POOL.ensure(1, "precision")
    return POOL.ensure(2, "precision")


def overflow_rows(runs: Path, name: str) -> list[list[dict]]:
    return [json.loads((runs / "overflow" / name / f"overflow_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OVERFLOW_RUNS))
def test_fp16_overflow_on_one_rank_is_skipped_by_all(runs: Path, name: str) -> None:
    per_rank = overflow_rows(runs, name)
    for rank, rows in enumerate(per_rank):
        assert [row["step"] for row in rows] == list(range(1, 7)), (rank, rows)
        by_step = {row["step"]: row for row in rows}
        hit = by_step[OVERFLOW_STEP]
        assert hit["skipped"] and hit["params_unchanged"], (name, rank, hit)
        assert hit["loss_scale"] == by_step[OVERFLOW_STEP - 1]["loss_scale"] / 2, (name, rank, rows)
        # every other step was taken (so the bitwise check does see an update when there is one)
        for row in rows:
            if row["step"] != OVERFLOW_STEP:
                assert not row["skipped"] and not row["params_unchanged"], (name, rank, row)
        # training went on at the halved scale and still learns
        assert by_step[6]["loss_scale"] == hit["loss_scale"]
        assert by_step[6]["loss"] < by_step[1]["loss"]
    # all ranks made the same decisions with the same scale
    decisions = [[(row["skipped"], row["loss_scale"]) for row in rows] for rows in per_rank]
    assert decisions[0] == decisions[1], (name, decisions)
    # the scale is a logged metric
    run_dir = runs / "np2" / name
    scales = column(run_dir, "loss_scale")
    assert scales[OVERFLOW_STEP - 1] == scales[OVERFLOW_STEP - 2] / 2 and column(run_dir, "skipped")[2] == 1


def curve(runs: Path, name: str, metric: str = "train_loss") -> list[float]:
    values = column(runs / "np1" / name, metric)
    assert len(values) == 100, (name, len(values))
    return values


def window_means(values: list[float], width: int) -> list[float]:
    """The mean loss over consecutive windows of `width` steps (the curve's trend)."""
    assert len(values) % width == 0, (len(values), width)
    return [sum(values[i:i + width]) / width for i in range(0, len(values), width)]


def relative_gaps(losses: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / b for a, b in zip(losses, reference, strict=True)]


# Measured on 2026-12-01 (AMD EPYC with avx512_bf16, where oneDNN's bf16 matmuls use the native dot
# products), largest gap to fp32 over the 100 steps:
#   per step:              fp16 0.09%, bf16 3.2% (at a low-loss step: 1.604 vs 1.554), bf16_true 7.5%
#   over 5-step windows:   fp16 0.02%, bf16 0.38%,                                    bf16_true 1.3%
#   over 10-step windows:                                                             bf16_true 1.2%
# One 16-token step's loss is sensitive to bf16's rounding of activations (CPUs without native bf16 kept
# bf16 within 3% per step; this one does not), so mixed bf16 is held to its trend: 1% over 5-step windows,
# 2.6x what was measured and below bf16_true's 1.3% (fp32 master weights lost would fail it). fp16, whose
# 10 mantissa bits keep single steps close, is held per step: 1%, 10x the measured 0.09%.
MIXED_WINDOW_GAP = 0.01
FP16_STEP_GAP = 0.01


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_curve_tracks_fp32_over_5_step_windows(runs: Path, name: str) -> None:
    reference, losses = curve(runs, "fp32"), curve(runs, name)
    assert reference[-1] < reference[0] - 1.0  # the model learns, so the comparison means something
    gaps = relative_gaps(window_means(losses, 5), window_means(reference, 5))
    assert max(gaps) < MIXED_WINDOW_GAP, (name, gaps)


@pytest.mark.slow
def test_fp16_curve_stays_within_1_percent_of_fp32_at_every_step(runs: Path) -> None:
    gaps = relative_gaps(curve(runs, "fp16"), curve(runs, "fp32"))
    assert max(gaps) < FP16_STEP_GAP, (max(gaps), gaps.index(max(gaps)))
    # the scale is logged; no step of this run overflowed
    assert curve(runs, "fp16", "skipped") == [0] * 100 and set(curve(runs, "fp16", "loss_scale")) == {4096}


@pytest.mark.slow
def test_bf16_true_curve_stays_within_3_percent_of_fp32_over_10_step_windows(runs: Path) -> None:
    """bf16 weights round every update and shift every activation a little, and the loss of one 16-token
    sequence is sensitive to that: single steps differ from fp32's by up to ~7.5%. The trend, the mean
    over windows of 10 steps, stays within 3% (measured 1.2%)."""
    gaps = relative_gaps(window_means(curve(runs, "bf16_true"), 10), window_means(curve(runs, "fp32"), 10))
    assert max(gaps) < 0.03, gaps


# ---- skipped updates and bf16_true's master weights, in this process ---------------------------------------
SHORT = SMALL + ["trainer.seq_len=16", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
                 "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1", "data.max_bytes=100000",
                 "callbacks=none", "trainer.peak_flops=1e12", "trainer.num_threads=1"]


def test_skipped_updates_do_not_advance_the_schedule_nor_count_as_optimizer_steps(tmp_path: Path) -> None:
    """fp16 whose scaled gradients overflow at every step: no update happens, so the LR stays at the
    schedule's first value, torch sees no scheduler step before an optimizer step, and no state report is
    taken (no optimizer state exists)."""
    import warnings

    overrides = SHORT + ["precision=fp16", "precision.initial_scale=1099511627776", "trainer.max_steps=4",
                         "lr_schedule.warmup_steps=2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build_trainer(compose(overrides), tmp_path)
        summary = trainer.fit()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert column(tmp_path, "skipped") == [1.0] * 4
    assert column(tmp_path, "lr") == [3e-3 / 2] * 4  # warmup multiplier of update 0: 1/2
    assert summary["steps"] == 4 and summary["optimizer_steps"] == 0
    assert summary["state_bytes_per_rank"] == [None] and not trainer.optimizer.state


def test_bf16_true_counts_its_fp32_masters_as_optimizer_state(tmp_path: Path) -> None:
    trainer = build_trainer(compose(SHORT + ["precision=bf16_true", "trainer.max_steps=1", "lr_schedule.warmup_steps=0"]), tmp_path)
    summary = trainer.fit()
    params = summary["num_params"]
    # 2 + 2 bytes of bf16 weights and gradients; 4 (fp32 master) + 4 + 4 (Adam's m and v, fp32) of optimizer
    assert summary["state_bytes_per_rank"] == [{"params": 2 * params, "grads": 2 * params, "optimizer": 12 * params}]


def test_bf16_true_resume_continues_from_the_fp32_masters_exactly(tmp_path: Path) -> None:
    """8 steps straight (checkpoints every 4) and 4 resumed from step 4 give bitwise the same losses: the
    checkpoint holds the fp32 masters, not only their bf16 rounding. A small LR makes most updates smaller
    than a bf16 ulp, so a resume from the rounded weights alone would diverge at once."""
    overrides = SHORT + ["precision=bf16_true", "optimizer.lr=3e-4", "trainer.max_steps=8",
                         "lr_schedule.warmup_steps=2"]
    build_trainer(compose(overrides + ["callbacks=[checkpoint]", "callbacks.checkpoint.every_n_steps=4"]),
                  tmp_path / "straight").fit()
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_00000004"
    resumed = build_trainer(compose(overrides + [f"resume={checkpoint}"]), tmp_path / "resumed")
    assert resumed.step == 4
    masters = [master for _, master in resumed.precision.optimizer_tensor_pairs()]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    # the loaded masters are the saved run's, not the bf16 weights widened
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
    resumed.fit()
    assert column(tmp_path / "resumed", "train_loss") == column(tmp_path / "straight", "train_loss")[4:]
