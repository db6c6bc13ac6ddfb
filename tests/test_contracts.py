"""The declared contracts between the loop, the data loaders and the callbacks (issue 34).

- `trainer.data.TrainLoader`: what the loop, checkpoints and the stabilizer use of a training loader;
  StatefulLoader and MixtureLoader implement it, and a loader missing a member cannot be created.
- `trainer.callback.Requirement` / `Providers` / `connect_callbacks`: a callback declares the interface it
  needs another callback to implement and receives that callback, looked up by `isinstance`.
- `trainer.callback.CheckpointProvider`: the checkpoint manager's interface (resume's directory, the
  latest checkpoint for a rollback); the launcher recognises a provider by its class, not its name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from trainer.callback import (
    Callback,
    CheckpointProvider,
    MissingCallbackError,
    Providers,
    Requirement,
    connect_callbacks,
)
from trainer.data import MixtureLoader, StatefulLoader, TokenWindows, TrainLoader
from trainer.data.mixture import Phase

# ---- the loader contract ------------------------------------------------------------------------------

CONTRACT = {"__next__", "last_position", "skip", "state_dict", "load_state_dict"}


def stateful() -> StatefulLoader:
    return StatefulLoader(TokenWindows(np.arange(401), 4), 4, 2, seed=1)


def mixture() -> MixtureLoader:
    windows = [TokenWindows(np.arange(401), 4), TokenWindows(np.arange(1000, 1201), 4)]
    return MixtureLoader(windows, ["a", "b"], [Phase(0, (0.75, 0.25))], 4, 2, seed=1)


LOADERS = {"StatefulLoader": stateful, "MixtureLoader": mixture}


def test_the_contract_is_what_the_loop_and_the_callbacks_use() -> None:
    assert TrainLoader.__abstractmethods__ == CONTRACT


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_both_loaders_satisfy_the_contract(name: str) -> None:
    loader = LOADERS[name]()
    assert isinstance(loader, TrainLoader) and iter(loader) is loader
    assert loader.last_position is None
    start = loader.state_dict()
    first = next(loader)
    assert loader.last_position == 0 and len(first) == 2 and first[0][0].shape == (2, 4)
    loader.skip([1, 2])  # passed over as if consumed
    next(loader)
    assert loader.last_position == 3
    # the state is plain values and resumes exactly
    assert OmegaConf.to_container(OmegaConf.create(loader.state_dict())) == loader.state_dict()
    again = LOADERS[name]()
    again.load_state_dict(start)
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(next(again), first) for a, b in zip(pair_a, pair_b))


def _without(cls: type, member: str) -> type:
    """`cls`'s own body minus `member`, on top of the contract alone (what a loader that forgot it is)."""
    body = {key: value for key, value in vars(cls).items()
            if key != member and key not in ("__dict__", "__weakref__", "__abstractmethods__", "_abc_impl")}
    return type(f"{cls.__name__}Without_{member.strip('_')}", (TrainLoader,), body)


@pytest.mark.parametrize("member", sorted(CONTRACT))
@pytest.mark.parametrize("name", sorted(LOADERS))
def test_a_loader_missing_a_member_of_the_contract_cannot_be_created(name: str, member: str) -> None:
    complete = LOADERS[name]()
    crippled = _without(type(complete), member)
    assert member in crippled.__abstractmethods__  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=f"abstract .*{member}"):
        if name == "StatefulLoader":
            crippled(complete.windows, 4, 2)
        else:
            crippled(complete.windows, complete.names, complete.phases, 4, 2)


def test_the_trainer_takes_only_a_train_loader() -> None:
    from trainer.loop import Trainer

    with pytest.raises(TypeError, match="train_loader must be a trainer.data.TrainLoader, got list_iterator"):
        Trainer(config=None, strategy=None, model_parts=[], optimizer=None,  # type: ignore[arg-type]
                scheduler=None, train_loader=iter([]), val_set=[], total_steps=1,  # type: ignore[arg-type]
                tokens_per_step=1, num_params=1, flops_per_token=1, peak_flops=1.0)


# ---- callbacks that need other callbacks ------------------------------------------------------------------


class Saver(CheckpointProvider):
    """A checkpoint provider under a name that says nothing of checkpoints."""

    def __init__(self, checkpoint: Optional[Path] = None) -> None:
        self.checkpoint = checkpoint
        self.asked: list[Optional[int]] = []

    def resolve_directory(self, run_dir: Path | str) -> Path:
        return Path(run_dir) / "saves"

    def latest_checkpoint(self, trainer: Any, before_step: Optional[int] = None) -> Optional[Path]:
        self.asked.append(before_step)
        return self.checkpoint


NEEDS_SAVER: Requirement[CheckpointProvider] = Requirement(CheckpointProvider, reason="rewinding restores a checkpoint",
                                                           remedy="add a saver")


class Rewinder(Callback):
    """Needs the run's checkpoint provider; keeps it."""

    def __init__(self) -> None:
        self.saver: Optional[CheckpointProvider] = None

    @classmethod
    def requires(cls, node: Any) -> tuple[Requirement[Any], ...]:
        return (NEEDS_SAVER,)

    def connect(self, providers: Providers) -> None:
        self.saver = providers.require(NEEDS_SAVER)


