"""Weighted mixtures of token sources: which source each sample of a global batch comes from.

The rule is Megatron-LM's blended dataset (``megatron/core/datasets/helpers.cpp``,
``build_blending_indices``): sample ``j`` of a phase goes to the source whose count lags its target most,
``argmax_d (w_d * (j + 1) - c_d)`` with ties to the lower index, where ``c_d`` is how many of the phase's
first ``j`` samples source ``d`` got. It is deterministic (no random draw), so every data-parallel rank
computes the same global batch and takes its slice, and after ``n`` samples every source is within one
sample of ``w_d * n``. The ``k``-th sample a source gives is entry ``k mod N`` of an epoch permutation of
its windows seeded by ``(seed, source name, k div N)``: a small source is repeated, a large one is not read
to the end, as in Megatron.

A schedule (``data.schedule``) changes the weights from a given step: the count restarts at the
phase's first batch, so the new mix holds from there on. The loader's state is the position (global
batches consumed), each source's consumed count and the phase's counts and weights: a resume continues
exactly, on any data-parallel size; a resume whose configured weights for the current step differ from
the saved ones starts a new phase at the resume step (so a schedule can be added or edited between runs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.data.formats import TokenSource, open_source
from trainer.data.loader import Batch, TokenWindows, TrainLoader, _check_positive

__all__ = ["MixtureData", "MixtureLoader", "Phase", "DataSourceError", "blend"]


class DataSourceError(ValueError):
    """A bad data configuration; ``key`` names the config key (``data.sources[1].weight``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class Phase:
    """Weights (normalized) in effect from global batch ``start`` on."""

    start: int
    weights: tuple[float, ...]


def blend(weights: Sequence[float], counts: list[int], n: int) -> int:
    """Megatron's rule for the next sample: the source whose count lags ``weights * (n + 1)`` most (the
    first on a tie). ``counts`` (this phase's per-source counts, summing to ``n``) is updated in place.

    Plain Python floats: the same IEEE products as Megatron's C++ loop, and no numpy call per sample.
    """
    target = n + 1
    best, best_error = 0, weights[0] * target - counts[0]
    for d in range(1, len(weights)):
        error = weights[d] * target - counts[d]
        if error > best_error:
            best, best_error = d, error
    counts[best] += 1
    return best


def _get(node: Any, key: str, default: Any = None) -> Any:
    return node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)


class MixtureData:
    """The sources of ``data=mixture``, opened and checked, with their weights and schedule.

    Args:
        sources: ``{path, weight, name, format, vocab_size, eos_id, val_path, val_fraction}`` per source
            (``SourceConfig``); ``name`` defaults to the path's last component.
        schedule: ``{step, weights: {name: weight}}`` entries; from batch ``step`` on (0-based: the
            batch of optimizer step ``step + 1``) the named weights hold, unnamed sources get 0.

    Raises:
        DataSourceError: on a missing or malformed source, negative weights or weights summing to 0,
            sources with different vocabularies or EOS ids, a bad schedule.
    """

    def __init__(self, sources: Sequence[Any], schedule: Sequence[Any] = ()) -> None:
        if not sources:
            raise DataSourceError("data.sources", "is empty; list at least one {path, weight, name}")
        self.names: list[str] = []
        self.sources: list[TokenSource] = []
        weights = []
        for i, spec in enumerate(sources):
            key = f"data.sources[{i}]"
            path = _get(spec, "path")
            if not path or path == "???":
                raise DataSourceError(f"{key}.path", "is missing")
            name = _get(spec, "name") or Path(str(path)).name.removesuffix(".bin").removesuffix(".idx")
            if name in self.names:
                raise DataSourceError(f"{key}.name", f"'{name}' is used twice; give each source its own name")
            weight = float(_get(spec, "weight", 1.0))
            if not weight >= 0 or weight == float("inf"):
                raise DataSourceError(f"{key}.weight", f"must be a finite number >= 0, got {weight}")
            try:
                source = open_source(str(path), _get(spec, "format", "auto"), _get(spec, "vocab_size"),
                                     _get(spec, "eos_id"), _get(spec, "val_path"), float(_get(spec, "val_fraction", 0.01)))
            except (OSError, ValueError) as e:
                raise DataSourceError(key, str(e)) from None
            self.names.append(str(name))
            self.sources.append(source)
            weights.append(weight)
        first = self.sources[0]
        for i, source in enumerate(self.sources[1:], start=1):
            for attr in ("vocab_size", "eos_id"):
                if getattr(source, attr) != getattr(first, attr):
                    raise DataSourceError(
                        f"data.sources[{i}]", f"{attr} {getattr(source, attr)} of '{self.names[i]}' differs from "
                        f"{getattr(first, attr)} of '{self.names[0]}': all sources must share one tokenizer")
        self.vocab_size: int = first.vocab_size
        self.eos_id: int | None = first.eos_id
        self.base_weights = self._normalize(weights, "data.sources")
        self.phases = [Phase(0, self.base_weights)]
        last = 0
        for i, entry in enumerate(schedule):
            key = f"data.schedule[{i}]"
            step = _get(entry, "step")
            if not isinstance(step, int) or step < 0 or (i and step <= last):
                raise DataSourceError(f"{key}.step", f"must be an integer >= 0 and above the previous entry's, got {step}")
            named = dict(_get(entry, "weights") or {})
            unknown = sorted(set(named) - set(self.names))
            if unknown:
                raise DataSourceError(f"{key}.weights", f"unknown source '{unknown[0]}'; sources: {', '.join(self.names)}")
            phase_weights = self._normalize([float(named.get(n, 0.0)) for n in self.names], f"{key}.weights")
            if step == 0:
                self.phases = [Phase(0, phase_weights)]
            else:
                self.phases.append(Phase(step, phase_weights))
            last = step

    @staticmethod
    def _normalize(weights: list[float], key: str) -> tuple[float, ...]:
        for w in weights:
            if not w >= 0 or w == float("inf"):
                raise DataSourceError(key, f"weights must be finite and >= 0, got {w}")
        total = sum(weights)
        if total <= 0:
            raise DataSourceError(key, f"weights sum to {total}; at least one source needs a positive weight")
        return tuple(w / total for w in weights)

    def weights_at(self, position: int) -> tuple[float, ...]:
        """Normalized weights of the phase that holds at global batch ``position``."""
        return self.phase_at(position).weights

    def phase_at(self, position: int) -> Phase:
        """The phase that holds at global batch ``position``."""
        return [p for p in self.phases if p.start <= position][-1]

    def describe(self) -> str:
        """One line for logs: each source, its tokens and weight."""
        parts = [f"{n} {w:.3f} ({len(s.train_tokens()):,} tokens)" for n, s, w in
                 zip(self.names, self.sources, self.base_weights)]
        return f"mixture of {len(self.sources)} sources: " + ", ".join(parts)

    def __repr__(self) -> str:
        return f"MixtureData(names={self.names}, weights={self.base_weights})"


