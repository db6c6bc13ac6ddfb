"""`strategy=auto` (issue 29): the planner's pick is the fastest predicted layout that fits and keeps the pins,
the same for the same inputs, for every model family (MoE's ep, long sequences' cp) and for a cluster that is
not this machine; an impossible pin is one line naming the constraint and the nearest layout; the profile
is calibrated once and cached; a rerun in the same directory reuses the recorded layout.

The end-to-end run (2 processes, `plan.trials=2`, then the same command again in its run directory) is the
module's pool job: a real `python -m trainer`, since the choice is made by the CLI before Hydra composes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.launch_pool import POOL
from trainer.cli import main as cli_main
from trainer.config import ConfigError, compose
from trainer.planner import auto
from trainer.planner.auto import choose, parse_request, settle
from trainer.planner.core import hardware_from_config
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import layout_from_config, model_config
from trainer.planner.params import inventory
from trainer.planner.profiles import load_profile, machine_key, profile_path, store_profile
from trainer.planner.search import family_tp_sizes, layout_overrides, rank_candidates

MODULE = "strategy_auto"  # the pool's name of this module (tests/launch_pool.py)
# A run of this machine without calibrating (the hardware group's figures): the unit tests rank fast
NO_CALIBRATION = ["plan.auto_calibrate=false"]
TINY_RUN = ["trainer.max_steps=4", "trainer.seq_len=64", "trainer.global_batch_size=8", "trainer.val_batches=1",
            "trainer.log_every=1", "lr_schedule.warmup_steps=1", "data.max_bytes=200000", "trainer.peak_flops=1e12",
            "trainer.num_threads=1", "trainer.hang_timeout_s=0"]
# The README's measured example, with the tiny run's settings (the job below runs it, then reruns it)
README_COMMAND = ["strategy=auto", "trainer.devices=2", "plan.trials=2"]


def _job_command(run_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "trainer", *README_COMMAND, *NO_CALIBRATION, *TINY_RUN,
               f"hydra.run.dir={run_dir}"]
    # the same command twice: the second run finds the first one's config.yaml (and final checkpoint)
    return ["bash", "-c", " ; ".join([" ".join(command), "echo '--- rerun ---'", " ".join(command)])]


JOB_DIR = POOL.jobs_root / MODULE
POOL.add_job(MODULE, _job_command(JOB_DIR))


def _settle(overrides: list[str], run_dir: Path | None = None, **kwargs: Any) -> auto.AutoChoice:
    return settle(["strategy=auto", *overrides], run_dir, **kwargs)


def _ranked(overrides: list[str]) -> list[tuple[list[str], float, str]]:
    """The search's own ranking of the layouts that fit (plan.search's space on the planned hardware): each
    layout's overrides, predicted step time and checkpointing policy."""
    cfg = compose([*overrides, "mode=plan"])
    inv = inventory(model_config(cfg))
    from trainer.planner.estimate import PlanOptions

    ranked = rank_candidates(inv, layout_from_config(cfg), hardware_from_config(cfg), PlanOptions.of(cfg),
                             family_tp_sizes(cfg))
    return [(layout_overrides(layout), e[0].timing.step_time_s, layout.checkpointing) for layout, e in ranked]


def test_the_pick_is_the_fastest_predicted_that_fits_and_the_same_each_time() -> None:
    overrides = ["trainer.devices=4", "mode=plan", "trainer.seq_len=64"]
    first, second = _settle(overrides), _settle(overrides)
    for a, b in zip(first.layout_overrides, second.layout_overrides, strict=True):
        assert a == b
    assert first.reason == second.reason
    # the fastest predicted by plan.search's ranking; of those equally fast, the one that recomputes least
    ranked = _ranked(overrides)
    fastest = min(step for _, step, _ in ranked)
    assert first.predicted_step_time_s <= fastest * (1 + auto.TIE)
    tied = [policy for _, step, policy in ranked if step <= fastest * (1 + auto.TIE)]
    policy = next(o.split("=")[1] for o in first.layout_overrides if o.startswith("activation_checkpointing="))
    assert policy == min(tied, key=auto.RECOMPUTE_ORDER.index)
    assert first.predicted_memory_gb <= first.capacity_gb
    assert first.runner_up is not None and first.runner_up_overrides != first.layout_overrides
    assert first.runner_up_step_time_s >= first.predicted_step_time_s
    assert first.layout_overrides[0].startswith("strategy=") and first.fitting > 10


