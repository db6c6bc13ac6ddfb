"""Our ZeRO strategies against DeepSpeed's ZeRO on CPU: speed, memory and the state each rank holds.

For each stage k in 1, 2, 3: `strategy=zero{k}` of this trainer (zero1: DDP + optimizer states sharded
over the ranks; zero2: textbook ZeRO-2, gradients reduce-scattered once per step into each rank's rows;
zero3: FSDP2 full_shard) against DeepSpeed ZeRO stage k,
2 gloo processes on CPU, fp32, the same model (the default `tiny` config, or whatever the trailing
Hydra overrides make of it), the same batches (each rank reads its slice of every global batch from
`trainer.run.build_data(cfg, vocab, dp_rank, dp_size)`), the same initial weights (seed), the same
torch AdamW and parameter groups (no weight decay for tensors with ndim < 2 and embedding tables), the
same warmup + cosine LR schedule, gradient accumulation and gradient clipping.

DeepSpeed side: `DS_ACCELERATOR=cpu`, `deepspeed.init_distributed(dist_backend="gloo")` (which adopts
the gloo group the worker made), a config with `train_micro_batch_size_per_gpu`,
`gradient_accumulation_steps`, `gradient_clipping` and `zero_optimization.stage`, no fp16/bf16 (fp32),
and the torch AdamW passed as the client optimizer (DeepSpeed's fused optimizers need compiled ops;
`zero_allow_untested_optimizer` lets ZeRO wrap a torch optimizer). Its gradient buckets are set to
`--bucket-mb` (default 25 MB, DDP's and our zero1's bucket size) instead of DeepSpeed's 2 GB default,
and `stage3_param_persistence_threshold` to `--ds-persistence-threshold` (default 0: every parameter is
partitioned, as our zero3 does; DeepSpeed's default 1e5 would keep most of the tiny model's matrices
whole on every rank). Its LR schedule is the same multiplier in a `LambdaLR`, stepped by the engine.

Each measurement is one FRESH `torchrun --nproc-per-node 2` launch running one engine for one stage,
so that memory figures of one engine do not leak into the other's (a process's peak resident set is
monotone). Launches alternate ours / DeepSpeed for every stage, `--repeats` times, in ABBA order (ours
first in even repeats, DeepSpeed first in odd ones; an even `--repeats` balances it), so that drifts in
machine speed hit both alike; a first short launch measures the matmul peak of one process (for MFU)
with both ranks busy, as in training.

What is reported, per stage and side:
- tokens/s: median over the launches of global tokens (all ranks) per second over the steps after
  `--warmup`, timed by the slowest rank; ratio = ours / DeepSpeed. MFU against the matmul peak of one
  process x the world size.
- peak_rss_growth_bytes_per_rank: for each rank, how far its resident set rose above its size just
  before the model, optimizer, engine and data were built, at its highest point until the timed steps
  ended (the kernel's high-water mark VmHWM, reset through /proc/self/clear_refs at that moment). It
  counts everything the run touched: weights, gradients, optimizer states, DeepSpeed's extra fp32
  copies and buckets, activations, communication buffers, the token data, and heap pages the allocator
  kept; it is an RSS figure, not a tensor count (median over the launches). Where the high-water mark
  cannot be reset the figure falls back to the process peak minus the start size, and says so.
- state_bytes_per_rank: bytes of training state each rank holds.
  Ours: `trainer.state_bytes` (local shards of parameters, gradients and optimizer states, by element
  count, taken after the first optimizer step while gradients exist).
  DeepSpeed: distinct tensor storages (allocated bytes, so flat buffers count whole) reachable from the
  model's parameters and from its ZeRO optimizer's attributes, sorted by where they hang: `optimizer`
  = the torch optimizer's state tensors (exp_avg, exp_avg_sq), `grads` = `.grad` tensors and
  attributes named *grad* (averaged/partitioned gradient buffers), `master_params` = the fp32 partitions
  the optimizer steps (DeepSpeed keeps this copy besides the model weights even in fp32), `params` = the
  model weights (full flat buffer in stages 1-2, the `ds_tensor` partitions in stage 3), `buckets` =
  the gradient reduce buckets (allocated at `--bucket-mb` whatever the model size; only the part the
  gradients fill is ever touched; ours has no separate figure: DDP's gradients are views of its
  buckets and count as grads), `other` = anything else. Taken after every micro-batch backward of the
  second step (before its optimizer step, so states exist and gradients are held; the time spent
  counting is taken off the clock) and the largest value of each kind is kept; scalars are left out on
  both sides. Transient tensors (stage-3 gathered parameters, activations) are not in this count; the
  RSS figure covers them.

    python benchmarks/zero_vs_deepspeed.py          # tiny model, 3 stages x 2 sides x 3 repeats; ~15 min
    python benchmarks/zero_vs_deepspeed.py --steps 3 --warmup 1 --repeats 1 \\
        model.dim=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.ffn_hidden_dim=128 \\
        trainer.seq_len=64 data.max_bytes=1000000    # smoke test, ~2 min

`--ours-variant LABEL:OVERRIDE[,OVERRIDE...]` (repeatable) adds our strategy with other settings as one
more side, alternated with the rest, each reported against DeepSpeed (the zero3 tuning of issue 18):

    python benchmarks/zero_vs_deepspeed.py --stages 3 --ours-variant prefetch2:strategy.prefetch_blocks=2 \
        --ours-variant per_step:strategy.grad_sync=step,strategy.reshard_after_backward=false

DeepSpeed is optional (`DS_BUILD_OPS=0 pip install deepspeed`): without it, or when it fails to run
here, our side is still measured and the JSON says why DeepSpeed is missing. The last line printed is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import StepClock  # noqa: E402

from trainer.config import compose, total_steps  # noqa: E402
from trainer.hardware import measure_matmul_flops  # noqa: E402
from trainer.models import build_meta_model, build_model  # noqa: E402
from trainer.models.common import CausalLM  # noqa: E402
from trainer.run import build_data, build_trainer  # noqa: E402

STATE_KINDS = ("params", "grads", "optimizer", "master_params", "buckets", "other")


# ---- measurement helpers (worker side) ----------------------------------------------------------------


def _proc_status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise OSError(f"{field} not in /proc/self/status")
    return int(match.group(1))


class RssWindow:
    """Peak growth of this process's resident set between start() and stop().

    Linux resets the high-water mark VmHWM to the current RSS when "5" is written to
    /proc/self/clear_refs, which isolates the window from whatever the imports and setup peaked at.
    Elsewhere the process-wide peak (ru_maxrss) minus the start size is the best available figure.
    """

    def start(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.start_bytes = _proc_status_kib("VmRSS") * 1024
            self.reset = True
        except OSError:
            self.start_bytes = 0
            self.reset = False

    def stop(self) -> dict[str, Any]:
        if self.reset:
            peak = _proc_status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"rss_at_start": self.start_bytes, "peak_rss": peak,
                "peak_rss_growth": peak - self.start_bytes, "high_water_mark_reset": self.reset}


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay the matrices of linear maps only: not vectors (norm gains, biases) nor embedding tables."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay = [], []
    for param in model.parameters():
        if param.ndim < 2 or id(param) in embedding_params:
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(steps: int, warmup_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then half a cosine down to min_ratio at the last step."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps + 1) / max(1, steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(progress * math.pi))

    return multiplier


@contextlib.contextmanager
def shared_run_dir() -> Iterator[Path]:
    """One temporary run directory for all ranks (rank 0 creates and removes it)."""
    path = [tempfile.mkdtemp(prefix="zero_bench_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    try:
        yield Path(path[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


# ---- DeepSpeed state accounting -------------------------------------------------------------------------
def _kind_of(path: str) -> str:
    lowered = path.lower()
    if "optimizer.state" in lowered:
        return "optimizer"
    if "ipg" in lowered or "bucket" in lowered:  # gradient reduce buckets (ipg_buckets[...].buffer)
        return "buckets"
    if "grad" in lowered:  # .grad of anything, averaged_gradients, grad_partitions_flat_buffer...
        return "grads"
    if "fp32" in lowered:  # single_partition_of_fp32_groups, fp32_partitioned_groups_flat
        return "master_params"
    if lowered.startswith("module.") or "bit16" in lowered or "fp16" in lowered or "ds_tensor" in lowered:
        return "params"
    return "other"


def _reachable_tensors(obj: Any, path: str, out: list[tuple[str, torch.Tensor]], seen: set[int],
                       depth: int) -> None:
    """(path, tensor) pairs reachable through containers and plain objects' attributes, depth-limited.

    Modules are not entered (their parameters are walked separately), which keeps the walk to the
    optimizer's own bookkeeping.
    """
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        for extra in ("grad", "ds_tensor"):  # a parameter's gradient; stage 3's local partition
            value = getattr(obj, extra, None)
            if isinstance(value, torch.Tensor):
                _reachable_tensors(value, f"{path}.{extra}", out, seen, depth + 1)
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            name = "[tensor]" if isinstance(key, torch.Tensor) else f"[{key!r}]"
            _reachable_tensors(value, path + name, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _reachable_tensors(value, f"{path}[{index}]", out, seen, depth + 1)
    elif isinstance(obj, torch.optim.Optimizer):
        _reachable_tensors(obj.state, f"{path}.state", out, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)) and depth <= 3:
        for key, value in vars(obj).items():
            _reachable_tensors(value, f"{path}.{key}", out, seen, depth + 1)


def deepspeed_state_bytes(model: nn.Module, zero_optimizer: Any) -> dict[str, int]:
    """Allocated bytes of distinct storages this rank holds, by kind (see the module docstring)."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, param in model.named_parameters():
        _reachable_tensors(param, f"module.{name}", found, seen, 0)
    _reachable_tensors(zero_optimizer, "zero", found, seen, 0)
    # a storage reached under several names counts once, under the first kind of this list
    priority = {kind: index for index, kind in enumerate(("optimizer", "grads", "master_params", "params",
                                                          "buckets", "other"))}
    storages: dict[int, tuple[str, int]] = {}
    for path, tensor in found:
        if tensor.dim() == 0 or tensor.device.type == "meta":  # bookkeeping scalars; nothing allocated
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:  # stage 3's released full parameters
            continue
        kind = _kind_of(path)
        key = storage.data_ptr()
        if key not in storages or priority[kind] < priority[storages[key][0]]:
            storages[key] = (kind, storage.nbytes())
    totals = {kind: 0 for kind in STATE_KINDS}
    for kind, nbytes in storages.values():
        totals[kind] += nbytes
    return totals


