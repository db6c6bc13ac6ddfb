"""Starting the worker processes, or joining the ones torchrun / srun started.

`python -m trainer trainer.devices=4 ...` starts 4 local workers with PyTorch's elastic launcher (the
machinery behind torchrun), each running `train` on the resolved config in the same run directory.
Under torchrun or srun the process is already one of the workers and trains directly.

The caller hands `launch` the function the workers run (trainer.run.train), so this module imports
neither trainer.run nor the config package as a whole: only `register_configs` and `world_size` from
trainer.config's submodules, and `distributed_environment` from the leaf trainer/environment.py.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.checkpoint.memory import snapshot_root
from trainer.config.derived import world_size
from trainer.config.registry import register_configs
from trainer.environment import distributed_environment, signal_numbers
from trainer.recovery import WORKER_STARTED, FaultRecorder

if TYPE_CHECKING:
    from trainer.interfaces.strategy import Strategy

__all__ = [
    "adopt_slurm_environment", "agree_on_run_dir", "configure_worker_logging", "describe_failure",
    "distributed_environment", "launch", "needs_launch", "route_agent_logs", "worker_main", "world_size",
]

log = logging.getLogger("trainer")
LAUNCHER_LOG = "launcher.log"
# the elastic agent's and torch.multiprocessing's loggers: their error-level tracebacks of a failed worker
# (and the SIGTERM/SIGKILL warnings of its shutdown) go to <run dir>/launcher.log, not to the console
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
_agent_log: dict[str, Any] = {"handler": None, "path": None}


def route_agent_logs(run_dir: Path) -> Path:
    """Send the elastic agent's log records to `<run_dir>/launcher.log` only (replacing an earlier run's
    file in a sweep); `describe_failure` names that file in its line."""
    path = Path(run_dir) / LAUNCHER_LOG
    old = _agent_log["handler"]
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        if old is not None:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False  # torch's console handler sits on the "torch" logger
    if old is not None:
        old.close()
    _agent_log.update(handler=handler, path=path)
    return path


def record_faults(run_dir: Path) -> logging.Handler:
    """Record when the elastic agent decides to restart the workers (trainer/recovery.py's `detected`): its
    agent module logs that at INFO, let through to launcher.log as well."""
    recorder = FaultRecorder(run_dir)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.INFO)
    logging.getLogger(AGENT_LOGGERS[0]).addHandler(recorder)
    return recorder


def adopt_slurm_environment() -> None:
    """Translate srun's variables into the ones torch.distributed reads (one task per GPU)."""
    env = os.environ
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    # The node srun was started from hosts the store; MASTER_ADDR/PORT may be exported by the batch script.
    env.setdefault("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))


def needs_launch(cfg: DictConfig) -> bool:
    return world_size(cfg) > 1 and distributed_environment() is None


def configure_worker_logging(rank: int, run_dir: Path) -> None:
    """Rank 0 prints and writes train.log; the other ranks only report warnings and errors."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stdout)
    if rank == 0:
        console.setFormatter(logging.Formatter("%(message)s"))
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(file_handler)
        root.setLevel(logging.INFO)
    else:
        console.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
        root.setLevel(logging.WARNING)
    root.addHandler(console)


@record
def worker_main(cfg: DictConfig, run_dir: str, train: Callable[[DictConfig, Path], Any]) -> dict[str, Any] | None:
    """Entry point of each launched worker (a picklable, module-level function): `train` is pickled by
    name (trainer.run.train) and imported again in the worker."""
    from trainer.preemption import SIGNALS_TAKEN, TrainingPreempted

    os.environ[WORKER_STARTED] = repr(time.time())  # the recovery timeline's `worker_started` (trainer/recovery.py)
    register_configs()
    configure_worker_logging(int(os.environ.get("RANK", "0")), Path(run_dir))
    try:
        train(cfg, Path(run_dir))
    except TrainingPreempted as stopped:  # saved at a step boundary: a normal end the launcher reports
        return {"preempted": {"signal": stopped.signal_name, "step": stopped.step,
                              "checkpoint": str(stopped.checkpoint)}}
    except Exception as error:
        if lost_a_peer(error) and signal.SIGTERM not in SIGNALS_TAKEN:
            # Another rank is gone and this one's collective failed because of it: the launcher reports the
            # first failure it sees, so this rank leaves a moment later, or as soon as the agent stops the
            # group (SIGTERM: it has seen the cause; no wait when it came during training). A forked worker
            # exits within milliseconds of its error, so both ends were seen at once and the consequence
            # could be named as the cause.
            wait_for_sigterm(PEER_LOSS_GRACE_S)
        raise
    return None


def wait_for_sigterm(seconds: float) -> None:
    """Wait up to `seconds` in the main thread, less if SIGTERM comes."""
    came = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: came.set())
    try:
        came.wait(seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)


# What a collective raises on the ranks left when another rank's process ends (gloo; NCCL).
PEER_LOSS_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "remote process exited")
PEER_LOSS_GRACE_S = 1.0


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` is a collective's failure because another rank's process ended."""
    return any(message in str(error) for message in PEER_LOSS_MESSAGES)


def launch(cfg: DictConfig, run_dir: Path, train: Callable[[DictConfig, Path], Any]) -> None:
    """Start trainer.devices workers on this node (and rendezvous with the other nodes), each running
    `train(cfg, run_dir)` (trainer.run.train; a module-level function, so the workers can import it)."""
    t = cfg.trainer
    nodes = int(t.num_nodes)
    if nodes > 1:
        endpoint, run_id = t.rdzv_endpoint, t.rdzv_id
    else:  # a private rendezvous on a free local port, like `torchrun --standalone`
        endpoint, run_id = "localhost:0", str(uuid.uuid4())
    # Threads: the cores of this node shared by its workers, unless set explicitly.
    threads = t.num_threads or max(1, (os.cpu_count() or 1) // int(t.devices))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if int(t.max_restarts) > 0:
        # By default the agent keeps one rendezvous store across restarts, so a restarted worker can read the
        # previous attempt's process-group addresses and fail to connect ("Connection refused"): a fresh
        # store per attempt (hosted by worker 0) avoids that.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if not any(_is_checkpoint_provider(node) for node in cfg.callbacks.values()):
            log.warning("trainer.max_restarts is set but no checkpoint manager saves the run "
                        "(callbacks=[default,checkpoint]): restarted workers start again from step 0")
    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=int(t.devices),
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": 900},
        max_restarts=int(t.max_restarts),
        monitor_interval=0.1,
        start_method=worker_start_method(train),
        # the preemption signals are forwarded by `forward_signals`, not handled by the agent
        signals_to_handle=agent_signals(list(t.preemption_signals)),
    )
    resolved = OmegaConf.create(cfg)  # a copy; Hydra's ${hydra:...} is not available in the workers
    OmegaConf.resolve(resolved)
    log.info(f"launching {int(t.devices)} worker(s) on this node ({nodes} node(s), "
             f"{world_size(cfg)} processes, {threads} thread(s) each)")
    route_agent_logs(run_dir)
    recorder = record_faults(run_dir) if int(t.max_restarts) > 0 else None
    try:
        with forward_signals(list(t.preemption_signals)):
            results = elastic_launch(config, worker_main)(resolved, str(run_dir), train)
    finally:
        if recorder is not None:
            logging.getLogger(AGENT_LOGGERS[0]).removeHandler(recorder)
        # What the workers left in shared memory (in-memory snapshots of a job that failed for good; a
        # normal end removed them): the job is over, nothing will restore them.
        shutil.rmtree(snapshot_root(run_dir), ignore_errors=True)
    preempted = [result["preempted"] for result in (results or {}).values()
                 if isinstance(result, dict) and "preempted" in result]
    if preempted:
        from trainer.preemption import TrainingPreempted

        first = preempted[0]
        raise TrainingPreempted(first["signal"], int(first["step"]), Path(first["checkpoint"]))


# The environment the forkserver was started with (None: not started by `launch` in this process).
_forkserver_environment: dict[str, str] | None = None


def worker_start_method(train: Callable[[DictConfig, Path], Any]) -> str:
    """How the workers start: forked from a server process that imported the trainer once ("forkserver"),
    not each a new interpreter that imports torch, Hydra and the trainer again ("spawn": 4.5 s of CPU per
    worker on the 2-core test machine, and again for every worker at each restart).

    The server is a fresh interpreter that only imports (no CUDA context, no threads: forking it is safe),
    started at the first launch of this process and kept for its restarts and later launches (a sweep's
    jobs). Its workers inherit its environment, not the launcher's: a later launch whose environment
    differs (a sweep job's own variables) spawns instead."""
    global _forkserver_environment
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if _forkserver_environment is None:
        multiprocessing.set_forkserver_preload([train.__module__, __name__])
        _forkserver_environment = dict(os.environ)
    return "forkserver" if dict(os.environ) == _forkserver_environment else "spawn"


# The elastic agent's own handlers (torch.distributed.elastic.multiprocessing.api), which raise in the agent,
# SIGTERM the workers and wait 30 s for them: a worker that returned waits for the agent to read its
# result, which an agent shutting down never does, so each preempted job took 30 s and ended in a traceback.
_AGENT_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # where launch_agent puts LaunchConfig.signals_to_handle
_AGENT_DEFAULT_SIGNALS = LaunchConfig.signals_to_handle  # SIGTERM,SIGINT,SIGHUP,SIGQUIT


def agent_signals(names: list[str]) -> str:
    """The signals the elastic agent still handles itself: its defaults but the preemption signals."""
    ours = {number.name for number in signal_numbers(names)}
    return ",".join(name.strip() for name in _AGENT_DEFAULT_SIGNALS.split(",") if name.strip() not in ours)


@contextlib.contextmanager
def forward_signals(names: list[str]) -> Any:
    """While the workers run, the launcher forwards the preemption signals (trainer.preemption_signals) to
    them instead of letting the agent handle them: each worker saves at its next step boundary and returns,
    and `launch` raises TrainingPreempted (exit 75). The workers drop a repeat of the same signal within
    2 s (Ctrl-C in a terminal reaches them and the launcher, which forwards it); a later one, forwarded
    too, acts as usual in them."""
    numbers = signal_numbers(names)
    if not numbers or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_env = os.environ.get(_AGENT_SIGNALS)

    def forward(signum: int, frame: Any) -> None:
        del frame
        workers = multiprocessing.active_children()  # the agent's spawned workers
        log.warning(f"{signal.Signals(signum).name}: forwarded to the {len(workers)} worker(s); they save at "
                    "the end of their step and stop")
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signum)  # type: ignore[arg-type]

    previous = {number: signal.signal(number, forward) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if previous_env is None:
            os.environ.pop(_AGENT_SIGNALS, None)
        else:
            os.environ[_AGENT_SIGNALS] = previous_env


def _is_checkpoint_provider(node: DictConfig) -> bool:
    """Whether the callback `node` configures saves the run's checkpoints (validation resolved its class)."""
    from hydra.utils import get_object

    from trainer.callback import CheckpointProvider

    callback_class = get_object(str(node._target_))
    return isinstance(callback_class, type) and issubclass(callback_class, CheckpointProvider)


def describe_failure(error: ChildFailedError) -> str:
    """One line per cause: each failing rank with its exception (from the error file the worker's @record
    wrote) or the signal that killed it, ranks with the same cause on one line, the first failure first;
    the elastic agent's tracebacks are in the launcher's log, which the first line names. A hang
    diagnosis (trainer/hang.py) names the ranks itself and is passed through unchanged."""
    failures = sorted(error.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    causes: dict[str, list[int]] = {}
    for rank, failure in failures:
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        text = str(message).strip() or f"exit code {failure.exitcode}"
        if text.startswith("hang"):  # the watchdog's diagnosis, whichever rank's exit came first
            return text
        if failure.exitcode < 0:
            text = f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
        causes.setdefault(text, []).append(rank)
    lines = []
    for text, ranks in causes.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
        lines.append(f"{who} failed: {text}")
    if _agent_log["path"] is not None:
        lines[0] += f" (the launcher's log: {_agent_log['path']})"
    return "\n".join(lines)


def agree_on_run_dir(strategy: "Strategy", run_dir: Path) -> Path:
    """Under torchrun every rank's Hydra made its own timestamped directory: use rank 0's.

    A rank's own directory is removed when it holds nothing but Hydra's bookkeeping. (A single process
    keeps its own: `Strategy.broadcast_object` returns the value unchanged.)
    """
    agreed = Path(strategy.broadcast_object(str(run_dir)))
    if agreed != run_dir and run_dir.exists():
        leftovers = {p.name for p in run_dir.iterdir()} - {".hydra", "train.log"}
        if not leftovers:
            shutil.rmtree(run_dir, ignore_errors=True)
    return agreed
