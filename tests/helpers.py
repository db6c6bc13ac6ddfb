"""Callbacks the multi-process tests point `+callbacks.NAME._target_` at (importable by the workers)."""

from __future__ import annotations

import os
from typing import Any

from trainer.callback import Callback


class FailOnRank(Callback):
    """Raise on one rank at one step (or send its own process `signal`, e.g. 9 for SIGKILL), to check that
    the whole job ends with that rank's error."""

    def __init__(self, rank: int = 1, step: int = 2, signal: int = 0) -> None:
        self.rank = rank
        self.step = step
        self.signal = signal

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.strategy.rank == self.rank and trainer.step == self.step:
            if self.signal:
                os.kill(os.getpid(), self.signal)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class RecordPid(Callback):
    """Write each rank's pid and its parent's pid and command line, so a test can see which processes took
    part and what started them."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_fit_start(self, trainer: Any) -> None:
        rank = trainer.strategy.rank
        with open(os.path.join(self.directory, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            parent = cmdline.read().replace(b"\0", b" ").decode()
        with open(os.path.join(self.directory, f"rank{rank}.parent"), "w") as f:
            f.write(f"{os.getppid()} {parent}")


class InjectSpike(Callback):
    """Corrupt one rank's share of one global batch (by its loader position, so a replay after a
    rollback that skips it never sees it again): every target becomes byte 0, which the stdlib corpus
    never contains, so that rank's loss jumps far above its running median."""

    def __init__(self, batch: int, rank: int = 0) -> None:
        self.batch = batch
        self.rank = rank

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        if trainer.strategy.rank == self.rank and trainer.train_loader.last_position == self.batch:
            for _, targets in batch:
                targets.fill_(0)


class InjectNaN(Callback):
    """Put a NaN into one rank's gradients at one step (after their data-parallel reduction)."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step = step
        self.rank = rank

    def on_after_backward(self, trainer: Any) -> None:
        if trainer.strategy.rank == self.rank and trainer.step + 1 == self.step:
            grad = next(p.grad for part in trainer.model_parts for p in part.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("nan")


class RecordSteps(Callback):
    """Append one JSON line per step attempt to `<directory>/steps_rank<R>.jsonl`: the step, whether
    the update was skipped, this rank's loss, the grad norm, the LR used, the loader position, the
    positions the loader skips and the events in the stabilizer's ledger."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        import json

        row = {"step": trainer.step, "skipped": bool(outputs["skipped"]), "loss": float(outputs["loss"]),
               "grad_norm": float(outputs["grad_norm"]), "lr": float(outputs["lr"]),
               "batch": trainer.train_loader.last_position,
               "skipping": sorted(trainer.train_loader.skip_positions),
               "ledger": [[[e["step"], e["action"], e.get("skipped_batches")] for e in c.events]
                          for c in trainer.callbacks if hasattr(c, "skipped_batches")]}
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"steps_rank{trainer.strategy.rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


class CompareAfterRollback(Callback):
    """Keep this rank's parameters as they were after step `step`; the next time a step starts from
    `step` again (after a rollback), write whether they are bitwise the same to
    `<directory>/rollback_rank<R>.json`."""

    def __init__(self, directory: str, step: int) -> None:
        self.directory = directory
        self.step = step
        self.saved: list[Any] | None = None
        self.went_past = False

    @staticmethod
    def _local(trainer: Any) -> list[Any]:
        tensors = []
        for part in trainer.model_parts:
            for p in part.parameters():
                tensors.append(getattr(p, "_local_tensor", p).detach().clone())
        return tensors

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.step == self.step and self.saved is None:
            self.saved = self._local(trainer)
        self.went_past |= self.saved is not None and trainer.step > self.step

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        import json

        import torch

        if trainer.step == self.step and self.went_past and self.saved is not None:
            now = self._local(trainer)
            same = len(now) == len(self.saved) and all(torch.equal(a, b) for a, b in zip(now, self.saved, strict=True))
            with open(os.path.join(self.directory, f"rollback_rank{trainer.strategy.rank}.json"), "w") as f:
                json.dump({"bitwise_equal": same, "tensors": len(now)}, f)
            self.saved = None


