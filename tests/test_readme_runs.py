"""Every command in the README runs, with tiny settings.

Commands are read from README.md: lines of code blocks and indented blocks (a trailing `\\` continues a
line, `a && b` is two commands, a `$ cmd` line is an error example whose next line is the output it
shows) and inline spans that start like a command. `plan_of` places each one; a command it cannot place
fails `test_every_readme_command_has_a_tiny_run` until it is taught here. Where each runs:

- in_process: single-process `python -m trainer` commands (runs, `--cfg job`, `mode=plan`, sweeps, the
  error examples) and `python -m trainer.sweep | .plot | .checkpoint.hf | .data.prepare`, in this
  process through the module's entry point as `python -m` runs it (runpy): a process start costs seconds
  on the 2-core machine, this costs only what the command itself does;
- harness: multi-process commands, in the session's shared launches (tests/launch_pool.py) when they read
  nothing an earlier command wrote, else in a launch of tests/distributed_harness.py of their own;
- subprocess: the quick-start `python -m trainer`, for real (Hydra's default outputs/DATE/TIME), and
  `mode=check` (its launched workers measure their groups' bandwidth; nothing trains);
- ELSEWHERE: commands another test already runs with tiny settings, pointed at; that test must exist and
  use the command's options;
- NOT_RUN: commands that cannot run here, or are the suite itself, skipped with the reason.

All commands share one working directory and run in README order (multi-process ones at the end), so
the README's relative paths (runs/a, hf_out/, outputs/DATE/TIME) are the ones used. Tiny settings go
after a command's own arguments (the last override wins): a 2-layer model of the command's family, 2
steps of 16 x 32 tokens, a fixed MFU reference (no matmul benchmark at start-up). What this machine
cannot run as written is scaled down keeping the command's structure (SCALED says why).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import logging
import math
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.launch_pool import POOL

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
STEPS = 2
TINY_RUN = [f"trainer.max_steps={STEPS}", "trainer.seq_len=32", "trainer.log_every=1", "trainer.val_every=1",
            "trainer.val_batches=1", "lr_schedule.warmup_steps=1", "data.max_bytes=200000",
            # a fixed MFU reference: otherwise every run first measures this machine's matmul peak
            "trainer.peak_flops=1e12"]
TINY_MODEL = {  # the command's model family, shrunk (GPT stays GPT)
    "llama": ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"],
    "gpt": ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_hidden_dim=128", "model.vocab_size=256"],
    # the tiny config is already CPU-sized: one dense layer, then one MoE layer (and its MTP depth)
    "deepseek_v3": ["model.n_layers=2"],
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
COMMAND_START = re.compile(r"^(python|pip|torchrun|srun|trainer)( |$)")
# Modules other than the trainer whose `python -m` commands run in this process.
TOOLS = ("trainer.sweep", "trainer.plot", "trainer.checkpoint.hf", "trainer.data.prepare")

INSTALL = "installs the package under test into this environment; CI runs this install before the suite"
NOT_RUN = {
    "python -m venv .venv": "creates a virtual environment; CI (.ci/run) runs the suite in a new one",
    ". .venv/bin/activate": "activates that virtual environment (the suite runs in one already)",
    "pip install --no-compile -c constraints-cpu.txt -e .": INSTALL,
    'pip install -c constraints.txt -e ".[dev]"': INSTALL,
    'pip install --no-compile -c constraints-cpu.txt -e ".[dev]"': INSTALL,
    'pip install -e ".[data]"': INSTALL,
    "python -m pytest -q": "the test suite itself, of which this test is part",
    'python -m pytest -m "not slow" -q': "the fast tier of the test suite itself (this test is in the full one)",
    "python -m pytest -m gpu": "the GPU tier of the test suite (tests/test_gpu.py): needs a CUDA GPU, and skips "
                               "without one",
    "srun --ntasks-per-node 8 python -m trainer strategy=fsdp trainer.devices=8 trainer.num_nodes=4 "
    "trainer.global_batch_size=256": "needs SLURM, which this machine does not have; "
    "tests/test_launch.py::test_srun_tasks_join_as_one_job runs tasks with srun's variables set by hand",
}
# Commands another test runs with tiny settings, each of which would add 5-30 s here (torch.compile,
# wandb's service, an 8-process launch, process starts): that test, and strings its file must contain
# (the command's distinguishing options), so that the pointer breaks when the test stops running it.
ELSEWHERE = {
    "trainer ...":  # the console script runs the same `main` as `python -m trainer` (run below for real)
        ("tests/test_run.py::test_console_script_is_installed", ['[exe, "--cfg", "job"]']),
    "python -m trainer trainer.compile=true":
        ("tests/test_run.py::test_compiled_blocks_match_eager", ["trainer.compile=true"]),
    "python -m trainer logger=[csv,wandb,tensorboard]":
        ("tests/test_run.py::test_wandb_offline_and_tensorboard_loggers", ["logger=[csv,wandb,tensorboard]"]),
    "python -m trainer strategy=3d tp=2 pp=2 trainer.devices=8 strategy.data_parallel=zero1 "
    "trainer.micro_batch_size=4":
        ("tests/test_three_d.py::test_3d_matches_single_process",
         ['"strategy=3d", "tp=2", "pp=2", "trainer.devices=8"', '"zero1"', "trainer.micro_batch_size=4"]),
    # the families' parity launches run these layouts against one process
    "python -m trainer model=qwen3_moe_tiny strategy=tp tp=2 trainer.devices=2":
        ("tests/test_qwen3.py::test_every_strategy_matches_one_process",
         ['("qwen3_moe_tiny", "tp2", ["strategy=tp", "tp=2"])', '"trainer.devices=2"']),
    "python -m trainer model=qwen3_tiny strategy=3d tp=2 pp=2 trainer.devices=4 trainer.micro_batch_size=4":
        ("tests/test_qwen3.py::test_every_strategy_matches_one_process",
         ['("qwen3_tiny", "3d_tp2_pp2", ["strategy=3d", "tp=2", "pp=2"])', '"trainer.devices=4"',
          '"trainer.micro_batch_size=4"']),
    "python -m trainer model=deepseek_v3_tiny strategy=tp tp=2 trainer.devices=2":
        ("tests/test_deepseek_v3.py::test_data_parallel_strategies_reproduce_the_single_process_run",
         ['"tp2": ["strategy=tp", "tp=2"]', '"trainer.devices=2"']),
    "python -m trainer model=deepseek_v3_tiny strategy=pp pp=2 trainer.devices=2":
        ("tests/test_deepseek_v3.py::test_data_parallel_strategies_reproduce_the_single_process_run",
         ['"pp2": ["strategy=pp", "pp=2"]', '"trainer.devices=2"']),
    "python -m trainer model=deepseek_v3_tiny strategy=ddp cp=2 trainer.devices=2":
        ("tests/test_deepseek_v3.py::test_data_parallel_strategies_reproduce_the_single_process_run",
         ['"cp2_ring": ["strategy=ddp", "cp=2"]', '"trainer.devices=2"']),
    # strategy=auto is settled by the CLI before Hydra composes (the harness composes overrides itself): that
    # test's pool job runs the command as a real `python -m trainer`, then again in its run directory
    "python -m trainer strategy=auto trainer.devices=2 plan.trials=2":
        ("tests/test_strategy_auto.py::test_auto_run_with_trials_then_rerun_reuses_the_layout",
         ['"strategy=auto", "trainer.devices=2", "plan.trials=2"']),
    "python -m trainer recipe=tiny_3d_cpu":
        ("tests/test_recipes.py::test_each_recipe_shrunk_to_a_tiny_model_trains_2_steps_on_2_cpu_processes",
         ['"tiny_3d_cpu"']),
    # 1 node x 2 processes of torchrun (`--standalone`: a c10d rendezvous on a local port) joining as workers
    "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29400 -m trainer "
    "strategy=fsdp trainer.devices=8 trainer.num_nodes=4 trainer.global_batch_size=256":
        ("tests/test_launch.py::test_torchrun_workers_join_and_share_one_run_dir",
         ['"torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer"']),
    # Megatron .bin/.idx and nanoGPT train.bin written by that test, trained against the same tokens in our format
    "python -m trainer data=megatron data.path=corpus/my_text_document data.vocab_size=50257 data.eos_id=50256 "
    "model=gpt2_small":
        ("tests/test_data_mixture.py::test_megatron_and_nanogpt_files_train_like_our_format",
         ['"data=megatron"', "data.vocab_size=", "data.eos_id="]),
    "python -m trainer data=nanogpt data.path=nanoGPT/data/openwebtext model=gpt2_small":
        ("tests/test_data_mixture.py::test_megatron_and_nanogpt_files_train_like_our_format", ['"data=nanogpt"']),
    # a calibration trains a few steps on 2 processes: that test runs it with a tiny model
    "python -m trainer strategy=ddp trainer.devices=2 mode=plan plan.calibrate=true":
        ("tests/test_calibrate.py::test_two_process_calibration_through_the_cli",
         ['"strategy=ddp", "trainer.devices=2", "mode=plan"', '"plan.calibrate=true"']),
    # 2 processes: the 2-process launch of tests/test_strategies.py runs it against zero3 once per step
    "python -m trainer strategy=zero3 strategy.grad_sync=microbatch ...":
        ("tests/test_strategies.py::test_zero3_reduces_once_per_step_when_it_fits_or_when_asked",
         ['"strategy.grad_sync=microbatch"']),
    # no SLURM here: the README's local twin, submitit's local executor, each job in its own process
    "python -m trainer -m hydra/launcher=slurm ...":
        ("tests/test_sweep.py::test_optuna_sweeper_on_the_submitit_local_launcher", ['"hydra/launcher=local"']),
}
# Why a command's own values were changed (applied by `adapt`).
SCALED = {
    "trainer.num_nodes": "N nodes x 8 devices become 1 node x 2 processes (one machine); the global batch "
                         "shrinks with the world; tests/test_launch.py::test_two_nodes_on_one_machine runs "
                         "two launchers meeting at a rendezvous endpoint",
    "sweep devices": "each job of a sweep with trainer.devices=2 starts its own 2 workers (seconds each); the "
                     "jobs run on 1 process here, tests/test_sweep.py runs a sweep of 2-process ddp/zero2 jobs",
    "hydra.sweeper.n_trials": "2 trials show the study going on from one trial to the next",
    "every_n_steps": "a checkpoint every step of the 2 (the README's every 50 of 200)",
}


@dataclass(frozen=True)
class Command:
    text: str  # as written in the README (a continued line joined)
    expected: str | None = None  # the output an error example shows


def readme_commands() -> list[Command]:
    """Every command of the README, in order, each once."""
    commands: list[Command] = []
    block: list[str] = []
    in_block = False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            if in_block:
                commands += _block_commands(block)
                block = []
            in_block = not in_block
        elif in_block:
            block.append(line)
        elif line.startswith("    "):
            commands += _block_commands([line])
        else:
            commands += [Command(span) for span in re.findall(r"`([^`]+)`", line) if COMMAND_START.match(span)]
    unique: dict[str, Command] = {}
    for command in commands:
        unique.setdefault(command.text, command)
    return list(unique.values())


def _block_commands(lines: list[str]) -> list[Command]:
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line.strip())
    examples = any(line.startswith("$ ") for line in joined)
    commands = []
    for index, line in enumerate(joined):
        text = line.split(" #", 1)[0].strip()
        if not text or text.startswith("#"):
            continue
        if examples:  # `$ command` then the output it shows
            if text.startswith("$ "):
                following = joined[index + 1] if index + 1 < len(joined) else ""
                commands.append(Command(text[2:], None if following.startswith("$") else following))
            continue
        commands += [Command(part.strip()) for part in text.split(" && ")]
    return commands


# ---- how each command runs ------------------------------------------------------------------------------
@dataclass
class Plan:
    how: str  # in_process | harness | subprocess | elsewhere | not_run
    program: list[str] = field(default_factory=list)  # `python -m X` module, or the executable's argv
    args: list[str] = field(default_factory=list)
    kind: str = "run"  # run | sweep | plan | cfg | error | tool
    world: int = 1
    notes: list[str] = field(default_factory=list)
    reason: str = ""


def value_of(args: list[str], key: str) -> str | None:
    found = [arg.split("=", 1)[1] for arg in args if arg.split("=", 1)[0] == key]
    return found[-1] if found else None


def replace(args: list[str], key: str, value: Any) -> list[str]:
    return [f"{key}={value}" if arg.split("=", 1)[0] == key else arg for arg in args]


def user_overrides(args: list[str]) -> list[str]:
    """The config overrides of a CLI argument list: no flags or Hydra's own keys, a sweep's first values."""
    overrides = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg or arg.lstrip("+~").startswith("hydra"):
            continue
        key, value = arg.split("=", 1)
        overrides.append(f"{key}={value.split(',')[0] if not value.startswith('[') else value}")
    return overrides


def adapt(args: list[str], notes: list[str]) -> list[str]:
    """Scale what this machine cannot run as written (each change noted with SCALED's reason)."""
    args = [arg for arg in args if arg != "..."]  # an elided rest of the command
    nodes = int(value_of(args, "trainer.num_nodes") or 1)
    if nodes > 1:
        world = nodes * int(value_of(args, "trainer.devices") or 1)
        args = replace(replace(args, "trainer.num_nodes", 1), "trainer.devices", 2)
        batch = value_of(args, "trainer.global_batch_size")
        if batch is not None:
            args = replace(args, "trainer.global_batch_size", int(batch) * 2 // world)
        notes.append(SCALED["trainer.num_nodes"])
    if "-m" in args and int(value_of(args, "trainer.devices") or 1) > 1:
        args = replace(args, "trainer.devices", 1)
        notes.append(SCALED["sweep devices"])
    if value_of(args, "hydra.sweeper.n_trials") is not None:
        args = replace(args, "hydra.sweeper.n_trials", 2)
        notes.append(SCALED["hydra.sweeper.n_trials"])
    if value_of(args, "callbacks.checkpoint.every_n_steps") is not None:
        args = replace(args, "callbacks.checkpoint.every_n_steps", 1)
        notes.append(SCALED["every_n_steps"])
    return args


def model_family(args: list[str]) -> str:
    """llama (Qwen3 too: the same shrinking options), gpt or deepseek_v3: the schema of the model config the
    command picks, read from conf/ and recipes/ as Hydra would find it (composing every command would cost
    seconds)."""
    choice = value_of(args, "model")
    recipe = value_of(args, "recipe")
    if choice is None and recipe is not None:
        found = re.search(r"override /model: (\w+)", (REPO / "recipes" / f"{recipe}.yaml").read_text())
        choice = found.group(1) if found else None
    if choice is None:  # the default of conf/config.yaml
        found = re.search(r"- model: (\w+)", (REPO / "conf" / "config.yaml").read_text())
        assert found is not None
        choice = found.group(1)
    text = (REPO / "conf" / "model" / f"{choice}.yaml").read_text()
    return next((family for family in ("gpt", "deepseek_v3") if f"{family}_schema" in text), "llama")


def tiny(args: list[str]) -> list[str]:
    run = TINY_RUN
    if value_of(args, "data") not in (None, "stdlib"):  # data.max_bytes is the stdlib corpus's option
        run = [arg for arg in run if not arg.startswith("data.")]
    named = {arg.split("=", 1)[0] for arg in args}  # what the command sets itself (a layer count it needs) stays
    return [arg for arg in TINY_MODEL[model_family(args)] if arg.split("=", 1)[0] not in named] + run


def plan_of(command: Command, quick_start: bool = False) -> Plan:
    """How `command` runs here; ValueError for a command this test does not know how to run."""
    if command.text in NOT_RUN:
        return Plan("not_run", reason=NOT_RUN[command.text])
    if command.text in ELSEWHERE:
        return Plan("elsewhere", reason=ELSEWHERE[command.text][0])
    tokens = shlex.split(command.text)
    notes: list[str] = []
    if command.expected is not None:
        if tokens[:3] != ["python", "-m", "trainer"]:
            raise ValueError(f"an error example that is not `python -m trainer`: {command.text}")
        return Plan("in_process", ["trainer"], tokens[3:], kind="error")
    if tokens[:3] == ["python", "-m", "trainer"]:
        args = adapt(tokens[3:], notes)
        if "--cfg" in args:  # prints the config, runs nothing: nothing to make tiny
            return Plan("in_process", ["trainer"], args, kind="cfg", notes=notes)
        if "mode=plan" in args:  # a report on the configured (big) model, nothing runs
            return Plan("in_process", ["trainer"], args, kind="plan", notes=notes)
        if "mode=check" in args:  # the launcher's workers measure their groups, nothing trains: a real process
            world = int(value_of(args, "trainer.devices") or 1)
            return Plan("subprocess", [sys.executable, "-m", "trainer"], [*args, "check.size_mb=1", "check.iters=2"],
                        kind="check", world=world, notes=notes)
        args = args + tiny(args)
        if "-m" in args:
            return Plan("in_process", ["trainer"], args, kind="sweep", notes=notes)
        world = int(value_of(args, "trainer.devices") or 1) * int(value_of(args, "trainer.num_nodes") or 1)
        if quick_start:  # through a real `python -m trainer`
            return Plan("subprocess", [sys.executable, "-m", "trainer"], args, notes=notes)
        if world > 1:
            return Plan("harness", args=args, world=world, notes=notes)
        return Plan("in_process", ["trainer"], args, notes=notes)
    if tokens[:2] == ["python", "-m"] and tokens[2] in TOOLS:
        return Plan("in_process", [tokens[2]], tokens[3:], kind="tool")
    raise ValueError(f"README command without a tiny run: {command.text!r}; teach tests/test_readme_runs.py "
                     "(plan_of) how to run it, or point ELSEWHERE / NOT_RUN at what covers it")


@functools.cache
def plans() -> dict[str, Plan]:
    commands = readme_commands()
    quick_start = next(c.text for c in commands if c.text.startswith("python -m trainer") and c.expected is None)
    return {command.text: plan_of(command, command.text == quick_start) for command in commands}


# Overrides whose values are what an earlier command of the README wrote (a checkpoint, an export, data).
READS_EARLIER = ("resume", "init_from", "data.path", "data.sources")


def pooled(plan: Plan) -> bool:
    """A multi-process command that reads nothing an earlier command wrote: it runs in the shared launches."""
    return plan.how == "harness" and not any(
        arg.split("=", 1)[0] in (*READS_EARLIER, "hydra.run.dir") or "DATE/TIME" in arg for arg in plan.args)


def slug(index: int) -> str:
    return f"c{index:02d}"


def _register_pooled_runs() -> None:
    try:
        all_plans = plans()
    except ValueError:  # a command without a tiny run: test_every_readme_command_has_a_tiny_run says which
        return
    by_world: dict[int, list[dict[str, Any]]] = {}
    for index, command in enumerate(readme_commands()):
        plan = all_plans[command.text]
        if pooled(plan):
            by_world.setdefault(plan.world, []).append({"name": slug(index), "overrides": user_overrides(plan.args)})
    for world, runs in by_world.items():
        POOL.add("readme_runs", world, runs)


# ---- running ---------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    plan: Plan
    code: int | None = None
    out: str = ""
    run_dirs: list[Path] = field(default_factory=list)  # a tool's: its working directory
    runs: list[dict[str, Any]] = field(default_factory=list)  # snapshots of the run (or sweep job) directories
    steps: int = STEPS
    resumed_from: str | None = None  # the checkpoint a continued run must report (auto: the latest)
    error: str | None = None  # the run could not be carried out (an exception in this test's machinery)
    created: set[Path] = field(default_factory=set)  # files a command that runs nothing left behind


@contextlib.contextmanager
def as_main(argv: list[str], cwd: Path) -> Iterator[io.StringIO]:
    """sys.argv, the working directory, stdout/stderr, the root logger and Hydra's job record of a
    `python -m` run in this process, restored after it (Hydra configures logging for its job, and
    the planner reads the record)."""
    from hydra.core.hydra_config import HydraConfig

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved_argv, saved_cwd, saved_hydra = sys.argv, os.getcwd(), HydraConfig.instance().cfg
    buffer = io.StringIO()
    sys.argv = argv
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
            yield buffer
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        HydraConfig.instance().cfg = saved_hydra
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def run_module(module: str, args: list[str], cwd: Path) -> tuple[int, str]:
    """`python -m MODULE ARGS` run in this process by runpy, as the interpreter runs it; (exit code, output)."""
    code: int = 0
    with as_main([module, *args], cwd) as output:
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code)
    return code, output.getvalue()


def dated_dirs(root: Path) -> list[Path]:
    """Hydra's default run or sweep directories (`DATE/TIME`) under root."""
    return sorted(root.glob("????-??-??/??-??-??"))


class Runner:
    """Runs the README's commands in order in one working directory; multi-process runs at the end."""

    def __init__(self, cwd: Path, out: Path) -> None:
        self.cwd = cwd
        self.out = out
        self.outcomes: dict[str, Outcome] = {}
        self.harness: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        self.last_sweep: Path | None = None

    def run_sequence(self, commands: list[Command], all_plans: dict[str, Plan]) -> dict[str, Outcome]:
        """Every command in order, but the pooled ones (`read_all_pooled` reads those)."""
        for index, command in enumerate(commands):
            plan = all_plans[command.text]
            outcome = self.outcomes[command.text] = Outcome(plan)
            if plan.how in ("not_run", "elsewhere"):
                continue
            try:
                self.run_one(slug(index), command, plan, outcome)
                if plan.how != "harness":
                    self.record(outcome)
            except Exception as error:  # noqa: BLE001 - recorded, reported by the command's own test
                outcome.error = f"{type(error).__name__}: {error}"
        for world, runs in sorted(self.harness.items()):
            self.launch(world, runs)
        return self.outcomes

    def read_all_pooled(self) -> dict[str, Outcome]:
        """The pooled commands' outcomes, from the session's shared launches."""
        for world in sorted({outcome.plan.world for outcome in self.outcomes.values() if pooled(outcome.plan)}):
            self.read_pooled(world)
        return self.outcomes

    @staticmethod
    def record(outcome: Outcome) -> None:
        """Read what each run left as soon as it ended: a later command may continue it (runs/a)."""
        if outcome.plan.kind == "sweep":
            (sweep,) = outcome.run_dirs
            outcome.runs = [snapshot(job) for job in sorted(sweep.iterdir()) if job.is_dir() and job.name.isdigit()]
        elif outcome.plan.kind == "run":
            outcome.runs = [snapshot(run_dir) for run_dir in outcome.run_dirs]

    def resolve(self, args: list[str]) -> list[str]:
        """The README's placeholders: paths of earlier runs, and what a reader fills in."""
        resolved = []
        for arg in args:
            arg = arg.replace("step_00000200", f"step_{STEPS:08d}")  # the README's runs end at step 200
            if arg.startswith("outputs/DATE/TIME"):
                (run,) = dated_dirs(self.cwd / "outputs")  # the quick start's, Hydra's default directory
                arg = str(run.relative_to(self.cwd))
            elif arg.startswith("multirun/DATE/TIME"):
                assert self.last_sweep is not None, "no sweep ran before this command"
                arg = str(self.last_sweep.relative_to(self.cwd))
            resolved.append(arg)
        return resolved

    def continuing(self, args: list[str], run_dir: Path | None) -> str | None:
        """The checkpoint a run continues from (resume=PATH, or resume=auto in a directory that has one)."""
        resume = value_of(args, "resume")
        if resume not in (None, "auto", "none"):
            return resume
        if resume != "none" and run_dir is not None and (self.cwd / run_dir / "checkpoints").is_dir():
            return "auto"
        return None

    def run_one(self, slug: str, command: Command, plan: Plan, outcome: Outcome) -> None:
        args = self.resolve(plan.args)
        if plan.kind == "tool":
            outcome.run_dirs = [self.cwd]
            outcome.code, outcome.out = run_module(plan.program[0], self.tool_args(plan.program[0], args), self.cwd)
            return
        if plan.kind in ("error", "cfg", "plan"):  # these start nothing and write nothing
            before = set(self.cwd.rglob("*"))
            outcome.code, outcome.out = run_module(plan.program[0], args, self.cwd)
            outcome.created = set(self.cwd.rglob("*")) - before
            return
        if plan.kind == "check":  # its own run directory: outputs/DATE/TIME stays the quick start's
            self.run_subprocess(plan, [*args, f"hydra.run.dir=outputs/{slug}"], outcome)
            return
        if plan.kind == "sweep":
            sweep = Path("multirun") / slug  # the default DATE/TIME has a one-second resolution
            outcome.code, outcome.out = run_module("trainer", [*args, f"hydra.sweep.dir={sweep}"], self.cwd)
            sweep = self.cwd / sweep
            outcome.run_dirs = [sweep]
            self.last_sweep = sweep
            return
        run_dir_arg = value_of(args, "hydra.run.dir")
        outcome.resumed_from = self.continuing(args, Path(run_dir_arg) if run_dir_arg else None)
        if outcome.resumed_from is not None:  # 2 more steps after the checkpoint's 2
            outcome.steps = 2 * STEPS
            args = [*args, f"trainer.max_steps={outcome.steps}"]
        if pooled(plan):  # already running, or run, in the session's shared launch of its world size
            outcome.run_dirs = [POOL.directory("readme_runs") / f"np{plan.world}" / slug]
            return
        if plan.how == "harness":  # the harness runs in the repository: paths made absolute
            overrides = [f"resume={self.cwd / arg.split('=', 1)[1]}" if arg.startswith("resume=") else arg
                         for arg in user_overrides(args)]
            self.harness.setdefault(plan.world, []).append((command.text, {"name": slug, "overrides": overrides}))
            outcome.run_dirs = [self.out / f"np{plan.world}" / slug]
            return
        if plan.how == "subprocess":
            self.run_subprocess(plan, args, outcome)
            return
        if run_dir_arg is None:  # outputs/DATE/TIME has a one-second resolution: one directory per run
            run_dir_arg = f"outputs/{slug}"
            args = [*args, f"hydra.run.dir={run_dir_arg}"]
        outcome.code, outcome.out = run_module("trainer", args, self.cwd)
        outcome.run_dirs = [self.cwd / run_dir_arg]

    def run_subprocess(self, plan: Plan, args: list[str], outcome: Outcome) -> None:
        """A real process, in Hydra's default run directory (outputs/DATE/TIME) unless the command names one."""
        before = set(dated_dirs(self.cwd / "outputs"))
        result = subprocess.run([*plan.program, *args], capture_output=True, text=True, cwd=self.cwd, env=ENV,
                                timeout=600)
        outcome.code, outcome.out = result.returncode, result.stdout + result.stderr
        run_dir = value_of(args, "hydra.run.dir")
        outcome.run_dirs = ([self.cwd / run_dir] if run_dir else
                            sorted(set(dated_dirs(self.cwd / "outputs")) - before))

    def tool_args(self, module: str, args: list[str]) -> list[str]:
        """What a reader puts in place of the README's INPUT... / DIR / [optional] parts."""
        if module == "trainer.data.prepare":
            inputs = []
            for name in ("one.txt", "two.txt", "three.txt"):  # a few documents of real text
                path = self.cwd / "text" / name
                path.parent.mkdir(exist_ok=True)
                path.write_text((REPO / "README.md").read_text() + name)
                inputs.append(str(path.relative_to(self.cwd)))
            placeholders = {"INPUT...": inputs, "DIR": ["tokens"], "[--tokenizer": ["--tokenizer"],
                            "tokenizer.json": [], "|": [], "bytes]": ["bytes"]}
            for arg in args:  # a named input file: README paragraphs as its documents, in its format
                if not arg.startswith("-") and not (self.cwd / arg).exists() and arg.endswith((".jsonl.gz", ".parquet")):
                    write_documents(self.cwd / arg, text_key(args) or "text")
            return [part for arg in args for part in placeholders.get(arg, [arg])]
        if module == "trainer.plot":  # [RUN_DIR ...]: a second run, overlaid
            return [part for arg in args for part in ({"[RUN_DIR": ["runs/first"], "...]": []}.get(arg, [arg]))]
        return args

    def launch(self, world: int, runs: list[tuple[str, dict[str, Any]]]) -> None:
        from tests.launch_pool import launch_harness

        try:
            launch_harness(self.out, world, [run for _, run in runs])
        except AssertionError as error:  # the launch failed: every command in it reports it
            for text, _ in runs:
                self.outcomes[text].error = f"the {world}-process launch failed: {str(error)[-3000:]}"
            return
        log = (self.out / f"np{world}" / "train.log").read_text()
        for text, _ in runs:
            self.outcomes[text].code = 0
            self.outcomes[text].out = log
            self.record(self.outcomes[text])

    def read_pooled(self, world: int) -> None:
        failed = POOL.wait(world, "readme_runs")
        for outcome in self.outcomes.values():
            if pooled(outcome.plan) and outcome.plan.world == world:
                # this process's launch directory (the sequence's process named its own)
                run_dir = POOL.directory("readme_runs") / f"np{world}" / outcome.run_dirs[0].name
                outcome.run_dirs = [run_dir]
                if run_dir.name in failed:
                    outcome.error = f"the {world}-process launch failed: {failed[run_dir.name][-3000:]}"
                    continue
                outcome.code = 0
                outcome.out = (run_dir / "train.log").read_text()
                self.record(outcome)


def text_key(args: list[str]) -> str | None:
    return args[args.index("--text-key") + 1] if "--text-key" in args else None


def write_documents(path: Path, key: str) -> None:
    """The README's paragraphs as a .jsonl.gz or a .parquet file: a few hundred documents, each of at least
    1,000 characters (paragraphs joined), so that whichever documents the prepare step's hash puts in the
    validation split hold more than one window of the tiny runs (a one-line paragraph would not)."""
    import gzip

    docs, current = [], ""
    for paragraph in [p for p in README.read_text().split("\n\n") if p.strip()] * 4:
        current += paragraph + "\n\n"
        if len(current) >= 1000:
            docs.append(current)
            current = ""
    if path.name.endswith(".jsonl.gz"):
        path.write_bytes(gzip.compress("".join(json.dumps({key: d}) + "\n" for d in docs).encode()))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({key: docs}), path)


