"""Every invalid input a user can give gets one line, the documented exit status and no traceback, and
leaves nothing in the run directory that a later `resume=auto` would trip on (issue 15).

Inputs across the config (optimizer, schedule, trainer, groups, overrides), the data, checkpoints and
resume, and every CLI entry point (`python -m trainer`, `trainer.checkpoint.hf`, `trainer.sweep`,
`trainer.plot`, `trainer.data.prepare`). The entry points' `main` functions run in this process (the
command line is the same; a process start costs seconds on 2 cores); tests/test_config.py and the slow test
at the end check the real processes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from trainer.checkpoint.manifest import complete_checkpoints
from trainer.config import compose
from trainer.run import train

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
        "trainer.seq_len=64", "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.max_steps=2",
        "trainer.val_batches=1", "trainer.log_every=1", "lr_schedule.warmup_steps=1", "data.max_bytes=500000",
        "callbacks=none", "trainer.peak_flops=1e11"]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Files the inputs point at: a good checkpoint and damaged copies of it, broken datasets, a file."""
    root = tmp_path_factory.mktemp("inputs")
    run = root / "good_run"
    train(compose(TINY), run)  # its final checkpoint (trainer.save_final, on by default)
    good = complete_checkpoints(run / "checkpoints")[-1]
    paths = {"root": root, "good": good}

    corrupt = root / "corrupt_ckpt" / good.name
    shutil.copytree(good, corrupt)
    shard = next(corrupt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated shard
    paths["corrupt"] = corrupt

    garbled = root / "garbled_manifest" / good.name
    shutil.copytree(good, garbled)
    (garbled / "checkpoint.json").write_text("{not json")
    paths["garbled"] = garbled

    partial_only = root / "partial_only"
    shutil.copytree(good, partial_only / f".{good.name}.partial")
    paths["partial_only"] = partial_only

    (root / "empty").mkdir()
    paths["empty"] = root / "empty"
    (root / "a_file").write_text("not a directory\n")
    paths["file"] = root / "a_file"

    no_meta = root / "data_no_meta"
    no_meta.mkdir()
    paths["data_no_meta"] = no_meta
    bad_json = root / "data_bad_json"
    bad_json.mkdir()
    (bad_json / "meta.json").write_text("[1, 2")
    paths["data_bad_json"] = bad_json
    short = root / "data_short"
    short.mkdir()
    (short / "meta.json").write_text(json.dumps({"format_version": 1, "dtype": "uint16", "vocab_size": 256,
                                                 "num_tokens": {"train": 1000, "val": 100}}))
    (short / "train.bin").write_bytes(b"\0" * 10)
    (short / "val.bin").write_bytes(b"\0" * 200)
    paths["data_short"] = short

    hf_no_weights = root / "hf_no_weights"
    hf_no_weights.mkdir()
    (hf_no_weights / "config.json").write_text("{}")
    paths["hf_no_weights"] = hf_no_weights
    return paths


def _entry(module: str) -> Callable[[list[str]], Any]:
    if module == "trainer":
        def run(argv: list[str]) -> Any:
            from trainer.cli import main

            saved = sys.argv
            sys.argv = ["trainer", *argv]
            try:
                return main()
            finally:
                sys.argv = saved
        return run
    if module == "hf":
        from trainer.checkpoint.hf import main as hf_main
        return hf_main
    if module == "sweep":
        from trainer.sweep import main as sweep_main
        return sweep_main
    if module == "plot":
        from trainer.plot import main as plot_main
        return plot_main
    from trainer.data.prepare import main as prepare_main
    return prepare_main


# (entry point, arguments ({name} is a fixture path, {run} the run directory), exit status, text of the line)
CASES: list[tuple[str, list[str], int, str]] = [
    # ---- config: optimizer --------------------------------------------------------------------------
    ("trainer", ["optimizer.betas=[2,0.9]"], 2, "optimizer.betas: each beta must be in [0, 1), got beta1=2"),
    ("trainer", ["optimizer.betas=[0.9]"], 2, "optimizer.betas: must be two numbers"),
    ("trainer", ["optimizer.betas=[0.9,1.0]"], 2, "beta2=1.0"),
    ("trainer", ["optimizer.eps=0"], 2, "optimizer.eps: must be a positive number"),
    ("trainer", ["optimizer.eps=-1e-8"], 2, "optimizer.eps: must be a positive number"),
    ("trainer", ["optimizer.lr=0"], 2, "optimizer.lr: must be positive"),
    ("trainer", ["optimizer.lr=nan"], 2, "optimizer.lr: must be positive"),
    ("trainer", ["optimizer.weight_decay=-0.1"], 2, "optimizer.weight_decay: must be >= 0"),
    ("trainer", ["optimizer.betas=abc"], 2, "optimizer.betas"),
    ("trainer", ["optimizer=sgd", "optimizer.momentum=-0.5"], 2, "optimizer.momentum: must be >= 0"),
    ("trainer", ["optimizer=sgd", "optimizer.momentum=0", "optimizer.nesterov=true"], 2,
     "optimizer.nesterov: nesterov needs optimizer.momentum > 0"),
    ("trainer", ["optimizer=adam"], 2, "optimizer=adam: no such option; available: adamw, muon, sgd"),
    ("trainer", ["optimizer.betas_=[0.9,0.9]"], 2, "unknown key; did you mean 'betas'?"),
    # ---- config: LR schedule -------------------------------------------------------------------------
    ("trainer", ["lr_schedule.warmup_steps=-1"], 2, "lr_schedule: warmup_steps must be in [0, inf), got -1"),
    ("trainer", ["lr_schedule.min_ratio=1.5"], 2, "lr_schedule: min_ratio must be in [0.0, 1.0], got 1.5"),
    ("trainer", ["lr_schedule=wsd", "lr_schedule.decay_shape=exp"], 2, "lr_schedule.decay_shape"),
    ("trainer", ["lr_schedule=wsd", "lr_schedule.decay_fraction=0"], 2, "lr_schedule: decay_fraction must be in"),
    ("trainer", ["lr_schedule=inverse_sqrt", "lr_schedule.timescale=0"], 2, "lr_schedule: timescale must be in"),
    ("trainer", ["lr_schedule=step"], 2, "lr_schedule=step: no such option"),
    # ---- config: trainer and groups ------------------------------------------------------------------
    ("trainer", ["trainer.max_steps=0"], 2, "trainer.max_steps: must be a positive integer or null, got 0"),
    ("trainer", ["trainer.max_steps=abc"], 2, "trainer.max_steps"),
    ("trainer", ["trainer.grad_clip=-1"], 2, "trainer.grad_clip: must be >= 0"),
    ("trainer", ["trainer.global_batch_size=10"], 2, "trainer.global_batch_size: 10 is not a multiple"),
    ("trainer", ["trainer.seq_len=100000"], 2, "trainer.seq_len: 100000 exceeds model.max_seq_len"),
    ("trainer", ["trainer.preflight=maybe"], 2, "trainer.preflight"),
    ("trainer", ["trainer.save_final=sometimes"], 2, "trainer.save_final"),
    ("trainer", ["model=llama5"], 2, "model=llama5: no such option"),
    ("trainer", ["precision=fp4"], 2, "precision=fp4: no such option"),
    ("trainer", ["precision=fp8"], 2, "precision=fp8: this machine's device \\(cpu\\) has no float8 matmuls"),
    ("trainer", ["trainer.devices=2"], 2, "trainer.devices: trainer.devices x trainer.num_nodes = 2 processes"),
    ("trainer", ["trainer.max_steps=[1"], 2, "cannot parse override"),
    ("trainer", ["mode=debug"], 2, "mode: 'debug' is not one of train, plan"),
    # ---- config: Mixture-of-Experts options (trainer/models/moe.py) ----------------------------------
    ("trainer", ["model=tiny_moe", "model.top_k=9"], 2, "model.top_k=9 must be between 1 and model.n_experts=8"),
    ("trainer", ["model=tiny_moe", "model.capacity_factor=-1"], 2, "capacity_factor must be a finite number >= 0"),
    ("trainer", ["model=gpt2_small", "model.n_experts=8"], 2, "n_experts"),  # a family without experts
    # ---- data ----------------------------------------------------------------------------------------
    ("trainer", ["data=token_file", "data.path=/nonexistent"], 2, "data.path: /nonexistent does not exist"),
    ("trainer", ["data=token_file"], 2, "data.path: required value is missing"),
    ("trainer", ["data=token_file", "data.path={data_no_meta}"], 2, "data.path: "),
    ("trainer", ["data=token_file", "data.path={data_bad_json}"], 2, "not valid JSON"),
    ("trainer", ["data=token_file", "data.path={data_short}"], 2, "the dataset is incomplete or stale"),
    ("trainer", ["data=token_file", "data.path={file}"], 2, "data.path: token dataset directory not found"),
    ("trainer", ["data.root=/nonexistent/stdlib"], 2, "data.root: /nonexistent/stdlib does not exist"),
    # ---- checkpoints and resume ----------------------------------------------------------------------
    ("trainer", ["resume=/nonexistent/ckpt"], 2, "resume: /nonexistent/ckpt does not exist"),
    ("trainer", ["resume={empty}"], 2, "is neither a complete checkpoint"),
    ("trainer", ["resume={partial_only}"], 2, "is neither a complete checkpoint"),
    ("trainer", ["resume={file}"], 2, "is neither a complete checkpoint"),
    ("trainer", ["resume={corrupt}"], 2, "CheckpointCorrupt|truncated|size"),
    ("trainer", ["resume={garbled}"], 2, "cannot read"),
    ("trainer", ["resume={good}", "model.dim=128", "model.ffn_hidden_dim=256"], 2, "model"),
    ("trainer", ["init_from=/nonexistent/weights"], 2, "init_from: /nonexistent/weights does not exist"),
    ("trainer", ["init_from={empty}"], 2, "init_from: "),
    ("trainer", ["init_from={hf_no_weights}"], 2, "is neither a checkpoint"),
    ("trainer", ["callbacks=[default,checkpoint]", "callbacks.checkpoint.keep_last=0"], 2,
     "callbacks.checkpoint: keep_last must be >= 1"),
    ("trainer", ["callbacks=[default,checkpoint]", "callbacks.checkpoint.every_n_steps=0"], 2,
     "callbacks.checkpoint: every_n_steps must be >= 1"),
    ("trainer", ["callbacks=[default,checkpoint]", "callbacks.checkpoint.in_memory_every=0"], 2,
     "callbacks.checkpoint: in_memory_every must be >= 1"),
    ("trainer", ["callbacks=[default,checkpoint]", "callbacks.checkpoint.mode=median"], 2,
     "callbacks.checkpoint: mode must be min or max"),
    ("trainer", ["callbacks=[default,checkpoint]", "callbacks.checkpoint.directory=/proc/ckpts"], 2,
     "callbacks.checkpoint: directory: cannot write checkpoints to /proc/ckpts"),
    # ---- CLI entry points and the machine ------------------------------------------------------------
    ("trainer", ["hydra.run.dir=/proc/nope"], 2, "hydra.run.dir: cannot create the run directory /proc/nope"),
    ("trainer", ["hydra.run.dir={file}/run"], 2, "is not a directory, cannot create the run directory"),
    ("trainer", ["model=llama2_70b"], 3, "does not fit in memory: host memory needs"),
    ("hf", ["export", "/nonexistent/ckpt", "{root}/hf_out"], 2, "not a complete checkpoint"),
    ("hf", ["export", "{corrupt}", "{root}/hf_out2"], 2, "error: "),
    ("sweep", ["summarize", "/nonexistent/sweep"], 2, "is not a directory"),
    ("sweep", ["summarize", "{empty}"], 2, "no jobs under"),
    ("plot", ["/nonexistent/run"], 2, "error: "),
    ("prepare", ["/nonexistent/input.txt", "--output", "{root}/prepared"], 2, "prepare: error: "),
]


def _ids() -> list[str]:
    return [f"{module} {' '.join(args)}"[:80] for module, args, _, _ in CASES]


def test_at_least_forty_invalid_inputs() -> None:
    assert len(CASES) >= 40
    groups = {"optimizer", "lr_schedule", "data", "resume", "init_from", "hydra.run.dir"}
    assert all(any(group in " ".join(args) for _, args, _, _ in CASES) for group in groups)
    assert {module for module, _, _, _ in CASES} == {"trainer", "hf", "sweep", "plot", "prepare"}


@pytest.mark.parametrize(("module", "args", "status", "expected"), CASES, ids=_ids())
def test_invalid_input_is_one_line_with_its_exit_status(module: str, args: list[str], status: int, expected: str,
                                                          fixtures: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    monkeypatch.delenv("TRAINER_FULL_ERROR", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    names = {**{k: str(v) for k, v in fixtures.items()}, "run": str(run_dir)}
    argv = [a.format(**names) for a in args]
    if module == "trainer" and not any(a.startswith("hydra.run.dir=") for a in argv):
        # the tiny settings, less those of a group the case picks (model=llama2_70b is the real model)
        chosen = {a.split("=", 1)[0] for a in argv if "." not in a.split("=", 1)[0]}
        argv = [a for a in TINY if a.split(".", 1)[0] not in chosen] + argv + [f"hydra.run.dir={run_dir}"]
    try:
        code = _entry(module)(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == status, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in out + err
    assert lines[0].startswith(("error: ", "prepare: error: ")), lines[0]
    assert expected in lines[0] or re.search(expected, lines[0]), lines[0]
    # Nothing a later resume=auto would trip on: no checkpoint, no unfinished save, no metrics.
    checkpoints = run_dir / "checkpoints"
    assert not complete_checkpoints(checkpoints) and not (checkpoints.is_dir() and any(checkpoints.iterdir()))
    assert not (run_dir / "metrics.csv").exists()


def test_full_error_shows_the_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """TRAINER_FULL_ERROR=1: the exception itself instead of the line (issue 15, report 4's betas)."""
    monkeypatch.setenv("TRAINER_FULL_ERROR", "1")
    with pytest.raises(Exception, match="beta"):
        _entry("trainer")(TINY + ["optimizer.betas=[2,0.9]", f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(OSError):
        _entry("trainer")(TINY + ["hydra.run.dir=/proc/nope"])


@pytest.mark.slow
@pytest.mark.beside
def test_real_processes_exit_with_one_line(tmp_path: Path) -> None:
    """The real `python -m trainer` processes of issue 15's report 6 (one line, exit 2, no run directory;
    the error used to come from inside Hydra's app) and report 2 (exit 3 before anything is allocated)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("TRAINER_FULL_ERROR", "HYDRA_FULL_ERROR")}
    cases = [
        (["data=token_file", "data.path=/nonexistent"], 2, "error: data.path: /nonexistent does not exist"),
        (["model=llama2_70b"], 3, "error: does not fit in memory: host memory needs"),
    ]
    for overrides, status, expected in cases:
        run_dir = tmp_path / "run"
        result = subprocess.run([sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={run_dir}"],
                                capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
        assert result.returncode == status, (overrides, result.stderr[-2000:])
        assert result.stderr.strip().startswith(expected) and len(result.stderr.strip().splitlines()) == 1, \
            (overrides, result.stderr)
        assert "Traceback" not in result.stdout + result.stderr
        assert not run_dir.exists()