class InjectOverflow(Callback):
    """Put an inf into one rank's gradients at one step (1-based, as logged), after their data-parallel
    reduction, so that only that rank can see it; on every rank, record each step's outcome in
    `<directory>/overflow_rank<R>.json`: skipped, the loss scale after the step, and whether this rank's
    parameters (its local shards) came out of the optimizer step bitwise unchanged."""

    def __init__(self, directory: str, step: int, rank: int = 1) -> None:
        self.directory = directory
        self.step = step
        self.rank = rank
        self.rows: list[dict[str, Any]] = []
        self.before: list[Any] = []

    @staticmethod
    def _locals(trainer: Any, grads: bool = False) -> list[Any]:
        from torch.distributed.tensor import DTensor

        tensors = []
        for part in trainer.model_parts:
            for p in part.parameters():
                t = p.grad if grads else p.detach()
                if t is not None:
                    tensors.append(t.to_local() if isinstance(t, DTensor) else t)
        return tensors

    def on_after_backward(self, trainer: Any) -> None:
        if trainer.strategy.rank == self.rank and trainer.step + 1 == self.step:
            grad = next(g for g in self._locals(trainer, grads=True) if g.numel())
            grad.view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, trainer: Any, optimizer: Any) -> None:
        self.before = [t.clone() for t in self._locals(trainer)]

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        import json

        import torch

        after = self._locals(trainer)
        unchanged = len(after) == len(self.before) and all(
            torch.equal(a, b) for a, b in zip(after, self.before, strict=True))
        self.rows.append({"step": trainer.step, "skipped": bool(outputs["skipped"]),
                          "loss_scale": trainer.precision.metrics().get("loss_scale"),
                          "params_unchanged": unchanged, "loss": float(outputs["loss"])})
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"overflow_rank{trainer.strategy.rank}.json"), "w") as f:
            json.dump(self.rows, f)


