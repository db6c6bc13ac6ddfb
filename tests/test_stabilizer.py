"""The loss-spike stabilizer: detectors, actions and ledger in-process; agreement, NaN, rollback and
resume in 2 gloo processes (one torchrun launch).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.launch_pool import POOL
from trainer.callback import CheckpointProvider, MissingCallbackError, connect_callbacks
from trainer.plugins.callbacks import CheckpointManager
from trainer.plugins.callbacks.stabilizer import LossSpikeStabilizer, SpikeDetector, TrainingDiverged
from trainer.plugins.precision import Precision
from trainer.plugins.strategies import SingleDevice
from trainer.config import ConfigError, compose, validate
from trainer.data import StatefulLoader, TokenWindows

# ---- detectors -------------------------------------------------------------------------------------


def detector(*history: float, **options: Any) -> SpikeDetector:
    d = SpikeDetector(**{"window": 8, "warmup": 3, **options})
    for value in history:
        d.accept(value)
    return d


def test_ratio_to_running_median_ignores_an_outlier_in_the_window() -> None:
    history = (1.0, 1.0, 1.0, 1.0, 10.0)  # an accepted outlier pulls the mean to 2.8, not the median
    median = detector(*history, statistic="median", ratio=2.0)
    mean = detector(*history, statistic="mean", ratio=2.0)
    hit = median.check(3.5)
    assert hit is not None and hit.test == "ratio" and hit.reference == 1.0 and hit.score == 3.5
    assert mean.check(3.5) is None  # 3.5 / 2.8 = 1.25
    assert mean.check(6.0) is not None and mean.check(6.0).reference == pytest.approx(2.8)  # type: ignore[union-attr]
    assert median.check(1.9) is None


def test_zscore_against_running_mean_and_std() -> None:
    d = detector(1.0, 1.2, 1.0, 1.2, 1.0, 1.2, ratio=0.0, zscore=3.0)
    std = float(np.std([1.0, 1.2] * 3, ddof=1))
    assert d.check(1.1 + 2.9 * std) is None
    hit = d.check(1.1 + 3.1 * std)
    assert hit is not None and hit.test == "zscore"
    assert hit.score == pytest.approx(3.1) and hit.reference == pytest.approx(1.1)
    assert d.check(0.1) is None  # only upward spikes
    # over a flat history the spread is floored at 0.1% of the mean: rounding noise is not a spike
    flat = detector(2.0, 2.0, 2.0, 2.0, ratio=0.0, zscore=3.0)
    assert flat.check(2.0001) is None and flat.check(2.1) is not None


def test_warmup_and_window() -> None:
    d = detector(1.0, 1.0, ratio=2.0)  # warm-up 3: two values are not enough
    assert d.check(100.0) is None
    d.accept(1.0)
    assert d.check(100.0) is not None
    for value in range(20):
        d.accept(float(value))
    assert d.history == [float(v) for v in range(12, 20)]  # the last `window` values
    assert d.check(40.0) is not None and d.check(30.0) is None  # median 15.5: ratio 2.58 vs 1.94
    with pytest.raises(ValueError, match="ratio threshold must be > 1"):
        SpikeDetector(window=8, warmup=3, ratio=0.5)
    with pytest.raises(ValueError, match="warmup_steps must be in"):
        SpikeDetector(window=8, warmup=9)


# ---- the callback on a stand-in trainer (no model: the hooks see only what the loop hands them) --------


class ScalerPrecision(Precision):
    """A precision with a loss scaler: gradient overflow is its business, not the stabilizer's."""

    skips_nonfinite_steps = True

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 1024


