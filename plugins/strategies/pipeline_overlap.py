"""DualPipeV's overlap: one micro-batch's expert all-to-alls behind another micro-batch's compute.

In its steady state torch's `ScheduleDualPipeV` gives each rank "overlapped" actions (`OVERLAP_F_B`): the
forward of micro-batch i on one of the rank's two stages and the full backward of micro-batch j on the other.
torch runs the two one after the other unless a function is registered for them; `ExpertOverlap.run_pair`
is that function. It runs the forward on the calling thread and the backward on a second one, and makes
them take turns at the MoE layers' all-to-all boundaries (`trainer.models.moe.ExpertCommGate`): each
boundary is a two-thread barrier, so the time between two barriers (a phase) holds one thread's all-to-all
beside the other thread's compute:

    forward:   attention | dispatch     | experts        | combine      | attention ...
    backward:  (head) combine-grad | experts-grad | dispatch-grad | attention-grad | combine-grad ...

The backward's first boundary (the start of the last layer's combine gradient) does not wait, so its
exchange runs beside the forward's first compute; when one thread is done (its stage may have fewer MoE
layers, and the forward's last combine waits for the backward's tail), the other runs on alone. This is the
scheme of DeepSeek-V3's DualPipe (technical report, 2024, section 3.2.2: attention and MLP compute of one
chunk beside the dispatch and combine of the other) and of torchtitan's DualPipeV hooks; the threads are
what a CPU process has instead of CUDA streams.

Why it is correct and cannot deadlock, and what it refuses:
- Every ep rank of a stage runs the same schedule, so its two threads reach the same boundaries in the same
  phases, and in each phase only one of them exchanges: the all-to-alls are issued in the same order on
  every rank of the ep group.
- No other collective may run inside the pair, or two threads could issue collectives on one group in an
  order that differs between ranks. So: the stages' FSDP2 / replicate units are gathered before the pair
  starts (under a pipeline the gradient reduction is the schedule's own REDUCE_GRAD action, on the main
  thread, after all backwards), and tensor parallelism (DTensor collectives in every layer), context
  parallelism (ring exchanges, the balance loss's sum over the sequence group) and activation checkpointing
  (a recompute in the backward would run the forward's all-to-alls again, on the backward's thread) are
  refused: `overlap_refusal`.
- Whichever thread ends first (or fails) breaks the barrier, so the other never waits for a partner that is
  gone; every rank does the same at the same point.

Measuring (the same gate, with or without the turns; `benchmarks/pipeline_bubble.py --moe`): `comm_s` is the
time the ranks spend between the begin and end boundaries of an exchange (forward and backward: token counts,
rows and results, and their gradients), `exposed_s` the part of it no compute of the other thread covered:
per phase, a thread's exchange time beyond the other thread's compute time in that phase. Exchanges outside
the turns (a sequential action, or after the turns stop) count as exposed in full.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch.nn as nn

from trainer.models.moe import MoE, ExpertCommGate
from trainer.plugins.strategies.pipeline_schedule import gather_stage_parameters

FORWARD, BACKWARD = "forward", "backward"


def overlap_refusal(*, schedule: str, ep: int, tp: int, cp: int, checkpointing: str) -> Optional[str]:
    """Why DualPipeV's expert overlap cannot run in this layout (None when it can)."""
    if schedule != "dualpipev":
        return f"it pairs DualPipeV's overlapped actions, and strategy.schedule={schedule}"
    if ep < 2:
        return "it hides expert-parallel all-to-alls, and ep=1 has none"
    if tp > 1:
        return (f"tp={tp}: tensor parallelism's collectives would run on both threads of a pair, in an order "
                "that can differ between ranks")
    if cp > 1:
        return (f"cp={cp}: context parallelism's exchanges would run on both threads of a pair, in an order "
                "that can differ between ranks")
    if checkpointing != "none":
        return (f"activation_checkpointing={checkpointing}: a recompute in the backward would run the forward's "
                "all-to-alls on the backward's thread")
    return None


def expert_parallel_layers(module: nn.Module) -> int:
    """How many MoE layers of a stage exchange tokens over an ep group."""
    return sum(1 for layer in module.modules() if isinstance(layer, MoE) and layer.expert_parallel is not None)


