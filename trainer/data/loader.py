"""Fixed-length training windows and a resumable, data-parallel-exact batch loader.

The loader's unit is the *global batch*: step ``s`` of epoch ``e`` consumes
entries ``[s*G, (s+1)*G)`` of the epoch permutation, rank ``r`` of ``D`` takes
the ``r``-th contiguous slice of ``G/D`` of them and cuts it into micro-batches
in order. Concatenating all ranks' micro-batches in rank order therefore gives
exactly the single-process global batch, so changing ``dp_size`` or
``micro_batch_size`` changes neither the data nor (up to float reassociation)
the gradients. The state is independent of the rank layout, so a run can be
resumed with a different ``dp_size``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["TrainLoader", "TokenWindows", "StatefulLoader", "val_batches", "Batch", "SourceValidation"]

Batch = tuple[torch.Tensor, torch.Tensor]
"""An ``(inputs, targets)`` pair of int64 tensors shaped ``[batch, seq_len]``."""


class TrainLoader(Iterator[list[Batch]]):
    """The training loader's contract: what the loop, checkpoints and callbacks use of it.

    An endless iterator: each ``next()`` returns this rank's micro-batches of the next *global batch*.
    A global batch is named by its *position*, its absolute index in the data order (0, 1, 2, ...): the
    same on every rank and for any data-parallel size, so that ranks agree on it and a position still
    means the same batch after a resume on another world size.

    The loop saves ``state_dict()`` in checkpoints and hands it back to ``load_state_dict`` on resume;
    the loss-spike stabilizer reads ``last_position`` (which batch spiked) and gives its ledger of bad
    batches to ``skip``. An abstract base class rather than a structural protocol: every member is
    checked when a loader is created (a loader missing one cannot be instantiated), not when a
    checkpoint or a rollback first needs it hours into a run.
    """

    @abstractmethod
    def __next__(self) -> list[Batch]:
        """This rank's micro-batches of the next global batch not skipped."""

    @property
    @abstractmethod
    def last_position(self) -> int | None:
        """The position of the global batch the last ``next()`` returned (None before the first)."""

    @abstractmethod
    def skip(self, positions: Iterable[int]) -> None:
        """Never return the global batches at these positions. A skipped batch is passed over as if it
        had been consumed, so the batches after it are unchanged (a rollback replays the same data
        minus the bad window)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The position in plain values (safe for ``torch.save(weights_only=True)`` and JSON), independent
        of the rank layout; the skip list is not in it (the stabilizer's ledger owns and restores it)."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()``: the next batches equal those the saver would have returned.
        Raises ValueError when the state belongs to other data (sources, sizes, global batch size)."""