_register_pooled_runs()

# The README's sequence (its single-process commands in this module's Runner, in order, in one directory) is
# a process of its own, started with the shared launches: it runs beside the other tests instead of inside
# this module's first one. It writes its outcomes to RESULT; the multi-process commands are read here.
SEQUENCE = POOL.jobs_root / "readme_runs"
RESULT = SEQUENCE / "outcomes.pkl"
POOL.add_job("readme_runs", [sys.executable, "-c", "from tests.test_readme_runs import run_sequence; run_sequence()",
                             str(SEQUENCE)])


def run_sequence() -> None:
    """The job: `python -c ... DIR` runs the README's commands in DIR/cwd (launches in DIR/harness)."""
    import pickle

    root = Path(sys.argv[1])
    shutil.rmtree(root, ignore_errors=True)
    (root / "cwd").mkdir(parents=True)
    outcomes = Runner(root / "cwd", root / "harness").run_sequence(readme_commands(), plans())
    (root / "outcomes.pkl").write_bytes(pickle.dumps(outcomes))


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    import pickle

    code, output = POOL.job("readme_runs")
    assert code == 0 and RESULT.exists(), f"the README's sequence (tests/test_readme_runs.py) failed:\n{output}"
    runner = Runner(SEQUENCE / "cwd", SEQUENCE / "harness")
    runner.outcomes = pickle.loads(RESULT.read_bytes())
    return runner.read_all_pooled()