def test_a_callback_receives_the_one_implementation_of_what_it_requires() -> None:
    rewinder, saver, other = Rewinder(), Saver(), Callback()
    connect_callbacks([rewinder, other, saver])
    assert rewinder.saver is saver
    assert Providers([other, saver, rewinder]).all(CheckpointProvider) == [saver]


def test_a_missing_or_ambiguous_implementation_is_one_clear_error() -> None:
    with pytest.raises(MissingCallbackError, match="^rewinding restores a checkpoint, but no callback of the run is "
                                                   "a CheckpointProvider: add a saver$"):
        connect_callbacks([Rewinder(), Callback()])
    with pytest.raises(MissingCallbackError, match=r"2 callbacks are CheckpointProviders \(Saver, Saver\): keep one"):
        connect_callbacks([Rewinder(), Saver(), Saver()])


def test_the_checkpoint_manager_is_the_checkpoint_provider(tmp_path: Path) -> None:
    from trainer.checkpoint import checkpoint_directory
    from trainer.plugins.callbacks import CheckpointManager

    manager = CheckpointManager(directory="elsewhere")
    assert isinstance(manager, CheckpointProvider)

    class Run:
        run_dir = tmp_path
        callbacks = [Callback(), manager]

    assert checkpoint_directory(Run()) == tmp_path / "elsewhere"  # type: ignore[arg-type]
    Run.callbacks = [Callback()]
    assert checkpoint_directory(Run()) == tmp_path / "checkpoints"  # type: ignore[arg-type]


def test_the_launcher_recognises_a_checkpoint_provider_by_its_class() -> None:
    """The restart warning (`trainer.max_restarts` without saves) asks the class, not its `_target_` text:
    a provider named otherwise counts, a class whose name merely contains CheckpointManager does not."""
    from trainer.launch import _is_checkpoint_provider

    def node(target: str) -> Any:
        return OmegaConf.create({"_target_": target})

    assert _is_checkpoint_provider(node("trainer.plugins.callbacks.CheckpointManager"))
    assert _is_checkpoint_provider(node(f"{__name__}.Saver"))
    assert not _is_checkpoint_provider(node(f"{__name__}.NotACheckpointManager"))
    assert not _is_checkpoint_provider(node("trainer.plugins.callbacks.ProgressBar"))


class NotACheckpointManager(Callback):
    """Named like the manager, saves nothing."""


def test_a_rank_that_lost_a_peer_waits_for_the_launcher_at_most_its_grace() -> None:
    """A worker whose collective failed because another rank's process ended leaves after the launcher's
    SIGTERM (it has seen the cause) or the grace, whichever is first (trainer.launch.worker_main)."""
    import os
    import signal
    import threading
    import time

    from trainer.launch import PEER_LOSS_GRACE_S, lost_a_peer, wait_for_sigterm

    assert lost_a_peer(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:15794"))
    assert not lost_a_peer(RuntimeError("injected failure on rank 1 at step 2"))
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    wait_for_sigterm(30.0)
    assert time.monotonic() - started < 5.0  # the SIGTERM, not the 30 s
    assert signal.getsignal(signal.SIGTERM) == before  # handed back
    started = time.monotonic()
    wait_for_sigterm(PEER_LOSS_GRACE_S)
    assert time.monotonic() - started >= PEER_LOSS_GRACE_S * 0.9  # no signal: the whole grace


def test_workers_fork_from_the_server_unless_the_environment_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forkserver's workers inherit its environment (the first launch's): a later launch in the same
    process with another environment (a sweep job's own variables) spawns its workers instead."""
    import multiprocessing.forkserver

    from trainer import launch
    from trainer.run import train

    monkeypatch.setattr(launch, "_forkserver_environment", None)
    assert launch.worker_start_method(train) == "forkserver"
    assert multiprocessing.forkserver._forkserver._preload_modules == ["trainer.run", "trainer.launch"]
    assert launch.worker_start_method(train) == "forkserver"  # the same environment: the same server
    monkeypatch.setenv("TRAINER_TEST_SWEEP_JOB_VARIABLE", "1")
    assert launch.worker_start_method(train) == "spawn"


def test_the_managers_latest_checkpoint_is_the_newest_complete_one_before_the_step(tmp_path: Path) -> None:
    from trainer.checkpoint.manifest import MANIFEST, step_dirname
    from trainer.plugins.callbacks import CheckpointManager
    from trainer.plugins.strategies import SingleDevice

    class Run:
        strategy = SingleDevice()

    manager = CheckpointManager()
    directory = manager.resolve_directory(tmp_path)
    assert manager.latest_checkpoint(Run()) is None  # type: ignore[arg-type]
    for step in (4, 8, 12):
        (directory / step_dirname(step)).mkdir(parents=True)
        (directory / step_dirname(step) / MANIFEST).write_text("{}")
    (directory / step_dirname(16)).mkdir()  # no manifest: never committed
    assert manager.latest_checkpoint(Run()) == directory / step_dirname(12)  # type: ignore[arg-type]
    assert manager.latest_checkpoint(Run(), before_step=12) == directory / step_dirname(8)  # type: ignore[arg-type]
    assert manager.latest_checkpoint(Run(), before_step=4) is None  # type: ignore[arg-type]