class TokenWindows:
    """Non-overlapping next-token-prediction windows over a 1-D token array.

    Sample ``i`` reads ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; the input
    is its first ``seq_len`` tokens and the target its last ``seq_len``. The one
    token of overlap between consecutive windows is what makes every token a
    target exactly once. Works on ``np.memmap`` without loading the array.

    Args:
        tokens: 1-D integer array (any integer dtype, may be a memmap).
        seq_len: tokens per input sequence.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"need at least seq_len + 1 = {seq_len + 1} tokens for one window, got {len(tokens)}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> Batch:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"window index {index} out of range for {n} windows")
        x, y = self.get_batch(np.array([index % n]))
        return x[0], y[0]

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """Stack the windows at ``indices`` into ``(x, y)`` of shape ``[len(indices), seq_len]``."""
        idx = np.asarray(indices, dtype=np.int64)
        # One fancy-indexing gather: a single copy out of the memmap, no Python loop.
        rows = np.asarray(self.tokens[idx[:, None] * self.seq_len + self._offsets], dtype=np.int64)
        data = torch.from_numpy(rows)
        # Contiguous copies: callers commonly .view(-1) the targets for the loss.
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _gather(windows: Sequence[Batch], indices: np.ndarray) -> Batch:
    if isinstance(windows, TokenWindows):
        return windows.get_batch(indices)
    # Generic fallback for any sequence of (x, y) samples.
    samples = [windows[int(i)] for i in indices]
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class StatefulLoader(TrainLoader):
    """Endless iterator of per-rank micro-batch lists, one list per optimizer step.

    Each ``next()`` returns ``global_batch_size // (micro_batch_size * dp_size)``
    ``(x, y)`` pairs shaped ``[micro_batch_size, seq_len]``: this rank's share of
    one global batch (see the module docstring for the exact layout). Epoch
    ``e`` uses a permutation seeded by ``(seed, e)`` (identity if not
    ``shuffle``); its incomplete tail is dropped and the next epoch starts with
    a fresh permutation. ``state_dict``/``load_state_dict`` resume exactly.

    Args:
        windows: a ``TokenWindows`` (or any sequence of ``(x, y)`` samples).
        global_batch_size: samples per optimizer step over all ranks.
        micro_batch_size: samples per forward/backward pass on one rank.
        dp_rank: this process's data-parallel rank.
        dp_size: number of data-parallel ranks.
        seed: base seed of the epoch permutations.
        shuffle: shuffle each epoch; ``False`` reads windows in order.
    """

    def __init__(
        self,
        windows: Sequence[Batch],
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_positive(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_size=dp_size)
        per_step = micro_batch_size * dp_size
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by "
                f"micro_batch_size ({micro_batch_size}) * dp_size ({dp_size}) = {per_step}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if len(windows) < global_batch_size:
            raise ValueError(
                f"dataset has {len(windows)} windows, fewer than one global batch of {global_batch_size}"
            )
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm: tuple[tuple[int, int, bool], np.ndarray] | None = None
        # Global batches never to return, by absolute position (see `position`): the loss-spike
        # stabilizer's ledger. Kept out of state_dict because its owner (the ledger) restores it.
        self.skip_positions: set[int] = set()
        self._last_position: int | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (the incomplete tail is dropped)."""
        return len(self.windows) // self.global_batch_size

    @property
    def position(self) -> int:
        """Absolute index of the next global batch: epoch * steps_per_epoch + step_in_epoch.

        It names a batch independently of the rank layout, so every rank (and a resume on another
        world size) agrees on it.
        """
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    @property
    def last_position(self) -> int | None:
        """Absolute position of the batch the last next() returned (None before the first)."""
        return self._last_position

    def skip(self, positions: Iterable[int]) -> None:
        """Never return the global batches at these absolute positions (a skipped one is passed over
        as if consumed, so the batches after it are unchanged)."""
        self.skip_positions.update(int(p) for p in positions)

    def _advance(self) -> None:
        self.step_in_epoch += 1
        # Roll over eagerly so that state_dict() always names the *next* batch's epoch.
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on this rank (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _permutation(self) -> np.ndarray:
        key = (self.seed, self.epoch, self.shuffle)
        if self._perm is None or self._perm[0] != key:  # recomputed once per epoch only
            n = len(self.windows)
            if self.shuffle:
                # SeedSequence needs non-negative entries; fold any int seed into uint64.
                rng = np.random.default_rng([self.seed % 2**64, self.epoch])
                perm = rng.permutation(n)
            else:
                perm = np.arange(n, dtype=np.int64)
            self._perm = (key, perm)
        return self._perm[1]

    def _rank_indices(self) -> np.ndarray:
        per_rank = self.global_batch_size // self.dp_size
        start = self.step_in_epoch * self.global_batch_size + self.dp_rank * per_rank
        return self._permutation()[start : start + per_rank]

    def __iter__(self) -> StatefulLoader:
        return self

    def __next__(self) -> list[Batch]:
        while self.position in self.skip_positions:
            self._advance()
        self._last_position = self.position
        indices = self._rank_indices()
        m = self.micro_batch_size
        batches = [_gather(self.windows, indices[i : i + m]) for i in range(0, len(indices), m)]
        self._advance()
        return batches

    def state_dict(self) -> dict[str, Any]:
        """Plain-int position (safe for ``torch.save(weights_only=True)`` and JSON)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "num_windows": len(self.windows),
            "consumed_samples": (self.epoch * self.steps_per_epoch + self.step_in_epoch) * self.global_batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``; the next batches equal those the saver would have produced.

        The seed and shuffle flag are taken from ``state``. A different dataset
        size or global batch size would silently change what a position means,
        so they are rejected; ``dp_size``/``micro_batch_size`` may change.
        """
        for key in ("epoch", "step_in_epoch", "seed"):
            if key not in state:
                raise KeyError(f"loader state is missing {key!r}")
        for key, current in (("num_windows", len(self.windows)), ("global_batch_size", self.global_batch_size)):
            if key in state and state[key] != current:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has {current}")
        step = int(state["step_in_epoch"])
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"step_in_epoch {step} out of range for {self.steps_per_epoch} steps per epoch")
        self.epoch = int(state["epoch"])
        self.step_in_epoch = step
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))

    def __repr__(self) -> str:
        return (
            f"StatefulLoader(windows={len(self.windows)}, global_batch_size={self.global_batch_size}, "
            f"micro_batch_size={self.micro_batch_size}, dp_rank={self.dp_rank}, dp_size={self.dp_size}, "
            f"epoch={self.epoch}, step_in_epoch={self.step_in_epoch})"
        )


def val_batches(
    windows: Sequence[Batch],
    num_batches: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> list[Batch]:
    """A fixed validation set: this rank's share of the first windows, in order.

    Uses the first ``num_batches * micro_batch_size * dp_size`` windows; rank
    ``r`` gets the ``r``-th contiguous slice, cut into ``micro_batch_size``
    batches. With fewer windows, as many full batches as fit are used, or (if
    not even one fits) a single smaller batch of ``len(windows) // dp_size``.
    Every rank always gets the same number and shape of batches, so collective
    reductions of the validation loss line up.
    """
    _check_positive(num_batches=num_batches, micro_batch_size=micro_batch_size, dp_size=dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    n = len(windows)
    if n < dp_size:
        raise ValueError(f"validation set has {n} windows, fewer than dp_size ({dp_size}): nothing to evaluate")
    batch = micro_batch_size
    count = min(num_batches, n // (batch * dp_size))
    if count == 0:
        batch, count = n // dp_size, 1
    per_rank = batch * count
    start = dp_rank * per_rank
    return [_gather(windows, np.arange(i, i + batch)) for i in range(start, start + per_rank, batch)]


class SourceValidation:
    """Validation sets of a mixture, one per source, and the weights of the overall loss.

    The loop evaluates each set (logged as ``val_loss/<name>``) and reports as ``val_loss`` their mean
    weighted by the mixture's base weights: the loss of a validation mix in those proportions, without
    evaluating any batch twice.

    Args:
        sets: this rank's validation micro-batches of each source, by name.
        weights: each source's weight in the overall loss (normalized here).
    """

    def __init__(self, sets: Mapping[str, list[Batch]], weights: Mapping[str, float]) -> None:
        if set(sets) != set(weights):
            raise ValueError(f"validation sets {sorted(sets)} and weights {sorted(weights)} name different sources")
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("validation weights sum to 0")
        self.sets = dict(sets)
        self.weights = {name: w / total for name, w in weights.items()}

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets.values())

    def __iter__(self) -> Iterator[Batch]:
        for batches in self.sets.values():
            yield from batches