def test_trials_are_the_best_of_each_of_the_best_parallel_layouts() -> None:
    request = parse_request(["strategy=auto", "trainer.devices=4", "mode=plan", "trainer.seq_len=64",
                             "plan.trials=3"])
    cfg = compose([*request.base, "mode=plan"])
    hardware, options = hardware_from_config(cfg), auto.plan_options(cfg)
    choice = choose(request, hardware, options, mode="plan", trials=3)
    _, _, _, _, ranked = auto.ranked_layouts(request, hardware, options)
    # the best predicted layout of each parallel layout, in the order of the ranking
    best_of: dict[tuple[Any, ...], list[str]] = {}
    for layout, _ in ranked:
        best_of.setdefault(auto.parallel_layout(layout), layout_overrides(layout))
    expected = list(best_of.values())[:3]
    assert len(best_of) > 3 and len(choice.trials) == 3
    for trial, wanted in zip(choice.trials, expected, strict=True):
        assert trial == wanted
    assert choice.trials[0] == choice.layout_overrides  # the planner's pick is measured too
    # the runner-up stays the second best predicted overall, whatever its parallel layout
    second = next(layout_overrides(lay) for lay, _ in ranked if layout_overrides(lay) != choice.layout_overrides)
    assert choice.runner_up_overrides == second


def test_pins_are_kept() -> None:
    choice = _settle(["trainer.devices=4", "mode=plan", "trainer.seq_len=64", "tp=2",
                      "activation_checkpointing=full", "trainer.micro_batch_size=2"])
    assert {"tp=2", "activation_checkpointing=full", "trainer.micro_batch_size=2"} <= set(choice.layout_overrides)
    assert "keeping tp=2 activation_checkpointing=full trainer.micro_batch_size=2" in choice.reason
    # `auto` for a searched value is the same as leaving it out
    plain = _settle(["trainer.devices=4", "mode=plan", "trainer.seq_len=64"])
    autos = _settle(["trainer.devices=4", "mode=plan", "trainer.seq_len=64", "tp=auto", "pp=auto",
                     "activation_checkpointing=auto", "trainer.micro_batch_size=auto"])
    assert autos.layout_overrides == plain.layout_overrides


def test_a_request_refuses_what_auto_cannot_honour() -> None:
    with pytest.raises(ConfigError, match="strategy.sharding: strategy=auto chooses the strategy"):
        parse_request(["strategy=auto", "strategy.sharding=full_shard"])
    with pytest.raises(ConfigError, match="tp: must be a positive integer or auto"):
        parse_request(["strategy=auto", "tp=two"])
    with pytest.raises(ConfigError, match="set only with a pinned policy"):
        parse_request(["strategy=auto", "activation_checkpointing.n=3"])


