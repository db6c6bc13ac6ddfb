"""The pipeline runtime's per-action overhead in the V schedules' simulator (trainer/planner/pipeline_sim.py):
each operation's cost plus a fixed overhead, and a delay on what crosses ranks. Synthetic figures only:
nothing here is timed."""

from __future__ import annotations

import pytest

from trainer.planner.pipeline_sim import play_v_schedule, simulate_v_schedule


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("m", [4, 8])
def test_zbv_overhead_equal_to_a_chunk_doubles_the_step(pp: int, m: int) -> None:
    # ZBV runs forwards, input- and weight-gradient passes only, each one cost unit: an overhead of one unit
    # per action makes every operation twice as long, so the played-out step doubles and the idle fraction
    # (against compute only) becomes 1 - (1 - bubble) / 2
    pure = play_v_schedule("zbv", pp, m)
    loaded = play_v_schedule("zbv", pp, m, unit=1.0, overhead=1.0)
    assert loaded.makespan == pytest.approx(2 * pure.makespan)
    assert loaded.busy == pure.busy  # the overhead is not compute
    assert loaded.idle == pytest.approx(1 - (1 - pure.idle) / 2)
    assert simulate_v_schedule("zbv", pp, m)[0] == pytest.approx(pure.idle)  # the pure bubble, unchanged


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_each_action_pays_the_overhead_once(schedule: str) -> None:
    # without compute, a rank's step is at least its own actions' overheads, and torch's order keeps the
    # ranks close to that (DualPipeV's rank 0 runs one action more than rank 1 at P = 2)
    played = play_v_schedule(schedule, 2, 8, unit=0.0, overhead=1.0)
    assert played.actions == ((24 + 11, 24 + 10) if schedule == "dualpipev" else (48, 48))
    assert max(played.actions) <= played.makespan <= max(played.actions) + 1


def test_a_message_delays_only_what_crosses_ranks() -> None:
    # P = 2 ZBV, rank 0 holds stages 0 and 3: F(1, i) waits for rank 0's F(0, i), F(3, i) for rank 1's
    # F(2, i); without compute or overhead the step is the messages on the longest chain of hand-overs
    # between the ranks: 0 -> 1 (F), 1 -> 0 (F), 0 -> 1 (gradient of stage 3), 1 -> 0 (gradient of stage 1)
    assert play_v_schedule("zbv", 2, 1, unit=0.0, overhead=0.0, message=1.0).makespan == pytest.approx(4.0)
    assert play_v_schedule("zbv", 2, 1, unit=1.0, overhead=0.0, message=0.0).makespan == pytest.approx(
        play_v_schedule("zbv", 2, 1).makespan)
