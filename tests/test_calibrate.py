"""`mode=plan plan.calibrate=true` runs and reports predicted beside measured step time, tokens/s and peak
memory (trainer/planner/calibrate.py). No timing is asserted: how close the two are is
benchmarks/planner_time.py's business (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.config import compose, validate
from trainer.planner.calibrate import CALIBRATION_FILE, hardware_yaml, report, run_config
from trainer.planner.calibration_run import MEASURED_FILE, calibration_worker
from trainer.planner.hardware import HardwareConfig
from trainer.planner.profiles import load_profile, machine_key

REPO = Path(__file__).resolve().parent.parent
# A 2-layer Llama on short sequences, 2 timed steps, a small bandwidth message, a fixed MFU reference (no
# start-up matmul benchmark of the run itself: the calibration measures its own).
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
        "trainer.seq_len=32", "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "data.max_bytes=200000",
        "lr_schedule.warmup_steps=1", "trainer.peak_flops=1e12", "trainer.num_threads=1",
        "plan.calibrate_steps=2", "plan.calibrate_message_mb=1"]
FIGURES = ("step_time_s", "tokens_per_s", "peak_memory_bytes")


def _check(result: dict, out: str) -> None:
    for key in FIGURES:
        assert result["predicted"][key] > 0 and result["measured"][key] > 0, key
        assert result["ratio"][key] > 0, key
    for row in ("step time (s)", "tokens/s", "peak memory"):
        line = next(line for line in out.splitlines() if line.startswith(row))
        assert len(line.split()) >= 4, line  # the label, predicted, measured, their ratio
    assert "predicted" in out and "measured" in out


@pytest.mark.beside
def test_single_process_calibration_reports_both_columns_and_saves_the_profile(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "cpu_measured.yaml"
    overrides = ["mode=plan", "plan.calibrate=true", *TINY, f"plan.calibrate_save={saved}",
                 f"plan.profile_dir={tmp_path / 'profiles'}"]
    cfg = compose(overrides)
    validate(cfg)
    calibration_worker(run_config(cfg), tmp_path)  # what `python -m trainer ...` runs on its one process
    result = report(cfg, tmp_path, overrides)
    _check(result, capsys.readouterr().out)
    assert json.loads((tmp_path / CALIBRATION_FILE).read_text())["measured"]["step_time_s"] > 0
    profile = {k: v for k, v in yaml.safe_load(saved.read_text()).items() if k != "defaults"}
    assert HardwareConfig(**profile).peak_flops_fp32 > 0
    # and cached as this machine's profile for strategy=auto (trainer/planner/profiles.py)
    cached = load_profile(tmp_path / "profiles", machine_key("cpu", 1))
    assert cached is not None and cached.hardware.peak_flops_fp32 == result["hardware"]["peak_flops_fp32"]


def test_a_saved_profile_reads_back_as_numbers_in_any_yaml_reader() -> None:
    # 1e+11 (what 4 significant digits make of 99,996,000,000) is a string to PyYAML: the file writes 1.0e+11
    measured = HardwareConfig(peak_flops_fp32=99_996_000_000.0, peak_flops_bf16=1.234e11, memory_gb=3.0)
    written = yaml.safe_load(hardware_yaml(measured, "python -m trainer mode=plan plan.calibrate=true"))
    profile = HardwareConfig(**{k: v for k, v in written.items() if k != "defaults"})
    assert (profile.peak_flops_fp32, profile.peak_flops_bf16, profile.memory_gb) == (1e11, 1.234e11, 3.0)
    assert profile.devices_per_node == measured.devices_per_node


@pytest.mark.slow
@pytest.mark.beside
def test_two_process_calibration_through_the_cli(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "trainer", "strategy=ddp", "trainer.devices=2", "mode=plan",
               "plan.calibrate=true", *TINY, f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / CALIBRATION_FILE).read_text())
    _check(result, done.stdout)
    assert result["world_size"] == 2 and len(result["measured"]["per_rank_peak_memory_bytes"]) == 2
    assert {link["op"] for link in result["links"]} >= {"all-reduce", "all-gather", "reduce-scatter"}
    # two processes run the pipeline-overhead probe (trainer/planner/pipeline_overhead.py) whatever the layout
    measured = json.loads((tmp_path / MEASURED_FILE).read_text())
    overheads = {rank["pipeline_overhead_s"] for rank in measured["ranks"]}
    assert len(overheads) == 1 and None not in overheads
    assert result["hardware"]["pipeline_action_overhead_us"] == pytest.approx(overheads.pop() * 1e6)