class StandIn:
    """The parts of trainer.loop.Trainer the stabilizer touches, stepped by `attempt`."""

    def __init__(self, tmp_path: Path, precision: Precision | None = None, decay: float | None = None) -> None:
        self.step = 0
        self.strategy = SingleDevice()
        self.precision = precision or Precision()
        self.param = torch.nn.Parameter(torch.zeros(2))
        self.optimizer = torch.optim.SGD([{"params": [self.param], "lr": 0.5}])
        # like the trainer's schedule: the LR recomputed from the step after every optimizer step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: decay**step) if decay else None
        self.train_loader = StatefulLoader(TokenWindows(np.arange(1000), 4), 4, 2, shuffle=False)
        self.callbacks: list[Any] = []
        self.run_dir = tmp_path
        self.is_global_zero = True
        self.logged: list[dict[str, float]] = []
        self.step_outputs: dict[str, Any] = {}
        self.skip_step = False

    def log(self, metrics: dict[str, float]) -> None:
        self.logged.append({"step": self.step, **metrics})

    def attempt(self, stabilizer: LossSpikeStabilizer, loss: float, grad_norm: float = 1.0) -> tuple[bool, float]:
        """One loop iteration around the hooks; returns (skipped, the LR the update used)."""
        next(self.train_loader)
        lr = self.optimizer.param_groups[0]["lr"]
        self.step_outputs = {"loss": torch.tensor(loss), "grad_norm": torch.tensor(grad_norm), "lr": lr}
        self.skip_step = False
        stabilizer.on_before_optimizer_step(self, self.optimizer)  # type: ignore[arg-type]
        used = self.optimizer.param_groups[0]["lr"]
        if not self.skip_step:  # as the loop does: a vetoed update does not advance the schedule
            self.optimizer.step()  # no gradients: changes nothing, but the schedule expects it first
            if self.scheduler is not None:
                self.scheduler.step()
        self.step += 1
        outputs = {**self.step_outputs, "skipped": self.skip_step}
        stabilizer.on_train_batch_end(self, outputs)  # type: ignore[arg-type]
        assert outputs["lr"] == used  # the logged LR is the one the update used
        return self.skip_step, used


def stabilizer(**options: Any) -> LossSpikeStabilizer:
    return LossSpikeStabilizer(**{"window": 8, "warmup_steps": 4, "loss_zscore": 0.0, **options})


def warm(trainer: StandIn, stab: LossSpikeStabilizer, steps: int = 5) -> None:
    stab.on_fit_start(trainer)  # type: ignore[arg-type]
    for _ in range(steps):
        assert trainer.attempt(stab, 2.0) == (False, 0.5)


def test_grad_norm_spike_and_nonfinite_values_skip(tmp_path: Path) -> None:
    trainer, stab = StandIn(tmp_path), stabilizer(actions=["skip"])
    warm(trainer, stab)
    assert trainer.attempt(stab, 2.0, grad_norm=6.0)[0]  # 6 x the median norm 1.0 > grad_norm_ratio 5
    assert not trainer.attempt(stab, 2.0, grad_norm=4.0)[0]
    assert trainer.attempt(stab, math.nan)[0]
    assert trainer.attempt(stab, 2.0, grad_norm=math.inf)[0]
    assert [e["kinds"] for e in stab.events] == [["grad_norm_spike"], ["nonfinite_loss"], ["nonfinite_grad"]]
    assert [e["step"] for e in stab.events] == [6, 8, 9] and [e["batch"] for e in stab.events] == [5, 7, 8]
    # events are logged with step, value and action, and listed in stabilizer_events.jsonl
    assert [(m["step"], m["spike_action"]) for m in trainer.logged] == [(6, 1.0), (8, 1.0), (9, 1.0)]
    assert trainer.logged[0]["spike_value"] == 6.0 and math.isnan(trainer.logged[1]["spike_value"])
    lines = (tmp_path / "stabilizer_events.jsonl").read_text().splitlines()
    assert [json.loads(line)["action"] for line in lines] == ["skip"] * 3
    # spikes and NaNs never enter the running history
    assert stab.loss_detector.history == [2.0] * 6 and max(stab.grad_norm_detector.history) == 4.0

    # with a loss scaler, an overflowing gradient is the precision plugin's to skip
    scaled, quiet = StandIn(tmp_path / "scaled", ScalerPrecision()), stabilizer()
    warm(scaled, quiet)
    assert not scaled.attempt(quiet, 2.0, grad_norm=math.inf)[0] and quiet.events == []


def test_escalation_skip_cooldown_abort_and_lr_restored(tmp_path: Path) -> None:
    trainer = StandIn(tmp_path)
    stab = stabilizer(actions=["skip", "cooldown", "abort"], cooldown_steps=3, cooldown_factor=0.1,
                      escalation_window=10)
    warm(trainer, stab)
    assert trainer.attempt(stab, 9.0) == (True, 0.5)  # event 1: skip
    assert trainer.attempt(stab, 2.0) == (False, 0.5)
    assert trainer.attempt(stab, 9.0) == (True, 0.5)  # event 2: cooldown for the next 3 applied steps
    assert [trainer.attempt(stab, 2.0) for _ in range(4)] == [(False, 0.05)] * 3 + [(False, 0.5)]
    assert trainer.optimizer.param_groups[0]["lr"] == 0.5  # restored: nothing recomputes it here
    for _ in range(10):  # the escalation window (10 attempts) forgets events 1 and 2
        trainer.attempt(stab, 2.0)
    assert trainer.attempt(stab, 9.0) == (True, 0.5) and stab.events[-1]["action"] == "skip"
    trainer.attempt(stab, 9.0)
    with pytest.raises(TrainingDiverged, match=r"gave up at step 25: event 5 escalated to abort; last: step 25: "
                                               r"loss_spike \(rank 0\): 9 = 4.50 x the running centre 2"):
        trainer.attempt(stab, 9.0)
    assert [e["action"] for e in stab.events] == ["skip", "cooldown", "skip", "cooldown", "abort"]