# ---- the two sides (one per launch) -------------------------------------------------------------------
def common_overrides(args: argparse.Namespace, threads: int) -> list[str]:
    n = args.steps + args.warmup
    return list(args.overrides) + [
        f"trainer.max_steps={n}", "trainer.val_every=0", "trainer.val_batches=1", "callbacks=none",
        f"trainer.micro_batch_size={args.micro_batch_size}", f"trainer.num_threads={threads}",
        "lr_schedule.warmup_steps=1",
    ]


def ours_overrides(args: argparse.Namespace, threads: int) -> list[str]:
    return common_overrides(args, threads) + [
        f"strategy=zero{args.stage}", f"trainer.devices={dist.get_world_size()}",
        *json.loads(args.ours_overrides or "[]"),
        # given, so the trainer does not run its matmul measurement inside the memory window
        f"trainer.peak_flops={args.peak_flops}",
    ]


def run_ours(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    clock = StepClock()
    window = RssWindow()
    with shared_run_dir() as run_dir:
        window.start()
        trainer = build_trainer(compose(ours_overrides(args, threads)), run_dir)
        trainer.callbacks.append(clock)
        trainer.fit()
        memory = window.stop()
        result = {
            "times": clock.times,
            "state_bytes": dict(trainer.state_bytes or {}),
            "final_train_loss": trainer.last_train_loss,
            "final_lr": trainer.optimizer.param_groups[0]["lr"],
            "threads": torch.get_num_threads(),
            **memory,
        }
    return result


def build_deepspeed(args: argparse.Namespace, threads: int, window: RssWindow | None = None) -> dict[str, Any]:
    """DeepSpeed's side: the engine for ZeRO stage `args.stage` over the same model, optimizer, schedule and
    batches as ours (see the module docstring), with what a step needs. `window` starts just before the model
    is built (after DeepSpeed's import and initialization, as ours starts before `build_trainer`)."""
    import logging

    import deepspeed  # optional dependency: imported only by the DeepSpeed launches

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group made by the worker
    torch.set_num_threads(threads)  # whatever DeepSpeed's CPU accelerator did, use ours
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = compose(common_overrides(args, threads))
    t = cfg.trainer
    accumulation = t.global_batch_size // (t.micro_batch_size * world)
    bucket_elements = int(args.bucket_mb * 2**20) // 4 // 2 * 2  # fp32 elements, even (alignment)
    ds_config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {
            "stage": args.stage,
            "reduce_bucket_size": bucket_elements,
            "allgather_bucket_size": bucket_elements,
            "stage3_param_persistence_threshold": args.ds_persistence_threshold,
        },
        "zero_allow_untested_optimizer": True,  # a torch AdamW, not DeepSpeed's (compiled) ones
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    steps = total_steps(cfg)
    schedule = warmup_cosine(steps, cfg.lr_schedule.warmup_steps, cfg.lr_schedule.min_ratio)
    if window is not None:
        window.start()
    torch.manual_seed(t.seed)  # the trainer's init: same seed, same draws, same weights
    model = build_model(cfg.model)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(weight_decay_groups(model, opt.weight_decay), lr=opt.lr,
                                  betas=tuple(opt.betas), eps=opt.eps)
    engine, zero_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        # called with the client optimizer, whose param groups ZeRO re-pointed at its fp32 partitions
        lr_scheduler=lambda client: torch.optim.lr_scheduler.LambdaLR(client, schedule),
    )
    loader, _ = build_data(cfg, cfg.model.vocab_size, dp_rank=rank, dp_size=world)
    return {"engine": engine, "zero_optimizer": zero_optimizer, "model": model, "loader": loader,
            "accumulation": accumulation, "steps": steps, "log_every": t.log_every,
            "version": deepspeed.__version__}


