"""The typed schema of a run: the top-level `Config` and its non-group sections.

Hydra composes conf/config.yaml + overrides onto `Config` (stored in the ConfigStore as `config_schema`),
so an unknown key or a wrong type fails at composition. The defaults of every top-level value and of
`trainer.*`, `sweep.*` and `plan.*` live here and only here (conf/config.yaml does not repeat them); the
group nodes (`model`, `strategy`, ...) are typed by their own family's schemas (trainer/config/registry.py).

Core modules (the training loop) import `TrainerConfig` from this module, so it imports nothing from
trainer.plugins and nothing heavy: only dataclasses and omegaconf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

# Allowed values of the string options below (checked by trainer/config/validation.py).
MODES = ("train", "plan", "check")
PLAN_FORMATS = ("table", "json")
ACCELERATORS = ("auto", "cpu", "cuda")


@dataclass
class TrainerConfig:
    """Options of the training loop (`trainer.*`)."""

    # Stop after this many optimizer steps (None: only max_tokens decides).
    max_steps: Optional[int] = 200
    # Stop once this many tokens were consumed (None: only max_steps decides); the earlier limit wins.
    max_tokens: Optional[int] = None
    # Seed of weights, data order and dropout: the same seed and config give the same run.
    seed: int = 1337
    # Processes per node (one per GPU, or CPU workers with gloo).
    devices: int = 1
    # Number of nodes; world size = devices * num_nodes.
    num_nodes: int = 1
    # Sequences per forward pass on one rank.
    micro_batch_size: int = 8
    # Sequences per optimizer step over all data-parallel ranks
    # (= micro_batch_size x accumulation steps x data-parallel size).
    global_batch_size: int = 16
    # Tokens per sequence.
    seq_len: int = 256
    # Validate every N optimizer steps (0: only at the end).
    val_every: int = 100
    # Global batches of validation data at each evaluation (the same sequences for every strategy).
    val_batches: int = 4
    # Write metrics every N optimizer steps.
    log_every: int = 10
    # Steps of warm-up that summary.json's tokens_per_s and mfu leave out (compilation, the allocator's
    # growth): the first N steps of the run and the rest of the logging interval they end in, as the clock
    # is only read, after waiting for the device, at logged steps. A run too short for a later logged step
    # reports the whole run (summary.json: throughput_window). 0: the whole run.
    throughput_warmup_steps: int = 2
    # Clip the global gradient norm to this value (0 disables clipping; the norm is logged anyway).
    grad_clip: float = 1.0
    # A step whose global gradient norm is NaN or Inf (a NaN or Inf loss gives one) is never applied; after
    # this many such steps in a row the run stops as diverged (exit status 4, status.json `diverged`).
    # 0: never stop (the steps are still skipped). With fp16's loss scaler, overflowing gradients are the
    # scaler's routine skips and are not counted.
    max_nonfinite_steps: int = 3
    # torch.compile each transformer block.
    compile: bool = False
    # auto (CUDA if present, else CPU), cpu or cuda.
    accelerator: str = "auto"
    # Intra-op threads per process (None: PyTorch's default, cores / local processes when launched).
    num_threads: Optional[int] = None
    # Peak FLOP/s of one device for MFU (None: from the GPU model, or a measured matmul peak on CPU).
    peak_flops: Optional[float] = None
    # Multi-node runs started by `python -m trainer` on each node (not torchrun/srun): host:port of the
    # rendezvous (node 0's address) and an id shared by the nodes of one job.
    rdzv_endpoint: Optional[str] = None
    rdzv_id: str = "trainer"
    # Restart all workers this many times when one fails (0: the job ends with the failing rank's error).
    max_restarts: int = 0
    # Before any weight is materialized, compare the planner's estimate of this node's host memory and
    # each rank's device memory with what the machine has free; when it does not fit, stop with one
    # line (needed vs available, the planner's suggestions) and exit status 3. false skips the check.
    preflight: bool = True
    # Save a checkpoint of the final state (weights and everything a resume needs) into the run's
    # checkpoint directory when training ends; periodic saves stay opt-in (callbacks=[default,checkpoint]).
    save_final: bool = True
    # Preemption (trainer/preemption.py): these signals (a scheduler's notice, Ctrl-C; names or numbers)
    # make every rank stop at the next step boundary, save a checkpoint (the checkpoint manager's when it is
    # configured, else into <run dir>/checkpoints), flush the metrics, write status.json `preempted` and exit
    # with status 75 (EX_TEMPFAIL), whatever the callbacks are; resume=auto then continues exactly. The same
    # signal again within 2 s is the same notice; later, a second one acts as usual. [] watches none.
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    # Hang watchdog (trainer/hang.py): when no training step, validation or checkpoint save completes within
    # this many seconds, every rank writes its stacks and last collectives to <run dir>/hang/rank_R.txt and
    # the job ends with a diagnosis and exit status 1 (max_restarts then restarts it). 0 turns it off.
    hang_timeout_s: float = 600.0
    # The first step of a process (start-up, compilation, a resumed load) may take this many timeouts ...
    hang_first_step_factor: float = 5.0
    # ... and a checkpoint save this many.
    hang_save_factor: float = 3.0
    # Keep torch's flight recorder on (the last collectives of each rank, for the diagnosis and the
    # straggler report; benchmarks/hang_watchdog_overhead.py measures its cost).
    record_collectives: bool = True
    # A rank whose compute time per step is above the median by this fraction for straggler_steps
    # consecutive steps is named as a straggler (a warning and the metric straggler_rank); 0 turns it off.
    straggler_margin: float = 0.5
    straggler_steps: int = 5
    # The share of the training time the straggler report may take. A report reads every rank's flight
    # recorder and gathers the ranks' step times (tens of milliseconds at the recorder's 2,000 records): it
    # runs at a log step once the steps since the previous one have taken at least its cost divided by this
    # share (0.01: reports at most 1% of the time), and at the last step. The steps in between are kept and
    # judged at the next report: a straggler is named later, not missed. 0: a report at every log step.
    straggler_overhead: float = 0.01


@dataclass
class SweepConfig:
    """Options of the jobs of a multirun sweep (`sweep.*`; they apply to single runs too)."""

    # Before starting any worker, ask the planner whether the job fits in memory; a job that does not
    # is not run and is recorded as `skipped_unfit` in its status.json (see trainer/sweep.py).
    skip_unfit: bool = False
    # The fit check: a function config -> plan with a boolean `.fits` (the project's planner by default).
    planner: str = "trainer.planner.plan"


@dataclass
class PlanConfig:
    """Options of `mode=plan` (`plan.*`): memory, communication, time and fit of the composed config on the
    `hardware` group's machine, without running it (trainer/planner, docs/ARCHITECTURE.md)."""

    # table (a human report) or json (the report, then one JSON object as the last line of output).
    format: str = "table"
    # Also build the real model on the meta device under a fake process group and count the analysed
    # rank's parameter, gradient and optimizer bytes exactly (shown beside the analytic figures).
    exact: bool = True
    # Global rank to analyse (null: the rank with the highest device-memory estimate).
    rank: Optional[int] = None
    # Enumerate dp, tp, pp, ZeRO stage / FSDP mode, checkpointing policy, schedule and micro-batch for the
    # world size and hardware, keep what fits, rank by estimated throughput (always done when the
    # configuration does not fit).
    search: bool = False
    # Suggestions printed by the search.
    top: int = 5
    # Fraction of usable device (and host) memory kept free for allocator fragmentation and what the
    # estimate leaves out.
    headroom: float = 0.1
    # Fraction of the peak FLOP/s the model's matmuls reach (step time, tokens/s, MFU estimates).
    matmul_efficiency: float = 0.6
    # Fraction of the peak the attention core (QK^T, softmax, x V: SDPA's fused kernel) reaches, counted in
    # the FLOPs it really runs (about half the model-FLOPs convention's when causal); null: matmul_efficiency.
    # Small head dims run it far below the matmuls (a CPU's flash kernel at head_dim 32: about 30%).
    attention_efficiency: Optional[float] = None
    # Write a memory-breakdown bar chart (PNG) to this path (null: no chart).
    chart: Optional[str] = None
    # Check the plan against this machine (trainer/planner/calibrate.py): train the configuration for
    # calibrate_warmup + calibrate_steps steps on its processes, measure each process's matmul FLOP/s and
    # memory bandwidth and each process group's latency and bandwidth, predict the configuration on a
    # hardware profile of those figures, and print predicted vs measured step time, tokens/s and peak memory
    # (also calibration.json in the run directory).
    calibrate: bool = False
    # Steps timed (the median counts) and steps run before them (at least 2: the first creates the
    # optimizer states, the second reaches the peak memory, which is recorded during the warm-up).
    calibrate_steps: int = 8
    calibrate_warmup: int = 2
    # MiB of the collectives that measure each group's bandwidth (a 2-element one measures latency).
    calibrate_message_mb: float = 8.0
    # Also write the calibrated profile as a hardware YAML file here (in conf/hardware/NAME.yaml it is
    # `hardware=NAME`; null: not written).
    calibrate_save: Optional[str] = None
    # strategy=auto (trainer/planner/auto.py): measure the K best predicted layouts for trial_steps steps each
    # (after trial_warmup) on the run's own processes and run the fastest measured (0: run the best predicted).
    trials: int = 0
    trial_steps: int = 3
    trial_warmup: int = 2
    # strategy=auto on this machine ranks layouts on its calibrated profile (measured once per machine, torch
    # version and process count by a short calibration run, then cached; a plan.calibrate run also caches
    # its profile); false: on the `hardware` group's figures with this machine's memory.
    auto_calibrate: bool = True
    # Where calibrated profiles are cached (null: $TRAINER_CACHE_DIR/profiles, else ~/.cache/trainer/profiles).
    profile_dir: Optional[str] = None