# ---- checks ----------------------------------------------------------------------------------------------
def snapshot(run_dir: Path) -> dict[str, Any]:
    """The files of a run directory, the summary, status, train.log and the steps metrics.csv logged."""
    files = {path.name for path in run_dir.iterdir()} if run_dir.is_dir() else set()

    def text(name: str) -> str:
        return (run_dir / name).read_text() if name in files else ""

    steps: list[int] = []
    if "metrics.csv" in files:
        with open(run_dir / "metrics.csv") as f:
            steps = sorted({int(float(row["step"])) for row in csv.DictReader(f) if row.get("train_loss")})
    return {"dir": run_dir, "files": files, "summary": json.loads(text("summary.json") or "null"),
            "status": json.loads(text("status.json") or "null"), "log": text("train.log"), "steps": steps}


def check_run(outcome: Outcome, run: dict[str, Any], world: int) -> None:
    """Finished: the summary's steps and world size, finite losses, the files every run writes."""
    summary = run["summary"]
    assert summary is not None, f"no summary.json in {run['dir']}: {sorted(run['files'])}"
    assert summary["steps"] == outcome.steps and summary["world_size"] == world, summary
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["final_val_loss"])
    assert {"config.yaml", "metrics.csv"} <= run["files"]
    log = outcome.out + run["log"]
    if outcome.resumed_from is None:
        assert run["steps"][0] == 1, run["steps"]
    else:  # it went on from the checkpoint, which was saved at step 2
        path = "" if outcome.resumed_from == "auto" else outcome.resumed_from
        assert re.search(rf"resumed from \S*{re.escape(path)} at step {STEPS}\b", log), log[-3000:]
        assert run["steps"][-1] == outcome.steps, run["steps"]
    init_from = value_of(outcome.plan.args, "init_from")
    if init_from is not None:
        assert f"initialized the weights from {init_from.rstrip('/')}" in log, log[-3000:]