class ExpertOverlap(ExpertCommGate):
    """Times the expert all-to-alls of a pipeline step and, with `pairing`, runs DualPipeV's overlapped
    actions on two threads that take turns at the all-to-all boundaries (see the module docstring)."""

    def __init__(self, pairing: bool = True) -> None:
        self.pairing = pairing
        self.comm_s = 0.0  # seconds inside exchanges, summed over both threads
        self.exposed_s = 0.0  # of which no compute of the other thread covered
        self.waited_s = 0.0  # seconds the threads spent waiting for their partner at the turns
        self._lock = threading.Lock()
        self._local = threading.local()  # role, first_boundary, exchange_start, segment_start
        self._barrier: Optional[threading.Barrier] = None  # set while a pair takes turns
        # exchange and compute seconds of each thread in the current phase
        self._phase: dict[str, list[float]] = {FORWARD: [0.0, 0.0], BACKWARD: [0.0, 0.0]}

    def reset(self) -> None:
        with self._lock:
            self.comm_s = self.exposed_s = self.waited_s = 0.0

    # ---- the gate ---------------------------------------------------------------------------------
    def boundary(self, name: str, backward: bool) -> None:
        now = time.perf_counter()
        local = self._local
        role = getattr(local, "role", None)
        begins = self.begins_exchange(name, backward)
        if begins:
            self._add(role, compute=now - getattr(local, "segment_start", now))
        else:
            started = getattr(local, "exchange_start", None)
            if started is not None:
                self._add(role, exchange=now - started)
                local.exchange_start = None
        barrier = self._barrier
        if barrier is not None and role is not None:
            if role == BACKWARD and local.first_boundary:
                local.first_boundary = False  # its exchange runs beside the forward's first compute
            else:
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:  # the partner is done: run on alone
                    pass
                with self._lock:
                    self.waited_s += time.perf_counter() - now
        resumed = time.perf_counter()
        local.segment_start = resumed
        if begins:
            local.exchange_start = resumed

    def _add(self, role: Optional[str], *, exchange: float = 0.0, compute: float = 0.0) -> None:
        """A thread's segment that just ended: within the turns it goes to the phase, outside them an
        exchange is exposed in full (and compute covers nothing)."""
        with self._lock:
            self.comm_s += exchange
            if self._barrier is None or role is None:
                self.exposed_s += exchange
            else:
                self._phase[role][0] += exchange
                self._phase[role][1] += compute

    def _close_phase(self) -> None:
        """End of a phase (both threads at the barrier, or one of them done): each thread's exchange time
        beyond the other's compute in the phase was exposed."""
        with self._lock:
            for role, other in ((FORWARD, BACKWARD), (BACKWARD, FORWARD)):
                exchange, cover = self._phase[role][0], self._phase[other][1]
                self.exposed_s += max(0.0, exchange - cover)
            self._phase = {FORWARD: [0.0, 0.0], BACKWARD: [0.0, 0.0]}

    def _stop_turns(self) -> None:
        """One thread is done: close the open phase and let the other run on alone."""
        barrier = self._barrier
        if barrier is None:
            return
        self._close_phase()
        with self._lock:
            self._barrier = None
        barrier.abort()

    # ---- the overlapped action -----------------------------------------------------------------------
    def run_pair(self, action: Any, ctx: Any) -> None:
        """torch's OVERLAP_F_B custom function: `action.sub_actions` = (FORWARD on one stage, FULL_BACKWARD
        on the rank's other stage); their receives were posted by earlier actions of the schedule."""
        schedule = ctx.schedule_ref
        stages = {stage.stage_index: stage for stage in schedule._stages}
        forward_action, backward_action = action.sub_actions
        forward_stage, backward_stage = stages[forward_action.stage_index], stages[backward_action.stage_index]
        for stage in (forward_stage, backward_stage):
            schedule._assert_unsharded(stage)
            gather_stage_parameters(stage.submod)  # no FSDP2 collective may run inside the pair
        self._wait_inputs(schedule, stages, forward_action, backward_action)

        def run_forward() -> None:
            index, mb = forward_action.stage_index, forward_action.microbatch_index
            output = forward_stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb],
                                                     save_forward_output=False)
            schedule._maybe_compute_loss(forward_stage, output, ctx.target_mbs, mb)
            if index + 1 in stages:  # the V's turn on the last rank: a local hand-over
                stages[index + 1].set_local_fwd_input(output, mb)

        def run_backward() -> None:
            index, mb = backward_action.stage_index, backward_action.microbatch_index
            loss = schedule._maybe_get_loss(backward_stage, mb)
            schedule.backward_counter[index] += 1
            last_backward = schedule.backward_counter[index] == schedule._n_microbatches
            backward_stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last_backward)
            if index - 1 in stages:
                stages[index - 1].set_local_bwd_input(backward_stage.get_local_bwd_output(mb), mb)

        if not self.pairing or not (expert_parallel_layers(forward_stage.submod)
                                    and expert_parallel_layers(backward_stage.submod)):
            run_forward()  # torch's order when nothing is registered
            run_backward()
            return
        self._phase = {FORWARD: [0.0, 0.0], BACKWARD: [0.0, 0.0]}
        self._barrier = threading.Barrier(2, action=self._close_phase)
        errors: list[BaseException] = []
        partner = threading.Thread(target=self._take_role, args=(BACKWARD, run_backward, errors),
                                   name="dualpipev-backward", daemon=True)
        partner.start()
        self._take_role(FORWARD, run_forward, errors)
        partner.join()
        if errors:
            raise errors[0]

    def _take_role(self, role: str, work: Callable[[], None], errors: list[BaseException]) -> None:
        local = self._local
        local.role, local.first_boundary = role, True
        local.exchange_start, local.segment_start = None, time.perf_counter()
        try:
            work()
            self._add(role, compute=time.perf_counter() - local.segment_start)  # its tail
        except BaseException as error:  # noqa: BLE001 - re-raised by run_pair on the calling thread
            errors.append(error)
        finally:
            local.role = None
            self._stop_turns()  # the partner must not wait for a thread that is done

    @staticmethod
    def _wait_inputs(schedule: Any, stages: dict[int, Any], forward_action: Any, backward_action: Any) -> None:
        """The activations and gradients the two sub-actions read (torch's FORWARD and FULL_BACKWARD wait for
        them the same way; a rank's two stages of the V hand over locally, without a receive)."""
        from torch.distributed.pipelining.schedules import _wait_batch_p2p

        forward_key = (forward_action.stage_index, forward_action.microbatch_index)
        if not stages[forward_key[0]].is_first and forward_key[0] - 1 not in stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop(forward_key))
        backward_key = (backward_action.stage_index, backward_action.microbatch_index)
        if not stages[backward_key[0]].is_last and backward_key[0] + 1 not in stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop(backward_key))
