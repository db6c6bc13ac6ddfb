"""The pipeline runtime's per-action overhead in the planner: the simulator's arithmetic with it, the
calibration's solve for it, and where the time model counts it (trainer/planner/pipeline_sim.py,
pipeline_overhead.py, timing.py). Synthetic figures only: nothing here is timed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainer.config import compose
from trainer.planner.calibrate import calibrated_hardware
from trainer.planner.communication import step_collectives
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import Layout, model_config
from trainer.planner.memory import RankCoords
from trainer.planner.params import inventory
from trainer.planner.pipeline_overhead import overhead_from_probe
from trainer.planner.pipeline_sim import play_v_schedule, simulate_v_schedule
from trainer.planner.timing import (estimate_time, pipeline_actions, pipeline_time, schedule_bubble,
                                    stage_compute_shares, stage_pass_fractions)


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
    assert pipeline_actions(schedule, 2, 8, 2) == max(played.actions)


def test_a_message_delays_only_what_crosses_ranks() -> None:
    # P = 2 ZBV, rank 0 holds stages 0 and 3: F(1, i) waits for rank 0's F(0, i), F(3, i) for rank 1's
    # F(2, i); without compute or overhead the step is the messages on the longest chain of hand-overs
    # between the ranks: 0 -> 1 (F), 1 -> 0 (F), 0 -> 1 (gradient of stage 3), 1 -> 0 (gradient of stage 1)
    assert play_v_schedule("zbv", 2, 1, unit=0.0, overhead=0.0, message=1.0).makespan == pytest.approx(4.0)
    assert play_v_schedule("zbv", 2, 1, unit=1.0, overhead=0.0, message=0.0).makespan == pytest.approx(
        play_v_schedule("zbv", 2, 1).makespan)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("overhead", [0.0, 2e-4, 1.5e-3])
def test_the_calibration_recovers_the_overhead_it_is_shown(schedule: str, overhead: float) -> None:
    # a synthetic probe: 50 us of compute per cost unit, 300 us per message, and a known overhead; the
    # solve must give that overhead back from the step, the busiest rank's compute and the message time
    m, unit, message = 8, 5e-5, 3e-4
    played = play_v_schedule(schedule, 2, m, unit, overhead, message)
    solved = overhead_from_probe(schedule, 2, m, step_s=played.makespan, busy_s=max(played.busy), message_s=message)
    assert solved == pytest.approx(overhead, abs=1e-9)
    # the message latency is solved out, not folded into the overhead
    assert overhead_from_probe(schedule, 2, m, played.makespan, max(played.busy), 0.0) > overhead + 1e-5


def test_the_calibration_reads_no_overhead_below_the_compute_and_messages() -> None:
    played = play_v_schedule("zbv", 2, 8, 1e-4, 0.0, 1e-4)
    assert overhead_from_probe("zbv", 2, 8, played.makespan * 0.9, max(played.busy), 1e-4) == 0.0


def test_closed_form_schedules_lengthen_every_slot_of_the_critical_path() -> None:
    # 1F1B at P = 4, M = 8: 11 slots of one forward and one backward, bubble 3/11; 16 actions per rank,
    # each 0.1 s longer: step = (8 + 1.6) x 11/8 = 13.2 s of which the pure bubble is 8 x 3/8 = 3 s
    pipe = pipeline_time("1f1b", 4, 8, 1, compute_s=8.0, action_overhead_s=0.1)
    assert (pipe.actions, pipe.bubble_s) == (16, pytest.approx(3.0))
    assert pipe.overhead_s == pytest.approx(2.2)
    assert pipe.step_s == pytest.approx(13.2)
    assert pipe.idle_fraction == pytest.approx(1 - 8 / 13.2)
    assert pipeline_time("gpipe", 4, 8, 1, 8.0, 0.1) == pipe
    # interleaved (v = 2): 2 v M actions; zero bubble: a forward, an input- and a weight-gradient pass each
    assert pipeline_actions("interleaved_1f1b", 4, 8, 2) == 32
    assert pipeline_actions("zero_bubble", 4, 8, 2) == 48
    b = schedule_bubble("zero_bubble", 4, 8, 2)
    assert pipeline_time("zero_bubble", 4, 8, 2, 8.0, 0.1).overhead_s == pytest.approx(4.8 / (1 - b))
    # no pipeline, no overhead; no overhead, the pure bubble
    assert pipeline_time("1f1b", 1, 8, 1, 8.0, 0.1).overhead_s == 0.0
    assert pipeline_time("1f1b", 4, 8, 1, 8.0, 0.0).step_s == pytest.approx(8 * 11 / 8)


def test_v_schedules_step_is_the_played_out_one() -> None:
    m, compute, overhead = 4, 2.4, 0.03
    unit = compute / (6 * m)  # six cost units per micro-batch on each rank (two chunks of F, I and W)
    for schedule in ("zbv", "dualpipev"):
        pipe = pipeline_time(schedule, 2, m, 2, compute, overhead)
        assert pipe.step_s == pytest.approx(play_v_schedule(schedule, 2, m, unit, overhead).makespan)
        assert pipe.bubble_s == pytest.approx(compute * (b := schedule_bubble(schedule, 2, m)) / (1 - b))
        assert pipe.overhead_s > pipeline_actions(schedule, 2, m) * overhead * 0.99


def _tiny(pp: int, schedule: str = "1f1b", virtual: int = 1) -> tuple:
    inv = inventory(model_config(compose(["model=tiny", "model.n_layers=4"])))
    layout = Layout(world_size=pp, dp_replicate=1, dp_shard=1, tp=1, pp=pp, strategy="pp" if pp > 1 else "single",
                    dp_flavour="none", micro_batch_size=1, global_batch_size=8, seq_len=64, schedule=schedule,
                    virtual_stages=virtual)
    return inv, layout, RankCoords.of(0, layout)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zbv", 2), ("dualpipev", 2)])
def test_estimate_time_adds_the_overhead_on_the_critical_path(schedule: str, virtual: int) -> None:
    inv, layout, coords = _tiny(2, schedule, virtual)
    quiet = HardwareConfig(pipeline_action_overhead_us=0.0)
    loaded = replace(quiet, pipeline_action_overhead_us=500.0)
    before = estimate_time(inv, layout, coords, quiet, step_collectives(inv, layout, coords, quiet), 0.5)
    after = estimate_time(inv, layout, coords, loaded, step_collectives(inv, layout, coords, loaded), 0.5)
    shares = stage_compute_shares(inv, layout)  # rank 0's compute is its stages' shares of the pipeline's
    even = after.compute_s / (2 * sum(shares[s] for s in layout.stages_of_rank(0)))
    expected = pipeline_time(schedule, 2, 8, virtual, even, 5e-4, shares, 0)
    assert expected.compute_s == pytest.approx(after.compute_s)
    assert before.pipeline_overhead_s == 0.0 and after.bubble_s == pytest.approx(before.bubble_s)
    assert after.pipeline_overhead_s == pytest.approx(expected.overhead_s)
    assert after.pipeline_overhead_s >= 16 * 5e-4  # at least the busiest rank's 16+ actions
    assert after.step_time_s - before.step_time_s == pytest.approx(after.pipeline_overhead_s)
    assert after.bubble_fraction == before.bubble_fraction  # the pure bubble stays visible as it was


def test_no_pipeline_no_overhead() -> None:
    inv, layout, coords = _tiny(1)
    hardware = HardwareConfig(pipeline_action_overhead_us=500.0)
    assert estimate_time(inv, layout, coords, hardware, [], 0.5).pipeline_overhead_s == 0.0


def _record(overhead: float | None) -> dict:
    rank = {"matmul_flops": {"fp32": 2e10}, "memory_bandwidth_bps": 5e9, "links": [],
            "pipeline_overhead_s": overhead}
    return {"ranks": [rank, dict(rank)]}


def test_the_calibrated_profile_carries_the_measured_overhead() -> None:
    base = HardwareConfig(pipeline_action_overhead_us=300.0)
    assert calibrated_hardware(base, _record(4.2e-4), 2).pipeline_action_overhead_us == pytest.approx(420.0)
    # one process runs no probe: the base's figure stays
    assert calibrated_hardware(base, _record(None), 1).pipeline_action_overhead_us == 300.0


def test_stage_costs_replace_the_equal_thirds() -> None:
    # each stage's own compute per kind (F, I, W, B): the unit costs given explicitly play out the same step;
    # one stage twice as slow lengthens it, and its rank's compute (busy) is what was given
    equal = tuple((2.0, 2.0, 2.0, 4.0) for _ in range(4))
    assert play_v_schedule("zbv", 2, 4, stage_costs=equal).makespan == pytest.approx(
        play_v_schedule("zbv", 2, 4, unit=2.0).makespan)
    slow = ((4.0, 4.0, 4.0, 8.0), *equal[1:])
    played = play_v_schedule("zbv", 2, 4, stage_costs=slow)
    assert played.makespan > play_v_schedule("zbv", 2, 4, unit=2.0).makespan
    assert played.busy == (4 * (12.0 + 6.0), 4 * 12.0)  # rank 0 holds stages 0 and 3


def _pp_layout(model: list[str], pp: int, schedule: str = "1f1b", virtual: int = 1) -> tuple:
    inv = inventory(model_config(compose(model)))
    layout = Layout(world_size=pp, dp_replicate=1, dp_shard=1, tp=1, pp=pp, strategy="pp", dp_flavour="none",
                    micro_batch_size=1, global_batch_size=8, seq_len=64, schedule=schedule, virtual_stages=virtual,
                    embedding_weight=0.0, head_weight=0.0)
    return inv, layout


def test_stage_shares_are_each_stages_blocks_and_the_head_on_the_last() -> None:
    # 8 equal blocks over 4 stages (no balancing weights: two a stage); the head's FLOPs (all of the model's
    # beyond its blocks) on the last stage
    inv, layout = _pp_layout(["model=tiny", "model.n_layers=8"], 4)
    block, total = inv.layer_flops_per_token(64)[0], inv.flops_per_token(64)
    assert inv.layer_flops_per_token(64) == [block] * 8
    head = total - 8 * block
    assert head == 6 * inv.vocab_size * inv.dim  # the untied output head's matmul
    shares = stage_compute_shares(inv, layout)
    assert shares == pytest.approx((2 * block / total,) * 3 + ((2 * block + head) / total,))
    # DeepSeek-V3's dense first block is wider than its MoE blocks' active part; the MTP module is the last
    # stage's too
    inv, layout = _pp_layout(["model=deepseek_v3_tiny"], 3)
    layers = inv.layer_flops_per_token(64)
    assert layers[0] > layers[1] == layers[2] and inv.mtp_blocks == 1
    total = inv.flops_per_token(64)
    assert stage_compute_shares(inv, layout) == pytest.approx(
        (layers[0] / total, layers[1] / total, (total - layers[0] - layers[1]) / total))


def test_the_slowest_stage_sets_a_1f1b_step() -> None:
    # P = 2, M = 4, 1 s per rank when even: stages of 0.8 s and 1.2 s (0.2 and 0.3 s a micro-batch); the
    # critical path runs both once and the slower one three times more: 0.5 + 3 x 0.3 = 1.4 s for both ranks
    for rank, compute in ((0, 0.8), (1, 1.2)):
        pipe = pipeline_time("1f1b", 2, 4, 1, 1.0, 0.0, (0.4, 0.6), rank)
        assert (pipe.compute_s, pipe.step_s) == (pytest.approx(compute), pytest.approx(1.4))
    # the overhead lengthens each of the M + P - 1 slots by a forward's and a backward's: 5 x 2 x 10 ms
    assert pipeline_time("1f1b", 2, 4, 1, 1.0, 0.01, (0.4, 0.6), 1).step_s == pytest.approx(1.5)
    # even stages are the closed form's (M + P - 1) / M
    assert pipeline_time("1f1b", 2, 4, 1, 1.0, 0.0, (0.5, 0.5), 0).step_s == pytest.approx(5 / 4)
    with pytest.raises(ValueError, match="3 stage shares for 2 stages"):
        pipeline_time("1f1b", 2, 4, 1, 1.0, 0.0, (0.2, 0.3, 0.5))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_play_each_stages_share(schedule: str) -> None:
    # 1 s a rank when even over P = 2, M = 8; stage 3 (rank 0's second, the head) heavier: each stage's
    # forward, input- and weight-gradient passes a third of its compute per micro-batch, played out
    shares = (0.24, 0.24, 0.24, 0.28)
    costs = tuple((2 * s / 8 / 3, 2 * s / 8 / 3, 2 * s / 8 / 3, 4 * s / 8 / 3) for s in shares)
    played = play_v_schedule(schedule, 2, 8, stage_costs=costs)
    first, second = (pipeline_time(schedule, 2, 8, 2, 1.0, 0.0, shares, r) for r in (0, 1))
    assert first.step_s == pytest.approx(played.makespan) and second.step_s == pytest.approx(played.makespan)
    assert (first.compute_s, second.compute_s) == (pytest.approx(1.04), pytest.approx(0.96))
    # the lighter rank waits for the heavier one, and the step is longer than at even stages
    assert second.idle_fraction > first.idle_fraction
    assert first.step_s > pipeline_time(schedule, 2, 8, 2, 1.0, 0.0).step_s


def test_estimate_time_gives_the_last_stage_the_head() -> None:
    inv, layout = _pp_layout(["model=tiny", "model.n_layers=4", "model.vocab_size=4096"], 2)
    hardware = HardwareConfig(pipeline_action_overhead_us=0.0)
    first, last = (estimate_time(inv, layout, RankCoords(pp=r), hardware, [], 0.5) for r in (0, 1))
    shares = stage_compute_shares(inv, layout)
    assert shares[1] > shares[0]
    assert last.compute_s / first.compute_s == pytest.approx(shares[1] / shares[0])
    # one pipeline: both ranks' step is the same, the lighter rank idles the difference
    assert first.compute_s + first.bubble_s == pytest.approx(last.compute_s + last.bubble_s)
    assert first.bubble_s - last.bubble_s == pytest.approx(last.compute_s - first.compute_s)


def test_the_attention_backward_is_the_input_gradient_pass() -> None:
    # per token and block: a matmul weight's forward, input gradient and weight gradient cost 2 FLOPs each;
    # the attention core (no weights) a forward A and a backward 2 A, all in the input-gradient pass
    inv, layout = _pp_layout(["model=tiny", "model.n_layers=8"], 2, "zbv", 2)
    m, a = inv.layer_matmul_params(), inv.attention_core_forward_flops_per_token(64)
    block = 6 * m + 3 * a
    assert inv.layer_flops_per_token(64)[0] == block
    fractions = stage_pass_fractions(inv, layout)
    for stage in range(3):  # two blocks each
        assert fractions[stage] == pytest.approx(((2 * m + a) / block, (2 * m + 2 * a) / block, 2 * m / block))
    head = 6 * inv.vocab_size * inv.dim  # the last stage's head: matmuls, a third in each pass
    last = 2 * block + head
    assert fractions[3] == pytest.approx(((2 * (2 * m + a) + head / 3) / last, (2 * (2 * m + 2 * a) + head / 3) / last,
                                          (2 * 2 * m + head / 3) / last))
    # zbv plays them: a heavier input-gradient pass than the equal thirds lengthens the step
    shares = stage_compute_shares(inv, layout)
    assert pipeline_time("zbv", 2, 8, 2, 1.0, 0.0, shares, 0, fractions).step_s > pipeline_time(
        "zbv", 2, 8, 2, 1.0, 0.0, shares, 0).step_s
