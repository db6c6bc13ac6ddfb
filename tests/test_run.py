"""End-to-end training runs with tiny settings: outputs, determinism, accumulation, stopping, loggers."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import compose
from trainer.data.prepare import prepare
from trainer.run import train

REPO = Path(__file__).resolve().parent.parent
# A 2-layer model on short sequences: a step takes milliseconds.
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_hidden_dim=128"]
LLAMA = MODEL + ["model.n_kv_heads=2"]
LOOP = [
    "trainer.seq_len=64", "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.max_steps=8",
    "trainer.val_batches=2", "trainer.log_every=1", "trainer.val_every=4", "lr_schedule.warmup_steps=1",
]
STDLIB = ["data.max_bytes=2000000"]
TINY = LLAMA + LOOP + STDLIB + ["callbacks=none"]


def run(tmp_path: Path, *overrides: str, base: list[str] = TINY) -> tuple[dict, list[dict[str, str]]]:
    summary = train(compose(base + list(overrides)), tmp_path)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return summary, rows


def column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


def test_run_writes_metrics_summary_and_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer"):
        summary, rows = run(tmp_path)
    assert {"step", "train_loss", "lr", "tokens_per_s", "val_loss", "grad_norm", "mfu"} <= set(rows[0])
    assert column(rows, "train_loss") and len(column(rows, "train_loss")) == 8
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [4, 8]
    saved = json.loads((tmp_path / "summary.json").read_text())
    # exactly the returned summary (json's float repr round-trips; NaN serializes, unlike it compares)
    assert json.dumps(saved, sort_keys=True) == json.dumps(summary, sort_keys=True)
    for key in ("final_val_loss", "best_val_loss", "final_train_loss", "steps", "tokens", "wall_s",
                "tokens_per_s", "mfu", "num_params", "peak_memory_bytes_per_rank"):
        assert key in saved, key
    assert saved["steps"] == 8 and saved["tokens"] == 8 * 8 * 64
    assert saved["final_val_loss"] == column(rows, "val_loss")[-1]
    assert saved["best_val_loss"] == min(column(rows, "val_loss"))
    assert saved["mfu"] > 0 and saved["tokens_per_s"] > 0
    # MFU is the achieved FLOP/s per device over the peak (on a CPU, the matmul peak measured at start-up).
    # It is not bounded by 1 here: a peak measured while the shared machine was busier than during the run
    # sits below what the run achieves (1.06 and 1.44 seen), and the loop then reports it as measured with
    # one warning; so the test checks the formula and that the warning comes exactly when it should.
    expected = saved["tokens_per_s"] * saved["flops_per_token"] / saved["world_size"] / saved["peak_flops_per_device"]
    assert saved["mfu"] == pytest.approx(expected, rel=1e-12)
    above_peak = max(column(rows, "mfu") + [saved["mfu"], saved["mfu_wall_average"]]) > 1
    assert caplog.text.count("that peak looks too low") == (1 if above_peak else 0)
    assert len(saved["peak_memory_bytes_per_rank"]) == 1 and saved["peak_memory_bytes_per_rank"][0] > 0
    assert "dim: 64" in (tmp_path / "config.yaml").read_text()
    # the loss starts near ln(256) for bytes and goes down
    losses = column(rows, "train_loss")
    assert abs(losses[0] - math.log(256)) < 0.5 and losses[-1] < losses[0]


def test_same_seed_gives_bitwise_identical_losses(tmp_path: Path) -> None:
    _, first = run(tmp_path / "a")
    _, second = run(tmp_path / "b")
    _, other_seed = run(tmp_path / "c", "trainer.seed=7")
    assert column(first, "train_loss") == column(second, "train_loss")
    assert column(first, "val_loss") == column(second, "val_loss")
    assert column(first, "train_loss") != column(other_seed, "train_loss")


def test_gradient_accumulation_matches_one_big_microbatch(tmp_path: Path) -> None:
    """global 8 as 2 micro-batches of 4 is the same optimization as 1 micro-batch of 8."""
    _, accumulated = run(tmp_path / "a", "trainer.micro_batch_size=4")
    _, single = run(tmp_path / "b", "trainer.micro_batch_size=8")
    assert column(accumulated, "train_loss") == pytest.approx(column(single, "train_loss"), rel=1e-5)
    assert column(accumulated, "grad_norm") == pytest.approx(column(single, "grad_norm"), rel=1e-4)


def test_max_tokens_stops_first(tmp_path: Path) -> None:
    tokens_per_step = 8 * 64
    summary, _ = run(tmp_path, "trainer.max_steps=100", f"trainer.max_tokens={5 * tokens_per_step + 1}")
    assert summary["steps"] == 6


def test_grad_clip_caps_the_update_and_norm_is_logged(tmp_path: Path) -> None:
    _, clipped = run(tmp_path / "a", "trainer.grad_clip=0.05", "trainer.max_steps=3")
    _, free = run(tmp_path / "b", "trainer.grad_clip=0", "trainer.max_steps=3")
    # the norm logged is the norm before clipping, so the first steps agree...
    assert column(clipped, "grad_norm")[0] == pytest.approx(column(free, "grad_norm")[0])
    assert column(clipped, "grad_norm")[0] > 0.05
    # ...but the clipped run takes smaller steps afterwards
    assert column(clipped, "train_loss")[1:] != column(free, "train_loss")[1:]


@pytest.mark.slow
def test_gpt_family_and_sgd_and_every_schedule_train(tmp_path: Path) -> None:
    for i, overrides in enumerate([
        ["model=gpt2_small", "model.vocab_size=256", "model.max_seq_len=64", "model.dropout=0.1"],
        ["model=gpt2_small", "model.vocab_size=256", "model.max_seq_len=64", "model.attn_impl=materialized"],
        ["optimizer=sgd", "lr_schedule=wsd"], ["lr_schedule=inverse_sqrt"], ["lr_schedule=linear"],
        ["lr_schedule=constant"],
    ]):
        base = MODEL if overrides[0] == "model=gpt2_small" else LLAMA
        cfg = compose(base + LOOP + STDLIB + overrides + ["trainer.max_steps=4"])
        summary = train(cfg, tmp_path / str(i))
        assert summary["steps"] == 4 and math.isfinite(summary["final_val_loss"]), overrides


def test_token_file_data(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(3000)))
    prepare([str(text)], str(tmp_path / "tokens"), tokenizer="bytes", val_fraction=0.05)
    summary, rows = run(tmp_path / "run", "data=token_file", f"data.path={tmp_path / 'tokens'}",
                        base=LLAMA + LOOP)
    assert summary["steps"] == 8 and column(rows, "train_loss")[-1] < column(rows, "train_loss")[0]


def test_data_vocabulary_larger_than_model_is_a_clear_error(tmp_path: Path) -> None:
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="model.vocab_size is 128"):
        train(compose(TINY + ["model.vocab_size=128"]), tmp_path)


@pytest.mark.slow
@pytest.mark.beside
def test_compiled_blocks_match_eager(tmp_path: Path) -> None:
    _, eager = run(tmp_path / "eager", "trainer.max_steps=3")
    _, compiled = run(tmp_path / "compiled", "trainer.max_steps=3", "trainer.compile=true")
    # Inductor fuses and reorders fp32 reductions: equal up to rounding, not bitwise.
    assert column(compiled, "train_loss") == pytest.approx(column(eager, "train_loss"), rel=1e-4)


def cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trainer", *TINY[:-1], "trainer.max_steps=4", *args,
               f"hydra.run.dir={tmp_path}"]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
@pytest.mark.beside
def test_cli_run_prints_progress_and_summary_path(tmp_path: Path) -> None:
    result = cli(tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert "step 4/4 | loss " in out and "| lr " in out and "tok/s" in out and "| mfu " in out and "eta" in out
    assert "val_loss" in out
    assert f"summary: {tmp_path / 'summary.json'}" in out
    for name in ("config.yaml", "metrics.csv", "summary.json", "train.log"):
        assert (tmp_path / name).exists(), name
    assert "step 4/4" in (tmp_path / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.beside
def test_console_script_is_installed() -> None:
    exe = shutil.which("trainer")
    assert exe is not None, "pip install -e . should put `trainer` on PATH"
    result = subprocess.run([exe, "--cfg", "job"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "model:" in result.stdout


@pytest.mark.slow
@pytest.mark.beside
def test_wandb_offline_and_tensorboard_loggers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path / "home")  # no netrc login: wandb must stay offline
    result = subprocess.run(
        [sys.executable, "-m", "trainer", *TINY, "trainer.max_steps=2", "logger=[csv,wandb,tensorboard]",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=REPO, timeout=300, env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb should have logged offline"
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert (run_dir / "metrics.csv").exists()


def test_strategy_clips_to_max_norm() -> None:
    from trainer.plugins.strategies import SingleDevice

    model = torch.nn.Linear(8, 8)
    model(torch.randn(4, 8)).pow(2).sum().mul(100).backward()
    norm_before = SingleDevice().clip_grad_norm([model], max_norm=0.5)
    assert norm_before > 0.5
    norm_after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert norm_after == pytest.approx(0.5, rel=1e-5)


def test_wandb_runs_of_one_sweep_share_a_group() -> None:
    """Hydra puts a sweep's jobs in `<sweep dir>/<job number>`: their wandb runs are grouped by the sweep
    directory and named by the job; another sweep gets another group. (Built, not started: no wandb run.)"""
    from trainer.run import build_loggers

    cfg = compose(["logger=[wandb]"])

    def wandb_init(run_dir: str) -> dict:
        (logger,) = [x for x in build_loggers(cfg, Path(run_dir)) if type(x).__name__ == "WandbLogger"]
        return logger._wandb_init

    first, second = wandb_init("multirun/2026-11-21/12-00-00/0"), wandb_init("multirun/2026-11-21/12-00-00/1")
    assert first["group"] == second["group"] == "12-00-00"
    assert (first["name"], second["name"]) == ("0", "1")
    assert wandb_init("multirun/2026-11-21/12-30-00/0")["group"] != first["group"]


def test_a_finished_run_leaves_nothing_for_the_next_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs of a Hydra sweep run one after the other in one process, and each `train` freezes what
    exists when it starts (gc.freeze): a finished run left in a reference cycle for the collector would
    be frozen with its model and optimizer copies for the rest of the sweep. So the strategy (which holds
    the precision plugin and, through it, the model and the fp32 masters) is gone when `train` returns.
    Fails without `train`'s collection after the teardown once anything makes a cycle through the
    strategy (checked by adding `self._cycle = self` to Strategy.connect_precision)."""

    import weakref

    import trainer.run as run_module

    built: list[weakref.ref] = []
    build = run_module.build_trainer

    def recording_build(*args: object, **kwargs: object) -> object:
        trainer = build(*args, **kwargs)
        built.extend([weakref.ref(trainer.strategy), weakref.ref(trainer.precision)])
        return trainer

    monkeypatch.setattr(run_module, "build_trainer", recording_build)
    run(tmp_path, "strategy=zero1", "trainer.devices=1", "precision=bf16_true", "trainer.max_steps=2",
        "trainer.val_every=0")
    assert len(built) == 2 and [ref() for ref in built] == [None, None]