def test_cooldown_under_a_schedule_multiplies_the_scheduled_lr(tmp_path: Path) -> None:
    trainer = StandIn(tmp_path, decay=0.9)
    stab = stabilizer(actions=["cooldown"], cooldown_steps=2, cooldown_factor=0.25)
    stab.on_fit_start(trainer)  # type: ignore[arg-type]
    used = [trainer.attempt(stab, 2.0 if step != 6 else 9.0) for step in range(10)]
    # the schedule counts updates: the skipped one (attempt 6) does not advance it
    scheduled = [0.5 * 0.9**(step - (step > 6)) for step in range(10)]
    assert [skipped for skipped, _ in used] == [step == 6 for step in range(10)]
    factors = [1.0] * 7 + [0.25, 0.25, 1.0]
    assert [lr for _, lr in used] == pytest.approx([lr * f for lr, f in zip(scheduled, factors, strict=True)],
                                                   rel=1e-12)


def test_max_events_aborts_and_ledger_round_trips(tmp_path: Path) -> None:
    trainer, stab = StandIn(tmp_path), stabilizer(actions=["skip"], max_events=2)
    warm(trainer, stab)
    trainer.attempt(stab, 9.0)
    trainer.attempt(stab, math.inf)
    state = stab.state_dict()
    torch.save(state, tmp_path / "state.pt")  # plain values: loads with weights_only
    restored = stabilizer(actions=["skip"], max_events=2)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert json.dumps(restored.state_dict()) == json.dumps(state) and len(restored.events) == 2  # NaN != NaN
    with pytest.raises(TrainingDiverged, match=r"the event count 3 exceeds max_events=2"):
        trainer.attempt(restored, 9.0)  # the count survives the round trip