@dataclass
class CheckConfig:
    """Options of `mode=check` (`check.*`): a bandwidth and latency test of each parallel dimension's
    process group on the run's mesh (trainer/commcheck.py)."""

    # Bytes of the all-reduce that measures bandwidth (MiB), and repetitions of each measurement.
    size_mb: float = 16.0
    iters: int = 5


@dataclass
class Config:
    """The whole run. Group nodes are typed by their own `<option>_schema`."""

    model: Any = MISSING
    data: Any = MISSING
    strategy: Any = MISSING
    precision: Any = MISSING
    activation_checkpointing: Any = MISSING
    optimizer: Any = MISSING
    lr_schedule: Any = MISSING
    # Named loggers (csv is always added); e.g. `logger=[csv,wandb]`.
    logger: dict[str, Any] = field(default_factory=dict)
    # Named callbacks; add your own with `+callbacks.NAME._target_=pkg.Class`.
    callbacks: dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    # The machine `mode=plan` plans for (conf/hardware/*.yaml); a run ignores it.
    hardware: Any = MISSING
    # What to do: `train`, `plan` (print the memory/time/fit report, exit 3 when it does not fit), or `check`
    # (bandwidth and latency of each parallel dimension's group on the run's processes, then exit).
    mode: str = "train"
    # Parallel sizes (shortcuts): data parallel (`auto`: the world size / (tp x pp x cp)), tensor parallel,
    # pipeline parallel, context parallel. A value above 1 needs a strategy that uses it (ddp/zero*/fsdp
    # for dp, tp, pp, 3d; cp works with every multi-process strategy). dp x tp x pp x cp = world size.
    dp: Any = "auto"
    tp: int = 1
    pp: int = 1
    # Context parallelism: each sequence split over cp ranks (they read the same samples, each its part
    # of every sequence), attention computed across them (trainer/models/context_parallel.py).
    cp: int = 1
    # How attention crosses the cp ranks: `ring` (K/V blocks passed round the ring, causal load balancing:
    # trainer.seq_len must divide by 2 x cp) or `all_to_all` (DeepSpeed-Ulysses: sequence shards <-> head
    # groups; n_heads / tp must divide by cp, trainer.seq_len by cp).
    cp_method: str = "ring"
    # Expert parallelism: the experts of every MoE layer (model.n_experts > 0) split over ep ranks borrowed
    # from the data-parallel ones (ep divides dp x cp and model.n_experts), tokens exchanged by all-to-all.
    ep: int = 1
    # Where the run starts: auto (the latest complete checkpoint in the run's checkpoint directory, a
    # fresh start if there is none), none, or the path of a checkpoint or of a directory of checkpoints.
    resume: str = "auto"
    # Start a new run (step 0, fresh optimizer) from these weights: a checkpoint or a Hugging Face Llama
    # directory (config.json + *.safetensors); null: initialize from the seed.
    init_from: Optional[str] = None
    # What `strategy=auto` chose (written by the run, not set by hand: the concrete layout's overrides, the
    # runner-up, the reason, predicted and measured step times, the profile). A later run of the same command
    # in the same run directory reads it from config.yaml and runs that layout without searching.
    auto: Optional[Any] = None