@pytest.mark.parametrize(("pins", "expected"), [
    (["tp=3"], r"^error: strategy=auto: tp=3: tp must divide the 4 processes.*; nearest layout that fits: "
               r"strategy=\S+ tp=\d"),
    (["ep=2"], r"^error: strategy=auto: ep=2: the model has no experts.*nearest layout that fits: "),
    (["dp=4", "activation_checkpointing=none", "trainer.micro_batch_size=8", "hardware.memory_gb=0.02"],
     r"^error: strategy=auto: dp=4 activation_checkpointing=none trainer.micro_batch_size=8: no layout keeping "
     r"them fits; the smallest \(.*\) device memory on rank 0: needs .* GB.*; nearest layout that fits: "),
])
def test_an_impossible_pin_is_one_line_with_the_nearest_layout(pins: list[str], expected: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    monkeypatch.delenv("TRAINER_FULL_ERROR", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["trainer"])
    argv = ["strategy=auto", "trainer.devices=4", "trainer.global_batch_size=32", *NO_CALIBRATION, *pins,
            f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", ["trainer", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli_main()
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, out + err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out + err, err
    assert re.search(expected, lines[0]), lines[0]
    assert not (tmp_path / "run").exists()


def test_plan_for_a_cluster_that_is_not_this_machine(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64-GPU job sized here: the `hardware` profile and node count decide, and the report is the chosen
    layout's plan. The micro-batch is pinned: the whole space of 64 GPUs is 12,712 layouts (the test took
    15.9 s on the 2-core machine, pinned 7.5 s beside a launch), and what a pin does is test_pins_are_kept's."""
    argv = ["model=llama3_8b", "strategy=auto", "hardware=h100_80g", "trainer.devices=8", "trainer.num_nodes=8",
            "trainer.global_batch_size=256", "trainer.seq_len=4096", "precision=bf16", "mode=plan", "plan.exact=false",
            "trainer.micro_batch_size=1"]
    monkeypatch.setattr(sys, "argv", ["trainer", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli_main()
    out, _ = capsys.readouterr()
    assert exit_.value.code == 0, out
    assert "strategy=auto: chosen " in out and "runner-up" in out
    assert "hardware=h100_80g, 64 devices on 8 node(s)" in out
    assert "fits: yes" in out


FAMILIES = [
    ("tiny", ["model=tiny"]),
    ("gpt", ["model=gpt2_small", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_hidden_dim=128",
             "model.vocab_size=256"]),
    ("qwen3", ["model=qwen3_tiny"]),
    ("qwen3_moe", ["model=qwen3_moe_tiny"]),
    ("deepseek_v3", ["model=deepseek_v3_tiny"]),
    ("tiny_moe", ["model=tiny_moe"]),
]


@pytest.mark.parametrize(("family", "model"), FAMILIES, ids=[f for f, _ in FAMILIES])
def test_every_family_gets_a_layout(family: str, model: list[str]) -> None:
    choice = _settle([*model, "trainer.devices=4", "trainer.seq_len=64", "mode=plan"])
    assert choice.predicted_memory_gb <= choice.capacity_gb, family
    # the concrete command line composes and validates as a plan of that family
    from trainer.config import validate

    validate(compose(choice.overrides()))


def test_moe_expert_parallel_is_searched_and_pinnable() -> None:
    overrides = ["model=tiny_moe", "trainer.devices=4", "trainer.seq_len=64", "mode=plan"]
    ranked = _ranked(overrides)
    assert any("ep=4" in layout for layout, _, _ in ranked) and any("ep=2" in layout for layout, _, _ in ranked)
    pinned = _settle([*overrides, "ep=4"])
    assert "ep=4" in pinned.layout_overrides and "ep=4" in pinned.chosen
    # every layout ranked for the pin keeps it (whatever else varies: cp, flavour, policy)
    from trainer.planner.estimate import PlanOptions

    request = parse_request(["strategy=auto", *overrides, "ep=4"])
    cfg = compose([*request.base, "mode=plan"])
    *_, ranked = auto.ranked_layouts(request, hardware_from_config(cfg), PlanOptions.of(cfg))
    assert ranked and all(layout.ep == 4 for layout, _ in ranked)
    assert any(layout.cp == 1 for layout, _ in ranked)


def test_a_long_sequence_that_needs_cp_gets_cp() -> None:
    """A sequence whose activations do not fit one rank's memory without splitting it: every fitting layout
    splits the sequence (cp > 1) or the model (tp/pp) and auto takes one of them; pinned tp=1 pp=1 leaves cp."""
    overrides = ["trainer.devices=4", "trainer.seq_len=8192", "trainer.global_batch_size=4", "model.max_seq_len=8192",
                 "hardware.memory_gb=0.5", "hardware.reserved_gb=0", "mode=plan", "tp=1", "pp=1",
                 "activation_checkpointing=none"]
    choice = _settle(overrides)
    cp = int(next(o for o in choice.layout_overrides if o.startswith("cp=")).split("=")[1])
    assert cp > 1, choice.layout_overrides
    with pytest.raises(ConfigError, match="cp=1: no layout keeping them fits"):
        _settle([*overrides, "cp=1"])


def test_profiles_are_cached_per_machine_and_torch_version(tmp_path: Path) -> None:
    import platform

    import torch

    key = machine_key("cpu", 4)
    assert (key.get("torch"), key.get("processes_per_node"), key.get("host")) == (torch.__version__, 4, platform.node())
    assert load_profile(tmp_path, key) is None
    hardware = HardwareConfig(name="measured", peak_flops_fp32=1.5e10)
    path = store_profile(tmp_path, key, hardware, 0.4, None, "python -m trainer ...")
    loaded = load_profile(tmp_path, key)
    assert loaded is not None and loaded.path == path and loaded.hardware == hardware
    assert loaded.matmul_efficiency == 0.4
    for other in ({**key, "torch": "0.0.0"}, {**key, "processes_per_node": 2}, {**key, "host": "elsewhere"}):
        assert profile_path(tmp_path, other) != path
        assert load_profile(tmp_path, other) is None


class _Calibrating(Exception):
    pass


def test_a_run_calibrates_only_without_a_cached_profile(tmp_path: Path) -> None:
    calls: list[Any] = []

    def run_on_workers(cfg: Any, run_dir: Path, work: Any) -> None:
        calls.append(run_dir)
        raise _Calibrating

    overrides = ["trainer.devices=4", "trainer.seq_len=64", f"plan.profile_dir={tmp_path}"]
    with pytest.raises(_Calibrating):
        _settle(overrides, run_on_workers=run_on_workers)
    assert len(calls) == 1 and calls[0].parent == tmp_path
    store_profile(tmp_path, machine_key("cpu", 4), HardwareConfig(name="cached"), 0.5, 0.3, "test")
    choice = _settle(overrides, run_on_workers=run_on_workers)
    assert len(calls) == 1, "calibrated again although a profile is cached"
    assert str(tmp_path) in choice.profile and "calibrated profile" in choice.reason


def test_a_rerun_in_the_same_directory_reuses_the_recorded_layout(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = ["trainer.devices=4", "trainer.seq_len=64", *NO_CALIBRATION, "trainer.micro_batch_size=2"]
    first = _settle(overrides, tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"auto": first.record()}))

    def no_search(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("searched again")

    monkeypatch.setattr(auto, "choose", no_search)
    again = _settle(overrides, tmp_path)
    assert again.layout_overrides == first.layout_overrides
    assert again.reused_from == str(tmp_path / "config.yaml")
    with pytest.raises(AssertionError, match="searched again"):  # resume=none starts over: a new search
        _settle([*overrides, "resume=none"], tmp_path)


@pytest.mark.slow
def test_auto_run_with_trials_then_rerun_reuses_the_layout() -> None:
    """`python -m trainer strategy=auto trainer.devices=2 plan.trials=2` trains the faster of the two best
    predicted layouts after measuring both, records the choice in config.yaml, and the same command again
    in the same directory runs the recorded layout without searching or measuring."""
    code, out = POOL.job(MODULE)
    assert code == 0, out
    first, rerun = out.split("--- rerun ---")
    record = yaml.safe_load((JOB_DIR / "config.yaml").read_text())["auto"]
    measured = record["measured_step_time_s"]
    assert len(measured) == 2 and all(t > 0 for t in measured.values())
    assert record["chosen"] in measured and record["runner_up"] in measured
    assert measured[record["chosen"]] <= measured[record["runner_up"]]
    assert "strategy=auto: trial 2/2" in first and "the fastest measured of 2 trials" in record["reason"]
    # the first run trained the fastest measured layout: its last `strategy=auto ->` line (after the planner's)
    picks = [line.split("strategy=auto -> ", 1)[1] for line in first.splitlines() if "strategy=auto -> " in line]
    assert len(picks) == 2 and picks[-1] == " ".join(record["overrides"]), picks
    summary = json.loads((JOB_DIR / "summary.json").read_text())
    assert summary["steps"] >= 1
    # the rerun: the recorded layout, no trial, no search
    assert "the layout recorded in" in rerun and "strategy=auto: trial" not in rerun
    assert f"strategy=auto -> {' '.join(record['overrides'])}" in rerun
    config = yaml.safe_load((JOB_DIR / "config.yaml").read_text())
    assert config["auto"]["overrides"] == record["overrides"]
    assert config["auto"]["reused_from"] == str(JOB_DIR / "config.yaml")