class NothingSavedYet(CheckpointProvider):
    """A checkpoint provider with no complete checkpoint; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[int | None] = []

    def resolve_directory(self, run_dir: Path | str) -> Path:
        return Path(run_dir) / "checkpoints"

    def latest_checkpoint(self, trainer: Any, before_step: int | None = None) -> Path | None:
        self.asked.append(before_step)
        return None


def test_rollback_asks_the_provider_and_without_a_checkpoint_falls_back_to_skip(tmp_path: Path) -> None:
    trainer, stab, provider = StandIn(tmp_path), stabilizer(actions=["rollback"]), NothingSavedYet()
    connect_callbacks([stab, provider])  # what Trainer.fit does before on_fit_start
    warm(trainer, stab)
    assert trainer.attempt(stab, 9.0)[0]
    assert provider.asked == [6]  # a checkpoint from before the spike's step
    assert stab.events[-1]["action"] == "skip" and "no complete checkpoint" in stab.events[-1]["note"]


def test_rollback_needs_exactly_one_checkpoint_provider() -> None:
    """Declared, not searched for: validation refuses rollback without the checkpoint manager in one line,
    and so does connecting the callbacks of a run built without validation."""
    message = ("actions include rollback, which restores the latest checkpoint, but no callback of the run is a "
               "CheckpointProvider: add the checkpoint manager (callbacks=[default,stabilizer,checkpoint]) or drop "
               "rollback from callbacks.stabilizer.actions")
    with pytest.raises(ConfigError) as error:
        validate(compose(["callbacks=[default,stabilizer]"]))  # rollback is among the default actions
    assert (error.value.key, error.value.message) == ("callbacks.stabilizer", message)
    validate(compose(["callbacks=[default,stabilizer,checkpoint]"]))
    validate(compose(["callbacks=[default,stabilizer]", "callbacks.stabilizer.actions=[skip,cooldown,abort]"]))
    with pytest.raises(MissingCallbackError) as missing:
        connect_callbacks([stabilizer()])
    assert str(missing.value) == message
    with pytest.raises(MissingCallbackError, match=r"2 callbacks are CheckpointProviders \(CheckpointManager, "
                                                   r"NothingSavedYet\): keep one"):
        connect_callbacks([stabilizer(), CheckpointManager(), NothingSavedYet()])
    skip_only = stabilizer(actions=["skip", "cooldown"])
    connect_callbacks([skip_only])  # needs nothing


def test_invalid_options_fail_validation() -> None:
    cfg = compose(["callbacks=[default,stabilizer]", "callbacks.stabilizer.actions=[skip,explode]"])
    assert set(cfg.callbacks) == set(compose([]).callbacks) | {"stabilizer"}
    with pytest.raises(ConfigError, match="actions must be a non-empty list of skip, cooldown, rollback") as error:
        validate(cfg)
    assert error.value.key == "callbacks.stabilizer"
    node = OmegaConf.merge(cfg.callbacks.stabilizer, {"actions": ["skip", "cooldown", "rollback", "abort"]})
    LossSpikeStabilizer.check_config(node)
    for key, value, message in [("statistic", "mode", "statistic must be one of median, mean"),
                                ("loss_ratio", 0.5, "ratio threshold must be > 1"),
                                ("cooldown_factor", 2.0, "cooldown_factor"),
                                ("warmup_steps", 80, "warmup_steps must be in")]:
        with pytest.raises(ValueError, match=message):
            LossSpikeStabilizer.check_config(OmegaConf.merge(node, {key: value}))


# ---- the loader's skip list --------------------------------------------------------------------------


def test_loader_skips_positions_deterministically_across_a_resume_and_epochs() -> None:
    windows = TokenWindows(np.arange(401), 4)  # 100 windows, 25 steps of 4 per epoch

    def loader() -> StatefulLoader:
        return StatefulLoader(windows, 4, 2, seed=3)

    plain = loader()
    reference = [torch.cat([x for x, _ in next(plain)]) for _ in range(60)]
    skipping = loader()
    skipping.skip([3, 4, 30])  # 30: the sixth batch of the second epoch
    got = []
    for _ in range(10):
        got.append(torch.cat([x for x, _ in next(skipping)]))
    state = skipping.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.skip([3, 4, 30])  # what the stabilizer's ledger hands back on resume
    while len(got) < 57:
        got.append(torch.cat([x for x, _ in next(resumed)]))
    kept = [batch for position, batch in enumerate(reference) if position not in (3, 4, 30)]
    assert all(torch.equal(a, b) for a, b in zip(got, kept, strict=True))
    assert resumed.last_position == 59


# ---- 2 gloo processes, one torchrun launch ----------------------------------------------------------

MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# Steps of 8 sequences x 32 tokens at a high LR: after ~12 steps the model is sure enough of its bytes
# that a batch of byte-0 targets gives a loss 3-4 times the running median.
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.log_every=1",
        "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=2", "optimizer.lr=1e-2",
        "data.max_bytes=1000000", "strategy=ddp", "trainer.devices=2",
        "callbacks.stabilizer.warmup_steps=8", "callbacks.stabilizer.window=16"]
# Checkpoints every 4 steps; the first event skips, the second rolls back (here the spike at step 14,
# in global batch 13: back to step 12, skipping batches 12-13). The stabilizer comes before the manager,
# so the manager saves step 12 again right after the rollback, now with the ledger: a resume from it
# must skip those batches too.
ROLLBACK = ["callbacks=[stabilizer,checkpoint]", "callbacks.checkpoint.every_n_steps=4",
            "callbacks.stabilizer.actions=[skip,rollback]", "callbacks.stabilizer.rollback_skip_batches=2",
            "trainer.max_steps=16"]
# (step, action, skipped batches) of the two events the 2-process runs inject
LEDGER = [[10, "skip", None], [14, "rollback", [12, 13]]]


def helper(name: str, cls: str, **options: Any) -> list[str]:
    return [f"+callbacks.{name}._target_=tests.helpers.{cls}"] + [
        f"+callbacks.{name}.{key}={value}" for key, value in options.items()]


def steps(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / f"steps_rank{rank}.jsonl").read_text().splitlines()]


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "stabilizer_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


_ROOT = POOL.directory("stabilizer") / "np2"
# event 1: a NaN in rank 1's gradients at step 10 (skip); event 2: a spike in rank 0's half of
# global batch 13 at step 14 (escalates to rollback)
_INJECTIONS = helper("nan", "InjectNaN", step=10, rank=1) + helper("spike", "InjectSpike", batch=13, rank=0)
POOL.add("stabilizer", 2, [
    {"name": "rollback", "overrides": MODEL + LOOP + ROLLBACK + _INJECTIONS
     + helper("record", "RecordSteps", directory=_ROOT / "rollback")
     + helper("compare", "CompareAfterRollback", directory=_ROOT / "rollback", step=12)},
    {"name": "resume", "overrides": MODEL + LOOP + ROLLBACK + _INJECTIONS
     + helper("record", "RecordSteps", directory=_ROOT / "resume")
     + [f"resume={_ROOT / 'rollback' / 'checkpoints' / 'step_00000012'}"]},
])


@pytest.fixture(scope="module")
def runs() -> Path:
    return POOL.ensure(2, "stabilizer") / "np2"


@pytest.mark.slow
def test_a_nan_or_a_spike_on_one_rank_makes_every_rank_skip(runs: Path) -> None:
    run = runs / "rollback"
    ranks = [steps(run, 0), steps(run, 1)]
    for rows in ranks:
        assert [(row["step"], row["skipped"]) for row in rows[:14]] == [(s, s in (10, 14)) for s in range(1, 14)] + [
            (12, True)]  # the spiking attempt, after which the run is back at step 12
    assert math.isnan(ranks[1][9]["grad_norm"]) and math.isfinite(ranks[0][9]["grad_norm"])
    # the spike was rank 0's alone: rank 1's own loss at that attempt is ordinary, rank 0's far above it
    assert ranks[0][13]["loss"] > 2.5 * ranks[1][13]["loss"]
    nan, spike = events(run)
    assert (nan["step"], nan["kinds"], nan["ranks"], nan["action"]) == (10, ["nonfinite_grad"], [1], "skip")
    assert (spike["step"], spike["kinds"][0], spike["ranks"], spike["action"]) == (14, "loss_spike", [0], "rollback")
    assert spike["batch"] == 13 and spike["value"] == ranks[0][13]["loss"]
    # each event is logged with its value and action (metrics.csv and the log): a skip at its step, a
    # rollback with the first step completed after it (step 13 again; the abandoned rows are redone)
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["spike_action"])) for r in rows if r.get("spike_action")] == [(10, 1.0), (13, 3.0)]
    assert [float(r["spike_value"]) for r in rows if r.get("spike_action") == "3.0"] == [spike["value"]]
    log = (run / "train.log").read_text()
    assert "loss-spike stabilizer: step 10: nonfinite_grad (rank 1): nan; action skip" in log
    assert "loss-spike stabilizer: step 14: loss_spike (rank 0)" in log
    assert "action rollback to step 12, skipping global batches 12..13" in log


@pytest.mark.slow
def test_rollback_restores_the_checkpoint_bitwise_and_skips_the_window(runs: Path) -> None:
    run = runs / "rollback"
    for rank in (0, 1):
        assert json.loads((run / f"rollback_rank{rank}.json").read_text())["bitwise_equal"] is True
        rows = steps(run, rank)
        # steps 1-13, the spiking attempt (rolled back to step 12), then steps 13-16 on batches 14-17
        assert [(r["step"], r["batch"]) for r in rows] == (
            [(s, s - 1) for s in range(1, 14)] + [(12, 13)] + [(s, s + 1) for s in range(13, 17)])
        assert not any(r["skipped"] for r in rows[14:])
        assert rows[-1]["skipping"] == [12, 13] and rows[-1]["ledger"] == [LEDGER]
    spike = events(run)[1]
    assert spike["skipped_batches"] == [12, 13] and spike["rolled_back_to"]["step"] == 12
    assert spike["rolled_back_to"]["path"].endswith("step_00000012")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["final_train_loss"] < 3.5
    # metrics.csv holds each step once: the rows of the rolled-back attempt were redone, as after a resume
    with open(run / "metrics.csv") as f:
        logged = [int(row["step"]) for row in csv.DictReader(f)]
    assert logged == sorted(set(logged)) and logged[-1] == 16


@pytest.mark.slow
def test_the_ledger_holds_after_a_resume(runs: Path) -> None:
    """Resumed from the step-12 checkpoint saved after the rollback: its loader position (12) is before
    the skipped batches, so the resumed run must skip 12 and 13 as the original did."""
    original = steps(runs / "rollback", 0)[-4:]
    for rank in (0, 1):
        rows = steps(runs / "resume", rank)
        assert rows[0]["skipping"] == [12, 13] and rows[0]["ledger"] == [LEDGER]
        assert [(r["step"], r["batch"]) for r in rows] == [(s, s + 1) for s in range(13, 17)]
    resumed = steps(runs / "resume", 0)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in original]  # the same batches, exactly
    assert events(runs / "resume") == []  # batch 13 (the injected spike) never came back