def deepspeed_microbatches(side: dict[str, Any], on_backward: Callable[[], None] = lambda: None) -> torch.Tensor:
    """One optimizer step of DeepSpeed's engine over the next global batch; the mean loss (not synced)."""
    engine, accumulation = side["engine"], side["accumulation"]
    total = torch.zeros(())
    for x, y in next(side["loader"]):
        logits = engine(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        on_backward()
        engine.step()  # steps optimizer and LR schedule only at the accumulation boundary
        total += loss.detach() / accumulation
    return total


def run_deepspeed(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    window = RssWindow()
    side = build_deepspeed(args, threads, window)
    steps, world = side["steps"], dist.get_world_size()
    inspect_step = min(1, steps - 1)  # the second step: optimizer states exist, gradients are held
    state = {kind: 0 for kind in STATE_KINDS}
    excluded = 0.0  # seconds spent counting state, taken off the clock
    final_loss = math.nan
    times = [time.perf_counter()]
    for step in range(steps):
        def count_state() -> None:
            nonlocal excluded
            if step == inspect_step:
                started = time.perf_counter()
                for kind, nbytes in deepspeed_state_bytes(side["model"], side["zero_optimizer"]).items():
                    state[kind] = max(state[kind], nbytes)
                excluded += time.perf_counter() - started

        total = deepspeed_microbatches(side, count_state)
        if (step + 1) % side["log_every"] == 0 or step + 1 == steps:  # the trainer's logging syncs
            dist.all_reduce(total)
            final_loss = total.item() / world
        times.append(time.perf_counter() - excluded)
    memory = window.stop()
    return {"times": times, "state_bytes": state, "final_train_loss": final_loss,
            "final_lr": side["engine"].get_lr()[0], "threads": torch.get_num_threads(),
            "deepspeed_version": side["version"], **memory}


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    threads = max(1, (os.cpu_count() or 1) // local_world)  # what DistributedStrategy picks by itself
    torch.set_num_threads(threads)
    if args.side == "peak":
        # every rank at once, so that each sees the cores shared as they are in training
        result: dict[str, Any] = {"peak_matmul_flops": measure_matmul_flops("cpu", torch.float32)}
    elif args.side.startswith("ours"):
        result = run_ours(args, threads)
    else:
        result = run_deepspeed(args, threads)
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, result)
    if rank == 0:
        Path(args.result).write_text(json.dumps(per_rank))
    dist.barrier()
    dist.destroy_process_group()


# ---- the parent: launches, aggregation, report ------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the clock starts")
    parser.add_argument("--repeats", type=int, default=3, help="launches of each side per stage (median)")
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages to compare")
    parser.add_argument("--nproc", type=int, default=2, help="processes (data-parallel ranks)")
    parser.add_argument("--micro-batch-size", type=int, default=4,
                        help="sequences per forward; 4 with 16-sequence global batches on 2 ranks gives "
                             "2 micro-batches per step (gradient accumulation)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DeepSpeed reduce/allgather bucket size")
    parser.add_argument("--ds-persistence-threshold", type=int, default=0,
                        help="DeepSpeed stage3_param_persistence_threshold (elements)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed to one launch")
    parser.add_argument("--ours-variant", action="append", default=[], metavar="LABEL:OVERRIDE[,OVERRIDE...]",
                        help="also run ours with these strategy overrides, alternating with the other sides "
                             "(e.g. 'prefetch2:strategy.prefetch_blocks=2'); repeatable")
    # worker-only arguments
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--ours-overrides", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--peak-flops", type=float, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to both sides (model.dim=64 ...)")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the flags


def launch(argv: list[str], args: argparse.Namespace, extra: list[str]) -> tuple[list[Any] | None, str]:
    """One fresh torchrun launch of this script's worker; (per-rank results, or None and the reason)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   str(Path(__file__).resolve()), "--worker", "--result", str(result_path), *extra, *argv]
        try:
            # Output kept out of ours (DeepSpeed is chatty); shown only when a launch fails.
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {args.timeout} s"
        if done.returncode != 0 or not result_path.exists():
            log = Path(tempfile.mkstemp(prefix="zero_vs_deepspeed_failed_", suffix=".log")[1])
            log.write_text(" ".join(command) + "\n" + done.stdout + done.stderr)
            return None, f"{_failure_reason(done.stdout + done.stderr, done.returncode)} (whole output: {log})"
        return json.loads(result_path.read_text()), ""


def _failure_reason(output: str, returncode: int) -> str:
    """The most telling line of a failed launch: a worker's exception, else the last lines.

    torchrun prefixes worker lines with `[rankN]:` and ends with its own ChildFailedError, which says
    only that a worker failed; the worker's exception line is the one that says why.
    """
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines
              if re.match(r"^[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line]
    if errors:
        return errors[-1][:500]
    return f"exit code {returncode}: " + " | ".join(lines[-5:])[:500]


def tokens_per_s(per_rank: list[dict[str, Any]], warmup: int, tokens_per_step: int) -> float:
    """Global tokens/s after the warm-up steps, timed by the slowest rank."""
    slowest, steps = 0.0, 0
    for result in per_rank:
        measured = result["times"][warmup:]
        slowest = max(slowest, measured[-1] - measured[0])
        steps = len(measured) - 1
    return steps * tokens_per_step / slowest


def per_rank_median(runs: list[list[dict[str, Any]]], key: str) -> list[float]:
    return [statistics.median(run[rank][key] for run in runs) for rank in range(len(runs[0]))]


def summarize(runs: list[list[dict[str, Any]]], warmup: int, tokens_per_step: int, flops_per_token: float,
              total_peak: float) -> dict[str, Any]:
    speeds = [tokens_per_s(run, warmup, tokens_per_step) for run in runs]
    median = statistics.median(speeds)
    last = runs[-1]
    return {
        "tokens_per_s": median,
        "mfu": median * flops_per_token / total_peak,
        "runs": speeds,
        "peak_rss_growth_bytes_per_rank": per_rank_median(runs, "peak_rss_growth"),
        "peak_rss_bytes_per_rank": per_rank_median(runs, "peak_rss"),
        "high_water_mark_reset": all(r["high_water_mark_reset"] for run in runs for r in run),
        "state_bytes_per_rank": [r["state_bytes"] for r in last],  # deterministic: one launch tells
        "final_train_loss": last[0]["final_train_loss"],
        "final_lr": last[0]["final_lr"],
        "threads_per_rank": last[0]["threads"],
    }


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """`LABEL:OVERRIDE[,OVERRIDE...]` -> {"ours:LABEL": [OVERRIDE, ...]}."""
    variants: dict[str, list[str]] = {}
    for spec in specs:
        label, sep, overrides = spec.partition(":")
        if not sep or not label or not overrides:
            raise SystemExit(f"--ours-variant wants LABEL:OVERRIDE[,OVERRIDE...], got {spec!r}")
        variants[f"ours:{label}"] = overrides.split(",")
    return variants


def deepspeed_installed() -> tuple[str | None, str | None]:
    """(version, reason it is unusable); the import itself is tried by the first DeepSpeed launch."""
    try:
        return metadata.version("deepspeed"), None
    except metadata.PackageNotFoundError:
        return None, "deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return

    stages = [int(s) for s in args.stages.split(",") if s]
    cfg = compose(common_overrides(args, 1))
    tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
    meta = cast(CausalLM, build_meta_model(cfg.model))  # shapes only: no memory
    flops_per_token = meta.flops_per_token(cfg.trainer.seq_len)
    ds_version, ds_reason = deepspeed_installed()

    peak_runs, reason = launch(argv, args, ["--side", "peak"])
    if peak_runs is None:  # nothing can run: still end with the one JSON line
        print(json.dumps({"error": f"could not start {args.nproc} gloo workers: {reason}"}), flush=True)
        raise SystemExit(1)
    peak_per_rank = [r["peak_matmul_flops"] for r in peak_runs]
    total_peak = peak_per_rank[0] * args.nproc  # one process's peak x the world size
    print(f"matmul peak per process {peak_per_rank[0] / 1e9:.1f} GFLOP/s", flush=True)

    variants = parse_variants(args.ours_variant)
    sides = ["ours", *variants, "deepspeed"]
    runs: dict[tuple[int, str], list[list[dict[str, Any]]]] = {(k, s): [] for k in stages for s in sides}
    # a (stage, side) that failed once is not launched again; other stages still are
    errors: dict[tuple[int, str], str] = {}
    for repeat in range(args.repeats):  # alternate sides (and stages), so drifts hit all alike
        for stage in stages:
            # ABBA: ours first in even repeats, DeepSpeed first in odd ones, so neither side always
            # follows the other's launch
            for side in (sides if repeat % 2 == 0 else sides[::-1]):
                if (side == "deepspeed" and ds_version is None) or (stage, side) in errors:
                    continue
                extra = ["--side", side, "--stage", str(stage), "--peak-flops", repr(peak_per_rank[0]),
                         "--ours-overrides", json.dumps(variants.get(side, []))]
                result, reason = launch(argv, args, extra)
                label = f"stage {stage} " + (f"{side} (zero{stage})" if side != "deepspeed" else "deepspeed")
                if result is None:
                    print(f"{label}: FAILED: {reason}", flush=True)
                    errors[(stage, side)] = reason
                    if side == "deepspeed" and ds_reason is None:
                        ds_reason = f"stage {stage}: {reason}"
                    continue
                runs[(stage, side)].append(result)
                speed = tokens_per_s(result, args.warmup, tokens_per_step)
                growth = ", ".join(mib(r["peak_rss_growth"]) for r in result)
                print(f"repeat {repeat + 1}/{args.repeats} {label}: {speed:,.0f} tok/s, "
                      f"peak RSS growth per rank {growth}", flush=True)

    per_stage: dict[str, Any] = {}
    for stage in stages:
        entry: dict[str, Any] = {"ours_strategy": f"zero{stage}"}
        for side in sides:
            if runs[(stage, side)]:
                entry[side] = summarize(runs[(stage, side)], args.warmup, tokens_per_step, flops_per_token,
                                        total_peak)
            if (stage, side) in errors:
                entry[f"{side}_error"] = errors[(stage, side)]
        for side in sides[:-1]:
            if side in entry and "deepspeed" in entry:
                key = "ratio" if side == "ours" else f"ratio_{side}"
                entry[key] = entry[side]["tokens_per_s"] / entry["deepspeed"]["tokens_per_s"]
                # the same launches taken pairwise (ours then DeepSpeed in each repeat): the spread of the ratio
                entry[key + "_per_repeat"] = [a / b for a, b in zip(entry[side]["runs"], entry["deepspeed"]["runs"])]
        per_stage[str(stage)] = entry
        for side in sides[:-1]:
            if side not in entry:
                continue
            line = f"stage {stage}: {side} {entry[side]['tokens_per_s']:,.0f} tok/s"
            if "deepspeed" in entry:
                key = "ratio" if side == "ours" else f"ratio_{side}"
                line += (f", deepspeed {entry['deepspeed']['tokens_per_s']:,.0f} tok/s, "
                         f"ratio {entry[key]:.3f} (per repeat "
                         + " ".join(f"{r:.2f}" for r in entry[key + "_per_repeat"]) + "); peak RSS growth rank 0: "
                         f"{side} {mib(entry[side]['peak_rss_growth_bytes_per_rank'][0])}, deepspeed "
                         f"{mib(entry['deepspeed']['peak_rss_growth_bytes_per_rank'][0])}")
            print(line, flush=True)

    deepspeed_ran = any(runs[(k, "deepspeed")] for k in stages)
    results = {
        "stages": per_stage,
        "deepspeed": {
            "version": ds_version,
            # ran on CPU in at least one stage; `reason` names the first failure, if any
            "works_on_cpu": deepspeed_ran,
            "reason": ds_reason,
        },
        "peak_matmul_flops_per_rank": peak_per_rank,
        "peak_matmul_flops_total": total_peak,
        "flops_per_token": flops_per_token,
        "memory_note": "peak_rss_growth: rise of each rank's resident set above its size just before the "
                       "model/optimizer/engine/data were built, at its highest until the timed steps ended "
                       "(fresh process per launch; VmHWM reset via /proc/self/clear_refs). state_bytes: ours "
                       "= trainer.state_bytes; deepspeed = distinct storages reachable from the model and the "
                       "ZeRO optimizer, by kind (master_params = DeepSpeed's fp32 partition copy, buckets = "
                       "its gradient reduce buckets, allocated whole). See the module docstring.",
        "settings": {
            "world_size": args.nproc, "model": cfg.model.name, "num_params": meta.num_params(),
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "seq_len": cfg.trainer.seq_len, "global_batch_size": cfg.trainer.global_batch_size,
            "micro_batch_size": cfg.trainer.micro_batch_size,
            "grad_accumulation": cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * args.nproc),
            "tokens_per_step": tokens_per_step, "grad_clip": cfg.trainer.grad_clip,
            "deepspeed_bucket_mb": args.bucket_mb,
            "deepspeed_stage3_param_persistence_threshold": args.ds_persistence_threshold,
            "overrides": list(args.overrides), "ours_variants": variants, "torch": torch.__version__,
        },
    }
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
