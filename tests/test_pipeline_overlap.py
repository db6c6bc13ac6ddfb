"""DualPipeV's expert overlap (plugins/strategies/pipeline_overlap.py): the turn-taking of the two threads, the
exposure arithmetic, and which layouts may run it. Its parity with the single process (and that it engages)
is tested in test_moe.py's 4-process launch."""

from __future__ import annotations

import threading

import pytest

from trainer.config import compose
from trainer.config.errors import ConfigError
from trainer.config.validation import validate
from trainer.plugins.strategies.pipeline_overlap import BACKWARD, FORWARD, ExpertOverlap, overlap_refusal


class _PhaseCounting(ExpertOverlap):
    """Counts the closed phases, so each segment of a thread can say in which phase it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = 0

    def _close_phase(self) -> None:
        super()._close_phase()
        self.phase += 1


# One MoE layer's exchange boundaries in the order the forward meets them (the backward: reversed); each
# exchange runs between the first and the second of a pair.
BOUNDARIES = ("dispatch", "dispatched", "combine", "combined")


def _pass(gate: _PhaseCounting, layers: int, log: list[tuple[str, int]], backward: bool) -> None:
    """The boundaries a stage's forward or backward passes, with the exchanges between them logged."""
    role, order = (BACKWARD, BOUNDARIES[::-1]) if backward else (FORWARD, BOUNDARIES)
    for _ in range(layers):
        for index, name in enumerate(order):
            gate.boundary(name, backward)
            if index % 2 == 0:
                log.append((role, gate.phase))


@pytest.mark.parametrize("forward_layers,backward_layers", [(1, 1), (2, 1), (1, 2), (3, 3)])
def test_the_threads_take_turns_so_that_only_one_exchanges_in_a_phase(forward_layers: int,
                                                                        backward_layers: int) -> None:
    """Every rank of an ep group issues its all-to-alls in the same order only if the two threads never
    exchange in the same phase; within the turns each thread exchanges in every other phase."""
    gate = _PhaseCounting()
    log: list[tuple[str, int]] = []
    gate._barrier = threading.Barrier(2, action=gate._close_phase)
    errors: list[BaseException] = []
    partner = threading.Thread(target=gate._take_role,
                               args=(BACKWARD, lambda: _pass(gate, backward_layers, log, backward=True), errors))
    partner.start()
    gate._take_role(FORWARD, lambda: _pass(gate, forward_layers, log, backward=False), errors)
    partner.join(timeout=30)
    assert not partner.is_alive() and not errors
    assert len(log) == 2 * (forward_layers + backward_layers)
    phases: dict[int, set[str]] = {}
    for role, phase in log:
        phases.setdefault(phase, set()).add(role)
    assert all(len(roles) == 1 for roles in phases.values()), sorted(phases.items())
    paired = min(forward_layers, backward_layers)
    forward_phases = [phase for role, phase in log if role == FORWARD][:2 * paired]
    backward_phases = [phase for role, phase in log if role == BACKWARD][:2 * paired]
    # the backward's first exchange runs beside the forward's first compute (phase 0), then they alternate
    assert backward_phases == [2 * i for i in range(2 * paired)]
    assert forward_phases == [2 * i + 1 for i in range(2 * paired)]
    assert gate._barrier is None  # the turns stopped when a thread was done


def test_an_exchange_is_exposed_by_what_the_other_thread_did_not_compute_beside_it() -> None:
    gate = ExpertOverlap()
    gate._barrier = threading.Barrier(2)  # within the turns: segments go to the phase
    gate._add(FORWARD, exchange=0.010)
    gate._add(BACKWARD, compute=0.004)
    gate._add(BACKWARD, exchange=0.002)
    gate._add(FORWARD, compute=0.005)
    gate._close_phase()
    # forward: 10 ms beside 4 ms of the backward's compute; backward: 2 ms beside 5 ms of the forward's
    assert gate.exposed_s == pytest.approx(0.006)
    assert gate.comm_s == pytest.approx(0.012)
    gate._barrier = None  # outside the turns an exchange is exposed in full
    gate._add(FORWARD, exchange=0.003)
    gate._add(None, exchange=0.001)
    assert gate.exposed_s == pytest.approx(0.010)
    assert gate.comm_s == pytest.approx(0.016)
    gate.reset()
    assert (gate.comm_s, gate.exposed_s, gate.waited_s) == (0.0, 0.0, 0.0)


def test_the_overlap_runs_only_where_no_other_collective_can_run_inside_a_pair() -> None:
    allowed = dict(schedule="dualpipev", ep=2, tp=1, cp=1, checkpointing="none")
    assert overlap_refusal(**allowed) is None
    for change, word in [({"schedule": "zbv"}, "schedule=zbv"), ({"ep": 1}, "ep=1"), ({"tp": 2}, "tp=2"),
                         ({"cp": 2}, "cp=2"), ({"checkpointing": "full"}, "activation_checkpointing=full")]:
        refusal = overlap_refusal(**{**allowed, **change})
        assert refusal is not None and word in refusal, (change, refusal)


MOE_3D = ["model=tiny_moe", "model.n_experts=4", "strategy=3d", "pp=2", "ep=2", "trainer.devices=4",
          "strategy.schedule=dualpipev", "strategy.virtual_stages=2", "trainer.micro_batch_size=1",
          "trainer.global_batch_size=8"]


def test_a_required_overlap_that_cannot_run_is_refused_in_one_line() -> None:
    validate(compose(MOE_3D + ["strategy.expert_overlap=true"]))  # runs
    with pytest.raises(ConfigError, match=r"strategy\.expert_overlap.*activation_checkpointing=full"):
        validate(compose(MOE_3D + ["strategy.expert_overlap=true", "activation_checkpointing=full"]))
    validate(compose(MOE_3D + ["activation_checkpointing=full"]))  # off by default
    with pytest.raises(ConfigError, match=r"strategy\.expert_overlap.*schedule=zbv"):
        validate(compose(MOE_3D + ["strategy.schedule=zbv", "strategy.expert_overlap=true"]))