def sweep_jobs(plan: Plan) -> int:
    trials = value_of(plan.args, "hydra.sweeper.n_trials")
    if trials is not None:
        return int(trials)
    lists = [value_of(plan.args, arg.split("=", 1)[0]) for arg in plan.args if "," in arg and "=" in arg]
    return math.prod(len(value.split(",")) for value in lists if value and not value.startswith("["))


def test_readme_has_commands() -> None:
    assert len(readme_commands()) >= 50


def test_every_readme_command_has_a_tiny_run() -> None:
    """plan_of places every README command (a new command fails here until it runs somewhere), and the
    commands not run here are exactly NOT_RUN's."""
    all_plans = plans()  # raises for a command it cannot place
    assert set(all_plans) == {command.text for command in readme_commands()}
    for text in [*NOT_RUN, *ELSEWHERE]:  # no stale entries
        assert text in all_plans, f"{text!r} is not in the README any more"
    assert {text for text, plan in all_plans.items() if plan.how == "not_run"} == set(NOT_RUN)
    assert {plan.how for plan in all_plans.values()} == {"in_process", "harness", "subprocess", "elsewhere",
                                                         "not_run"}


@pytest.mark.slow
@pytest.mark.parametrize("text", [command.text for command in readme_commands()])
def test_readme_command_runs(outcomes: dict[str, Outcome], text: str) -> None:
    outcome = outcomes[text]
    plan = outcome.plan
    if plan.how == "not_run":
        pytest.skip(plan.reason)
    if plan.how == "elsewhere":
        node, markers = ELSEWHERE[text]
        path, _, function = node.partition("::")
        source = (REPO / path).read_text()
        assert f"def {function}(" in source, f"{node} does not exist any more"
        for marker in markers:
            assert marker in source, f"{node} no longer uses {marker}"
        return
    assert outcome.error is None, outcome.error
    detail = f"{plan.how} {plan.program} {plan.args} {plan.notes}\n{outcome.out[-4000:]}"
    assert not outcome.created, (sorted(outcome.created), detail)
    if plan.kind == "error":  # exit status 2 and one line, the one the README shows
        (command,) = [c for c in readme_commands() if c.text == text]
        assert command.expected is not None
        assert outcome.code == 2, detail
        (line,) = outcome.out.strip().splitlines()
        expected = command.expected.removesuffix("...").rstrip()
        assert line.startswith(expected) if command.expected.endswith("...") else line == expected, detail
        return
    if plan.kind == "plan":  # the report; 3 is the documented status of a config that does not fit
        assert outcome.code in (0, 3), detail
        if value_of(plan.args, "plan.format") == "json":
            report = json.loads(outcome.out.strip().splitlines()[-1])
            assert report["fits"] == (outcome.code == 0), detail
        else:
            assert ("fits: yes" if outcome.code == 0 else "fits: NO") in outcome.out, detail
        if value_of(plan.args, "plan.search") == "true":  # ranked layouts, each with its command line
            assert "configurations that fit" in outcome.out, detail
            assert re.search(r"^\s+python -m trainer ", outcome.out, re.MULTILINE), detail
        return
    assert outcome.code == 0, detail
    if plan.kind == "check":  # a row of latency and bandwidth per parallel dimension of the mesh
        assert "GB/s (bus)" in outcome.out, detail
        rows = re.findall(r"^(\w+) +(\d+) +([\d.]+) +([\d.]+) +([\d.]+) ", outcome.out, re.MULTILINE)
        assert {row[0] for row in rows} == set(expected_check_groups(plan.args)), detail
        assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in rows), detail
        return
    if plan.kind == "cfg":  # the composed config, and nothing run
        config = yaml.safe_load(outcome.out)
        assert {"model", "trainer", "strategy"} <= set(config), detail
        return
    if plan.kind == "tool":
        check_tool(plan.program[0], outcome)
        return
    if plan.kind == "sweep":
        (sweep,) = outcome.run_dirs
        assert len(outcome.runs) == sweep_jobs(plan), ([run["dir"] for run in outcome.runs], detail)
        for job in outcome.runs:
            assert job["status"]["status"] == "ok", (job["status"], detail)
            check_run(outcome, job, world=1)
        assert (sweep / "summary.csv").exists(), detail
        return
    (run,) = outcome.runs
    check_run(outcome, run, plan.world)
    if plan.how != "harness":  # the CLI's own bookkeeping: status.json, and the summary's path printed
        assert run["status"]["status"] == "ok", (run["status"], detail)
        printed = re.findall(r"summary: (\S+summary\.json)", outcome.out)
        assert [Path(path).resolve() for path in printed] == [(run["dir"] / "summary.json").resolve()], detail


