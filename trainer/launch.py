"""Starting the worker processes, or joining the ones torchrun / srun started.

`python -m trainer trainer.devices=4 ...` starts 4 local workers with PyTorch's elastic launcher (the
machinery behind torchrun), each running `train` on the resolved config in the same run directory.
Under torchrun or srun the process is already one of the workers and trains directly.

The caller hands `launch` the function the workers run (trainer.run.train), so this module imports
neither trainer.run nor the config package as a whole: only `register_configs` and `world_size` from
trainer.config's submodules, and `distributed_environment` from the leaf trainer/environment.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.config.derived import world_size
from trainer.config.registry import register_configs
from trainer.environment import distributed_environment

if TYPE_CHECKING:
    from trainer.interfaces.strategy import Strategy

__all__ = [
    "adopt_slurm_environment", "agree_on_run_dir", "configure_worker_logging", "describe_failure",
    "distributed_environment", "launch", "needs_launch", "worker_main", "world_size",
]

log = logging.getLogger("trainer")


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
def worker_main(cfg: DictConfig, run_dir: str, train: Callable[[DictConfig, Path], Any]) -> None:
    """Entry point of each launched worker (a picklable, module-level function): `train` is pickled by
    name (trainer.run.train) and imported again in the worker."""
    register_configs()
    configure_worker_logging(int(os.environ.get("RANK", "0")), Path(run_dir))
    train(cfg, Path(run_dir))


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
        start_method="spawn",
    )
    resolved = OmegaConf.create(cfg)  # a copy; Hydra's ${hydra:...} is not available in the workers
    OmegaConf.resolve(resolved)
    log.info(f"launching {int(t.devices)} worker(s) on this node ({nodes} node(s), "
             f"{world_size(cfg)} processes, {threads} thread(s) each)")
    elastic_launch(config, worker_main)(resolved, str(run_dir), train)


def _is_checkpoint_provider(node: DictConfig) -> bool:
    """Whether the callback `node` configures saves the run's checkpoints (validation resolved its class)."""
    from hydra.utils import get_object

    from trainer.callback import CheckpointProvider

    callback_class = get_object(str(node._target_))
    return isinstance(callback_class, type) and issubclass(callback_class, CheckpointProvider)


def describe_failure(error: ChildFailedError) -> str:
    """The failing rank and its exception, from the error file the worker's @record wrote."""
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    text = str(message).strip() or f"exit code {failure.exitcode}"
    if text.startswith("hang"):  # the hang watchdog's diagnosis names the ranks itself (trainer/hang.py)
        return text
    if failure.exitcode < 0 or "Signals." in text:
        text = f"killed by signal {-failure.exitcode}" if failure.exitcode < 0 else text
    return f"rank {rank} failed: {text}"


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