def _name_seed(name: str) -> int:
    """A stable 64-bit key per source name (not hash(): that is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class MixtureLoader(TrainLoader):
    """Endless iterator of this rank's micro-batches of a weighted mixture, one list per optimizer step.

    A ``TrainLoader``, as ``StatefulLoader`` is (with a ``position`` too): global batch ``p`` is
    ``global_batch_size`` samples whose sources follow Megatron's rule (module docstring); data-parallel
    rank ``r`` of ``D`` takes the ``r``-th contiguous slice and cuts it into micro-batches, so the union
    over ranks is the single-process batch whatever ``D``.

    Args:
        windows: each source's training windows, in the mixture's order.
        names: each source's name (seeds its permutations; keys the state).
        phases: the weights and where each set starts (``MixtureData.phases``).
        global_batch_size: samples per optimizer step over all ranks.
        micro_batch_size: samples per forward/backward pass on one rank.
        dp_rank: this process's data-parallel rank.
        dp_size: number of data-parallel ranks.
        seed: base seed of every source's epoch permutations.
    """

    def __init__(self, windows: Sequence[TokenWindows], names: Sequence[str], phases: Sequence[Phase],
                 global_batch_size: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0) -> None:
        _check_positive(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_size=dp_size)
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size "
                             f"({micro_batch_size}) * dp_size ({dp_size}) = {micro_batch_size * dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if len(windows) != len(names) or not windows:
            raise ValueError("need one name per source and at least one source")
        self.windows = list(windows)
        if len({w.seq_len for w in self.windows}) != 1:
            raise ValueError("every source's windows must have the same seq_len")
        self._seq_len = self.windows[0].seq_len
        self.names = list(names)
        self.phases = sorted(phases, key=lambda p: p.start)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self._keys = [_name_seed(n) for n in self.names]
        self.position = 0  # global batches consumed (skipped ones included)
        self.consumed = np.zeros(len(self.windows), dtype=np.int64)  # samples each source has given
        self.phase_start = 0  # the batch where the current phase's count began
        self.phase_counts = np.zeros(len(self.windows), dtype=np.int64)
        self.phase_weights = np.asarray(self._phase_at(0).weights, dtype=np.float64)
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.skip_positions: set[int] = set()
        self._last_position: int | None = None
        # Source of each sample of the last global batch (all ranks'), for logging and tests.
        self.last_sources: np.ndarray = np.zeros(0, dtype=np.int64)
        for name, w, phase_w in zip(self.names, self.windows, np.max([p.weights for p in self.phases], axis=0)):
            if phase_w > 0 and len(w) == 0:
                raise ValueError(f"source '{name}' has no training window but a positive weight")

    def _phase_at(self, position: int) -> Phase:
        return [p for p in self.phases if p.start <= position][-1]

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on this rank (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def last_position(self) -> int | None:
        """The position of the global batch the last next() returned (None before the first)."""
        return self._last_position

    def skip(self, positions: Iterable[int]) -> None:
        """Never return the global batches at these positions (consumed as if returned: later batches
        are unchanged)."""
        self.skip_positions.update(int(p) for p in positions)

    def _enter_phase(self) -> None:
        phase = self._phase_at(self.position)
        # A phase that began after the current count started (or other weights than counted with,
        # after a resume with an edited schedule): the count restarts here.
        if phase.start > self.phase_start or not np.array_equal(self.phase_weights, phase.weights):
            self.phase_start = self.position
            self.phase_counts[:] = 0
            self.phase_weights = np.asarray(phase.weights, dtype=np.float64)

    def _draw(self) -> tuple[np.ndarray, np.ndarray]:
        """Sources and per-source sample numbers of the next global batch; advances the state."""
        self._enter_phase()
        weights = self.phase_weights.tolist()
        counts = self.phase_counts.tolist()
        consumed = self.consumed.tolist()
        n = sum(counts)
        sources = np.empty(self.global_batch_size, dtype=np.int64)
        numbers = np.empty(self.global_batch_size, dtype=np.int64)
        for j in range(self.global_batch_size):
            d = blend(weights, counts, n + j)
            sources[j] = d
            numbers[j] = consumed[d]
            consumed[d] += 1
        self.phase_counts = np.asarray(counts, dtype=np.int64)
        self.consumed = np.asarray(consumed, dtype=np.int64)
        self.position += 1
        return sources, numbers

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.windows):  # keep the current epochs only
                self._perms.clear()
            rng = np.random.default_rng([self.seed % 2**64, self._keys[source], epoch])
            self._perms[key] = rng.permutation(len(self.windows[source]))
        return self._perms[key]

    def _window_index(self, source: int, number: int) -> int:
        n = len(self.windows[source])
        return int(self._permutation(source, number // n)[number % n])

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> list[Batch]:
        while self.position in self.skip_positions:
            self._draw()
        self._last_position = self.position
        sources, numbers = self._draw()
        self.last_sources = sources
        per_rank = self.global_batch_size // self.dp_size
        lo = self.dp_rank * per_rank
        src, num = sources[lo:lo + per_rank], numbers[lo:lo + per_rank]
        # This rank's samples in one gather per source, rows put back in the batch's order.
        x = torch.empty(per_rank, self._seq_len, dtype=torch.int64)
        y = torch.empty_like(x)
        for d in range(len(self.windows)):
            rows = np.flatnonzero(src == d)
            if len(rows):
                xd, yd = self.windows[d].get_batch([self._window_index(d, int(k)) for k in num[rows]])
                index = torch.from_numpy(rows)
                x[index], y[index] = xd, yd
        m = self.micro_batch_size
        return [(x[i:i + m], y[i:i + m]) for i in range(0, per_rank, m)]

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and floats (safe for ``torch.save(weights_only=True)`` and JSON)."""
        return {
            "kind": "mixture",
            "position": self.position,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "sources": list(self.names),
            "num_windows": {n: len(w) for n, w in zip(self.names, self.windows)},
            "consumed": {n: int(c) for n, c in zip(self.names, self.consumed)},
            "phase_start": self.phase_start,
            "phase_counts": {n: int(c) for n, c in zip(self.names, self.phase_counts)},
            "phase_weights": [float(w) for w in self.phase_weights],
            "consumed_samples": self.position * self.global_batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``; ``dp_size``/``micro_batch_size`` may differ from the saver's.

        The sources (by name), their sizes and the global batch size must be the saver's: a different one
        would silently change what a position means.
        """
        if state.get("kind") != "mixture":
            raise ValueError("loader state is not a mixture's (was the run started with another data config?)")
        if state["global_batch_size"] != self.global_batch_size:
            raise ValueError(f"loader state has global_batch_size={state['global_batch_size']} but this loader "
                             f"has {self.global_batch_size}")
        if list(state["sources"]) != self.names:
            raise ValueError(f"loader state has sources {list(state['sources'])} but this mixture has {self.names}")
        for name, w in zip(self.names, self.windows):
            if state["num_windows"][name] != len(w):
                raise ValueError(f"loader state has {state['num_windows'][name]} windows for source '{name}' "
                                 f"but it now has {len(w)}")
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        self.consumed = np.array([int(state["consumed"][n]) for n in self.names], dtype=np.int64)
        self.phase_start = int(state["phase_start"])
        self.phase_counts = np.array([int(state["phase_counts"][n]) for n in self.names], dtype=np.int64)
        self.phase_weights = np.asarray(state["phase_weights"], dtype=np.float64)
        self._perms.clear()

    def __repr__(self) -> str:
        return (f"MixtureLoader(sources={self.names}, global_batch_size={self.global_batch_size}, "
                f"dp_rank={self.dp_rank}, dp_size={self.dp_size}, position={self.position})")