def expected_check_groups(args: list[str]) -> list[str]:
    """The mesh dimensions of size > 1 a `mode=check` command measures (3d: pp, tp, the rest data parallel)."""
    world = int(value_of(args, "trainer.devices") or 1)
    sizes = {"pp": int(value_of(args, "pp") or 1), "tp": int(value_of(args, "tp") or 1)}
    sizes["dp_shard"] = world // (sizes["pp"] * sizes["tp"])  # 3d's default data_parallel is FSDP-style
    return [name for name, size in sizes.items() if size > 1]


def check_tool(module: str, outcome: Outcome) -> None:
    """Each tool's own result, found where the command put it (the shared working directory)."""
    (cwd,) = outcome.run_dirs
    detail = f"{outcome.plan.args}\n{outcome.out[-3000:]}"
    printed = outcome.out.strip().splitlines()[-1]
    if module == "trainer.sweep":  # the table of the sweep before it, every job ok
        assert printed.startswith("written: "), detail
        table = cwd / printed.removeprefix("written: ")
        with open(table) as f:
            rows = list(csv.DictReader(f))
        jobs = [job for job in table.parent.iterdir() if job.is_dir() and job.name.isdigit()]
        assert len(rows) == len(jobs) > 1 and {row["status"] for row in rows} == {"ok"}, rows
    elif module == "trainer.plot":  # the quick start's run and runs/first, overlaid
        assert printed.startswith("2 run(s) plotted: "), detail
        png = cwd / printed.removeprefix("2 run(s) plotted: ")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", detail
    elif module == "trainer.checkpoint.hf":
        assert {"config.json", "model.safetensors"} <= {p.name for p in (cwd / printed).iterdir()}, detail
    elif module == "trainer.data.prepare":
        output = outcome.plan.args[outcome.plan.args.index("--output") + 1]
        output = "tokens" if output == "DIR" else output
        assert {"train.bin", "val.bin", "train.offsets.bin", "val.offsets.bin", "meta.json"} <= {
            p.name for p in (cwd / output).iterdir()}, detail
        assert " bytes/token" in outcome.out, detail  # the per-input report
    else:
        raise AssertionError(f"no check for {module}")
