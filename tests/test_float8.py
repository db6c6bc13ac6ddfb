"""precision=fp8 (plugins/precision/float8.py): torchao's float8 linear layers, run here with its emulation
(this machine has no float8 matmuls). Fast: which layers convert, that their numerics are float8's, the
config errors. Slow: 100 steps within 3% of bf16's loss (tensorwise and rowwise), and zero3 with float8
all-gather and ddp against the single process (one 2-process launch)."""

from __future__ import annotations

import csv
import re
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.launch_pool import POOL
from trainer.config import ConfigError, compose, validate

pytest.importorskip("torchao.float8", reason="precision=fp8 needs torchao (the dev and fp8 extras install it)")

FP8 = ["precision=fp8", "precision.emulate=true"]


def _float8_modules(model: nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}


def test_eligible_linear_layers_become_float8_and_the_output_layer_does_not() -> None:
    """Every projection of the blocks converts; the output layer (skip) and a MoE router of 8 experts (not a
    multiple of 16) stay in high precision, and grouped experts are not nn.Linear."""
    from trainer.models import build_meta_model
    from trainer.plugins.precision import Float8

    cfg = compose(["model=tiny_moe"])
    from omegaconf import OmegaConf

    model = build_meta_model(OmegaConf.to_object(cfg.model))
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    Float8(emulate=True).convert_model(model)
    converted = _float8_modules(model)
    assert converted and converted < linears
    assert "output" not in converted
    assert not any(name.endswith("router") for name in converted)
    assert {n for n in linears - converted if not n.endswith("router")} == {"output"}
    assert all(name.split(".")[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for name in converted)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_layers_compute_with_float8_rounding(recipe: str) -> None:
    """The emulated float8 matmul is not the bf16 one: its error against fp32 is that of e4m3 (3 mantissa
    bits, a relative rounding of up to 1/16), larger than bf16's and still small; gradients flow."""
    from trainer.plugins.precision import Float8

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    model.load_state_dict(reference.state_dict())
    Float8(recipe=recipe, emulate=True, skip=()).convert_model(model)
    assert len(_float8_modules(model)) == 2
    x = torch.randn(32, 64)
    exact = reference(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = reference(x).float()
        fp8 = model(x).float()
    relative = lambda y: float((y - exact).detach().norm() / exact.detach().norm())  # noqa: E731
    assert relative(bf16) < relative(fp8) < 0.1, (relative(bf16), relative(fp8))
    fp8.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp8"], "precision: precision=fp8: this machine's device (cpu) has no float8 matmuls; "
                        "precision.emulate=true runs float8 numerics emulated"),
    (FP8 + ["precision.recipe=blockwise"], "precision.recipe must be one of tensorwise, rowwise, rowwise_with_gw_hp"),
    (FP8 + ["strategy=tp", "tp=2", "trainer.devices=2"], "precision=fp8 does not run under tensor parallelism yet"),
])
def test_bad_fp8_settings_are_one_line_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate(compose(overrides))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_planner_counts_an_fp8_run_s_state_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 keeps fp32 parameters (float8 is only the matmuls' cast): 4 bytes per element of parameters and
    of gradients, 8 of AdamW's two fp32 moments, from the shapes of the model with its Float8Linear layers.
    The analytic estimate says so, and so does exact mode, which builds that model on the meta device and
    counts its tensors: under zero3 with float8 all-gather each weight is torchao's wrapper tensor
    (WeightWithDynamicFloat8CastTensor) around an fp32 shard of half its rows, counted at the fp32 size
    of the shard it wraps (the float8 copy exists only during the all-gather)."""
    import math

    from omegaconf import OmegaConf

    import trainer.planner.exact as exact
    from trainer.models import build_meta_model
    from trainer.planner import plan
    from trainer.plugins.precision import Float8

    cfg = compose([*FP8, "mode=plan", "hardware=cpu"])
    model = build_meta_model(OmegaConf.to_object(cfg.model))
    Float8(emulate=True).convert_model(model)
    assert _float8_modules(model)
    shapes = [p.shape for p in model.parameters()]
    numel = sum(math.prod(shape) for shape in shapes)
    # zero3 on 2 ranks: FSDP2 shards every parameter's dim 0 (padded to a multiple of 2; the tiny model's
    # are even)
    shard = sum(math.ceil(shape[0] / 2) * math.prod(shape[1:]) for shape in shapes)
    counted: list[set[str]] = []
    count = exact.count_state_bytes

    def spy(parts: list[nn.Module], *args: object, **kwargs: object) -> dict[str, int]:
        counted.append({type(getattr(p, "_local_tensor", p)).__name__ for part in parts for p in part.parameters()})
        return count(parts, *args, **kwargs)

    monkeypatch.setattr(exact, "count_state_bytes", spy)
    for overrides, elements, held in (([], numel, {"Parameter"}),
                                      (["strategy=zero3", "trainer.devices=2"], shard,
                                       {"Tensor", "WeightWithDynamicFloat8CastTensor"})):
        result = plan(compose([*FP8, "mode=plan", "hardware=cpu", *overrides]), exact=True, search=False)
        expected = {"params": 4 * elements, "grads": 4 * elements, "optimizer": 8 * elements}
        assert result.num_params == numel
        assert result.state_bytes == expected, (overrides, result.state_bytes, expected)
        assert {k: result.memory[k] for k in expected} == expected
        assert result.exact == expected, (overrides, result.exact, result.exact_error)
        assert counted.pop() == held  # zero3: the norms and the output layer stay plain shards


# ---- training runs (slow) ----------------------------------------------------------------------------------
MODEL = ["model=tiny"]
LOOP = ["trainer.seq_len=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "trainer.log_every=1",
        "trainer.val_every=0", "trainer.val_batches=4", "lr_schedule.warmup_steps=10", "data.max_bytes=2000000",
        "callbacks=none", "trainer.save_final=false", "trainer.peak_flops=1e12"]
# LONG_STEPS steps of a 2-layer, 128-wide version of the tiny model at a third of the default peak LR. At
# the default (3e-3) this batch of 8 is in the unstable regime SHORT's comment describes, and how far bf16
# and float8 end apart depends on the CPU's kernels: 100 steps of the 4-layer tiny model passed on one VM
# and ended 3.4% apart (train) on another, with torchao 0.17 and 0.18 alike; at 1e-3 on that second VM,
# 1.5% (train, last 10 steps) and 1.0% (validation) for tensorwise. The smaller model (emulated float8 costs
# per linear layer and step on a CPU, whatever its width), measured on the second VM: after 100 steps
# 0.10% / 0.15% (tensorwise) and 0.07% / 0.25% (rowwise); after LONG_STEPS (the loss from 5.59 to 2.82)
# 0.002% / 0.017% and 0.004% / 0.023%. A wrong scale or a missing cast moves the loss by whole percents.
LONG_STEPS = 50
SMALL_MODEL = ["model.n_layers=2", "model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=384"]
LONG = [*SMALL_MODEL, f"trainer.max_steps={LONG_STEPS}", f"trainer.val_every={LONG_STEPS}",
        "trainer.global_batch_size=8", "optimizer.lr=1e-3"]
# The parity runs at a tenth of the default peak LR: the default's warm-up reaches an unstable regime by
# step 8 on this tiny batch, where any difference (float8 roundings included) is amplified chaotically.
SHORT_STEPS = 10
SHORT = [*SMALL_MODEL, f"trainer.max_steps={SHORT_STEPS}", "optimizer.lr=3e-4"]
# name: (overrides, the run it must reproduce, rtol of the losses, rtol of the gradient norms). ddp computes
# what the single process does, in the same order: equal to 1e-4 (measured: bitwise). Elsewhere the float8
# casts see values that differ in the last bits of bf16 (pipeline stages accumulate in another order; FSDP2
# casts its shards to bf16 before they are gathered or cast, so a weight is rounded fp32 -> bf16 -> float8),
# and e4m3 keeps 3 mantissa bits: one flipped rounding moves a product by up to 1/16. Measured over 20
# steps: losses within 2.7e-4 (pp) and 4.5e-4 (float8 vs bf16 all-gather), gradient norms within 1.6%;
# over the SHORT_STEPS the runs now take (2026-11-27, another VM): ddp bitwise, pp losses bitwise and
# norms 7e-8, float8 vs bf16 all-gather losses 6.3e-4 and norms 0.62% (1.6x under the loss tolerance: the
# all-gather's roundings differ from the first step, so fewer steps do not shrink them). A wrong scale or a
# missing cast moves the loss by whole percents from the first step. The runs are of the LONG runs' 2-layer,
# 128-wide model (2026-11-28; emulated float8 costs per linear layer: about 40% of the 4-layer tiny model's
# time): ddp bitwise, pp losses 6.6e-5 and norms 4.2e-4, float8 vs bf16 all-gather losses 2.8e-4 (3.6x under
# the loss tolerance) and norms 4.9e-3.
PARALLEL = {
    "ddp_rowwise": (["strategy=ddp", *FP8, "precision.recipe=rowwise"], "np1/rowwise_short", 1e-4, 1e-4),
    # a pipeline of float8 stages (1f1b over the 2 micro-batches)
    "pp2_tensorwise": (["strategy=pp", "pp=2", *FP8], "np1/tensorwise_short", 1e-3, 5e-2),
    # float8 all-gather of the FSDP2-sharded weights, scales precomputed after each step, against the
    # same run gathering bf16 weights and casting them after the gather
    "zero3_float8_gather": (["strategy=zero3", *FP8], "np2/zero3_bf16_gather", 1e-3, 5e-2),
    "zero3_bf16_gather": (["strategy=zero3", *FP8, "precision.fsdp_float8_all_gather=false"], None, 0, 0),
}


def _column(run_dir: Path, name: str) -> dict[int, float]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


POOL.add("float8", 2, [{"name": name, "overrides": MODEL + LOOP + SHORT + overrides + ["trainer.devices=2"]}
                        for name, (overrides, *_) in PARALLEL.items()])


# The single-process runs, in the shared launches too (a launch of one process): they run beside this
# process's tests instead of after them.
SINGLES = {"bf16_long": ["precision=bf16", *LONG], "tensorwise_long": [*FP8, *LONG],
           "rowwise_long": [*FP8, "precision.recipe=rowwise", *LONG],
           "tensorwise_short": [*FP8, *SHORT], "rowwise_short": [*FP8, "precision.recipe=rowwise", *SHORT]}
POOL.add("float8", 1, [{"name": name, "overrides": MODEL + LOOP + overrides} for name, overrides in SINGLES.items()])


@pytest.fixture(scope="module")
def fp8_runs() -> Path:
    POOL.ensure(1, "float8")
    return POOL.ensure(2, "float8")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_ends_within_3_percent_of_bf16(fp8_runs: Path, recipe: str) -> None:
    """Train loss (mean of the last 10 steps) and validation loss after LONG_STEPS steps."""
    bf16, fp8 = fp8_runs / "np1" / "bf16_long", fp8_runs / "np1" / f"{recipe}_long"
    last = lambda run: statistics.mean(v for s, v in _column(run, "train_loss").items() if s > LONG_STEPS - 10)  # noqa: E731
    assert len(_column(fp8, "train_loss")) == LONG_STEPS
    assert last(fp8) < _column(fp8, "train_loss")[1] - 1.0  # it trained (from ln 256 = 5.5)
    assert last(fp8) == pytest.approx(last(bf16), rel=0.03)
    assert _column(fp8, "val_loss")[LONG_STEPS] == pytest.approx(_column(bf16, "val_loss")[LONG_STEPS], rel=0.03)
    assert _column(fp8, "train_loss") != _column(bf16, "train_loss")  # float8 really ran


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, (_, reference, *_) in PARALLEL.items() if reference])
def test_fp8_under_parallelism_reproduces_its_reference(fp8_runs: Path, name: str) -> None:
    """SHORT_STEPS steps, each rank's micro-batch the single process's: the same float8 casts and scales (FSDP2's
    float8 all-gather scales each weight by its global amax, as a cast after the gather does), within the
    tolerances of PARALLEL (why they differ: its comment)."""
    _, reference_name, loss_rtol, norm_rtol = PARALLEL[name]
    run_dir, reference = fp8_runs / "np2" / name, fp8_runs / reference_name
    assert len(_column(run_dir, "train_loss")) == SHORT_STEPS
    assert _column(run_dir, "train_loss") == pytest.approx(_column(reference, "train_loss"), rel=loss_rtol)
    assert _column(run_dir, "grad_norm") == pytest.approx(_column(reference, "grad_norm"), rel=norm_rtol)
    log = (run_dir / "train.log").read_text()
    # float8 really ran: at this size a bf16 run ends within the tolerances of float8's (measured: losses
    # 4e-4, norms 1.7e-3 apart over the first 10 steps), so the tolerances alone would not tell
    assert re.search(r"precision=fp8: \d+ linear layers in float8", log), log[-2000:]
    if name == "zero3_float8_gather":
        assert "with float8 all-gather" in log