class RecordReplicated(Callback):
    """At the end of training, save this rank's local copy of every replicated DTensor parameter and the
    random stream of every module that has one to `<directory>/replicated_rank<R>.pt`, so a test can
    check that tensor-parallel ranks kept their replicated weights identical."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_fit_end(self, trainer: Any) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        replicated, streams = {}, {}
        for part in trainer.model_parts:
            for name, p in part.named_parameters():
                if isinstance(p, DTensor) and all(placement.is_replicate() for placement in p.placements):
                    replicated[name] = p.to_local().detach().clone()
            for name, module in part.named_modules():
                if hasattr(module, "rng_stream"):
                    streams[name] = module.rng_stream
        os.makedirs(self.directory, exist_ok=True)
        torch.save({"replicated": replicated, "streams": streams},
                   os.path.join(self.directory, f"replicated_rank{trainer.strategy.rank}.pt"))


class KillSelf(Callback):
    """SIGKILL this process (no handler runs, nothing is flushed: a node loss, the OOM killer) at one point:

    - `phase=step`: at the end of step `step`, after the callbacks before this one (a checkpoint manager
      listed earlier has saved that step's checkpoint; an asynchronous save is waited for first, so that
      the kill comes after its commit: the case of a kill right after a checkpoint);
    - `phase=commit`: while the checkpoint of step `step` is being committed: its shards and manifest are
      written into the `.partial` directory, the rename that publishes it has not happened;
    - `phase=metrics`: in the middle of writing metrics.csv, at the first write during step `step` (the flush
      before that step's checkpoint): half of the text reaches the file.
    """

    def __init__(self, step: int, phase: str = "step") -> None:
        assert phase in ("step", "commit", "metrics"), phase
        self.step = step
        self.phase = phase

    @staticmethod
    def _kill() -> None:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_start(self, trainer: Any) -> None:
        if self.phase == "commit":
            import trainer.checkpoint.manifest as manifest

            fsync_dir = manifest._fsync_dir
            partial = f".{manifest.step_dirname(self.step)}.partial"

            def fsync_then_die(path: Any) -> None:
                fsync_dir(path)
                if os.path.basename(str(path)) == partial and os.path.isfile(os.path.join(path, manifest.MANIFEST)):
                    self._kill()

            manifest._fsync_dir = fsync_then_die
        elif self.phase == "metrics":
            from trainer.plugins.loggers.durable_csv import DurableCSVLogger

            logger = next(lg for lg in trainer.loggers if isinstance(lg, DurableCSVLogger))
            append, step = logger._append, self.step

            def torn_append(text: str) -> None:
                if trainer.step == step:
                    with open(logger.path, "a", newline="") as f:
                        f.write(text[: max(1, len(text) // 2)])
                        f.flush()
                        os.fsync(f.fileno())
                    self._kill()
                append(text)

            logger._append = torn_append

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if self.phase == "step" and trainer.step == self.step:
            from trainer.callback import CheckpointProvider, Providers

            for provider in Providers(trainer.callbacks).all(CheckpointProvider):
                provider.latest_checkpoint(trainer)  # finishes (commits) a save in flight
            self._kill()


# ---- faults for the hang watchdog and the straggler report (tests/test_hang.py) ----------------------------
def _armed(trainer: Any, rank: int, attempt: int) -> bool:
    return (trainer.strategy.rank == rank
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == attempt)


class StopBeforeCollective(Callback):
    """One rank stops (blocks for an hour) at the start of a step, before that step's collectives, in one
    elastic attempt only."""

    def __init__(self, rank: int, step: int, attempt: int = 0) -> None:
        self.rank, self.step, self.attempt = rank, step, attempt

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        import time

        if _armed(trainer, self.rank, self.attempt) and trainer.step + 1 == self.step:
            time.sleep(3600)


class FreezeRank(Callback):
    """One rank SIGSTOPs its own process at the start of step `step` (or before its `backward`-th backward
    of that step) in one elastic attempt (a frozen rank:
    it writes no hang report and ignores SIGTERM)."""

    def __init__(self, rank: int, step: int, attempt: int = 0, backward: int = 0) -> None:
        self.rank, self.step, self.attempt, self.backward = rank, step, attempt, backward
        self.backwards = 0

    def _freeze(self, trainer: Any) -> None:
        import signal

        if _armed(trainer, self.rank, self.attempt) and trainer.step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        self.backwards = 0
        if not self.backward:  # before the step's forwards
            self._freeze(trainer)

    def on_before_backward(self, trainer: Any, loss: Any) -> None:
        self.backwards += 1
        if self.backwards == self.backward:  # before that micro-batch's backward: the others' DDP all-reduce waits
            self._freeze(trainer)


class SleepInForward(Callback):
    """One rank sleeps `seconds` inside the model's forward: in every forward from step `step` on (a
    straggler, `until` excluded), or for an hour in step `step` (a hang), in one elastic attempt only."""

    def __init__(self, rank: int, step: int, seconds: float = 3600.0, attempt: int = 0,
                 until: int | None = None) -> None:
        self.rank, self.step, self.seconds, self.attempt, self.until = rank, step, seconds, attempt, until
        self.trainer: Any = None

    def on_fit_start(self, trainer: Any) -> None:
        self.trainer = trainer
        if _armed(trainer, self.rank, self.attempt):
            for part in trainer.model_parts:
                part.register_forward_pre_hook(self._sleep)

    def _sleep(self, module: Any, args: Any) -> None:
        import time

        step = self.trainer.step + 1
        if step >= self.step and (self.until is None or step < self.until) and module.training:
            time.sleep(self.seconds)


class SkipPipelineSend(Callback):
    """The pipeline stage on `rank` skips its forward send of micro-batch `microbatch` in step `step`."""

    def __init__(self, rank: int, step: int, microbatch: int = 1, attempt: int = 0) -> None:
        self.rank, self.step, self.microbatch, self.attempt = rank, step, microbatch, attempt

    def on_fit_start(self, trainer: Any) -> None:
        if not _armed(trainer, self.rank, self.attempt):
            return
        from torch.distributed.pipelining.stage import _PipelineStageBase

        original = _PipelineStageBase.get_fwd_send_ops
        hook = self

        def get_fwd_send_ops(stage: Any, fwd_chunk_id: int) -> list:
            ops = original(stage, fwd_chunk_id)
            if trainer.step + 1 == hook.step and fwd_chunk_id == hook.microbatch:
                return []
            return ops

        _PipelineStageBase.get_fwd_send_ops = get_fwd_send_ops  # type: ignore[method-assign]


# ---- a kill while an asynchronous checkpoint is being written (tests/test_recovery.py) ---------------------
ASYNC_KILL_RECORD = "async_kill.json"
ASYNC_WRITE_STALLED = "async_write_stalled"
LOSSES = "losses.jsonl"


class KillDuringAsyncWrite(Callback):
    """Stall the background write of the checkpoint of `save_step` on `rank` halfway, then SIGKILL that rank
    at the end of `kill_step` while the write is still in flight, in elastic attempt `attempt` only.

    The stall is a storage hook: DCP's per-item writer (`filesystem._write_item`, looked up at each call by
    the writing thread) writes and flushes the first item of the shard, creates `<run_dir>/async_write_stalled`
    and blocks (sleeps; the loop trains on). Before the kill the rank writes `<run_dir>/async_kill.json`:
    the steps, whether the stall was reached, and the files of the uncommitted save with their sizes. Rank 0
    appends (attempt, step, its local loss) to `<run_dir>/losses.jsonl` after every step of every attempt.
    """

    def __init__(self, save_step: int, kill_step: int, rank: int = 1, attempt: int = 0) -> None:
        assert kill_step > save_step
        self.save_step, self.kill_step, self.rank, self.attempt = save_step, kill_step, rank, attempt

    def _armed(self, trainer: Any, step: int) -> bool:
        return _armed(trainer, self.rank, self.attempt) and trainer.step == step

    def on_save_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        if not self._armed(trainer, self.save_step):
            return
        import time
        from pathlib import Path

        from torch.distributed.checkpoint import filesystem

        original, marker = filesystem._write_item, Path(trainer.run_dir) / ASYNC_WRITE_STALLED
        written = [0]

        def stalling_write_item(transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
            if written[0] == 1:  # the shard file holds one item, on disk: stall here until the SIGKILL
                marker.touch()
                time.sleep(600)
            written[0] += 1
            result = original(transforms, stream, *args, **kwargs)
            stream.flush()
            return result

        filesystem._write_item = stalling_write_item

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        import json
        import signal
        import time
        from pathlib import Path

        run_dir = Path(trainer.run_dir)
        if trainer.strategy.is_global_zero:
            with open(run_dir / LOSSES, "a") as f:
                f.write(json.dumps({"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                    "step": trainer.step, "loss": float(outputs["loss"])}) + "\n")
        if not self._armed(trainer, self.kill_step):
            return
        deadline = time.monotonic() + 120.0  # the writing thread reaches the stall within milliseconds
        while not (run_dir / ASYNC_WRITE_STALLED).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        partial = run_dir / "checkpoints" / f".step_{self.save_step:08d}.partial"
        files = {p.name: p.stat().st_size for p in partial.iterdir()} if partial.is_dir() else None
        record = {"save_step": self.save_step, "kill_step": trainer.step,
                  "stalled": (run_dir / ASYNC_WRITE_STALLED).exists(), "partial_files": files}
        (run_dir / ASYNC_KILL_RECORD).write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGKILL)
