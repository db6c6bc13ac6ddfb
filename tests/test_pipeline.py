"""Pipeline parallelism: stage layout, model split, validation, and parity with the single-process run.

Parity (fp32, same global batch and seed, 10 steps, every step logged): per-step losses, logged global
gradient norms and validation losses within rtol 1e-4, final full weights (gathered from the stages)
within atol 1e-4, for pp=2 with every schedule (DualPipeV on the GPT), pp=4 with 1f1b and interleaved 1F1B,
strategy=3d at pp=2 x dp=2 with the split-backward schedules (zbv under zero1, dualpipev under fsdp, zero_bubble
under zero3), at tp=2 x pp=2 and at cp=2 x pp=2 with both V schedules, on 8 processes hybrid_shard under zbv
(pp=2 x dp=4) and dualpipev at tp=2 x pp=2 x dp=2 (fsdp), and a GPT whose output head is tied to its embedding
across the first and last stage (on two ranks, and on one: rank 0 in DualPipeV's V). Each world size is one
torchrun launch (tests/distributed_harness.py); the references run in this process.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tests.launch_pool import POOL
from trainer.plugins.strategies.pipeline import PipelineParallel, split_model, stage_indices_of_rank, stage_layer_ranges
from trainer.plugins.strategies.pipeline_schedule import v_forward_only_order
from trainer.plugins.strategies.pipeline_split import last_stage_rank
from trainer.plugins.strategies.pipeline_tied import TiedWeights
from trainer.config import compose
from trainer.models import build_meta_model
from trainer.run import build_trainer

REPO = Path(__file__).resolve().parent.parent
# 8 layers: pp=4 with 2 virtual stages still gives every stage one block.
LLAMA = ["model.dim=64", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# GPT ties its output head to the token embedding; no dropout, so the run is deterministic.
GPT = ["model=gpt2_small", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.ffn_hidden_dim=128",
       "model.vocab_size=256", "model.max_seq_len=64", "model.dropout=0.0"]
# 10 steps of 8 sequences x 32 tokens in 4 micro-batches (the pipeline's micro-batches); a given
# peak_flops skips the matmul benchmark for MFU (seconds per process on a shared 2-core machine).
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.max_steps=10",
        "trainer.log_every=1", "trainer.val_every=5", "trainer.val_batches=1", "lr_schedule.warmup_steps=2",
        "data.max_bytes=200000", "callbacks=none", "trainer.peak_flops=1e12"]
SCHEDULES = {
    "gpipe": ["strategy.schedule=gpipe"],
    "1f1b": ["strategy.schedule=1f1b"],
    "interleaved_1f1b": ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"],
    "zero_bubble": ["strategy.schedule=zero_bubble", "strategy.virtual_stages=2"],
    "zbv": ["strategy.schedule=zbv", "strategy.virtual_stages=2"],
    "dualpipev": ["strategy.schedule=dualpipev", "strategy.virtual_stages=2"],
}
RUNS = {  # world size: {run name: (model, schedule)}
    2: {name: ("llama", name) for name in SCHEDULES if name != "dualpipev"}
    # DualPipeV on the GPT: its head tied to the embedding, both on rank 0 in the V (a local tie)
    | {"gpt_tied": ("gpt", "1f1b"), "dualpipev_gpt_tied": ("gpt", "dualpipev")},
    # (the V schedules under 3d: tests/test_moe.py's tp=2 x pp=2 run; a dense one here took 36 s of the
    # suite's budget)
    4: {"1f1b": ("llama", "1f1b"), "interleaved_1f1b": ("llama", "interleaved_1f1b")},
}
# The split-backward schedules under strategy=3d (4 processes): pp=2 x dp=2 with one `replicate` flavour (zero1)
# and two whose FSDP2 units reshard after their forward, whose parameters torch's input- and weight-gradient
# passes reach only because `PrecisionStage` gathers them first; and both V schedules at tp=2 x pp=2 (a
# non-last stage's output copied before torch's split backward detaches it).
# run name: (schedule, data_parallel, micro-batch size: 8 / (micro x dp) pipeline micro-batches per step, tp)
THREE_D = {
    "3d_dp2_zero1_zbv": ("zbv", "zero1", 2, 1, 1),
    "3d_dp2_fsdp_dualpipev": ("dualpipev", "fsdp", 1, 1, 1),  # 4 micro-batches: DualPipeV's minimum 2 pp
    "3d_dp2_zero3_zero_bubble": ("zero_bubble", "zero3", 2, 1, 1),
    "3d_tp2_zbv": ("zbv", "zero1", 2, 2, 1),
    "3d_tp2_dualpipev": ("dualpipev", "zero1", 2, 2, 1),
    # the sequences cut over cp=2 (ring attention) in each stage of the V; the gradients averaged over the cp
    # ranks (zero1) or reduce-scattered over them (fsdp shards over dp x cp)
    "3d_cp2_zbv": ("zbv", "zero1", 2, 1, 2),
    "3d_cp2_fsdp_dualpipev": ("dualpipev", "fsdp", 2, 1, 2),
}
RUNS[4] |= {name: ("llama", schedule) for name, (schedule, *_) in THREE_D.items()}
# On 8 processes (the session's 8-process launch): hybrid sharding under ZBV, pp=2 x dp=4 (2 replicas x 2
# shards, 2 micro-batches per step), and DualPipeV at tp=2 x pp=2 x dp=2 under fsdp (4 micro-batches).
THREE_D_8 = {
    "3d_dp4_hybrid_shard_zbv": ("zbv", "hybrid_shard", 1, 1, 1),
    "3d_tp2_dp2_fsdp_dualpipev": ("dualpipev", "fsdp", 1, 2, 1),
}
RUNS[8] = {name: ("llama", schedule) for name, (schedule, *_) in THREE_D_8.items()}
MODELS = {"llama": LLAMA, "gpt": GPT}
PARITY = [(nproc, name) for nproc, named in RUNS.items() for name in named]


# ---- stage layout -----------------------------------------------------------------------------------
def check_partition(ranges: list[range], num_layers: int, num_stages: int) -> None:
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order, none dropped
    assert all(len(r) >= 1 for r in ranges)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (0.0, 0.0), (2.5, 6.0), (0.0, 12.0)])
def test_balanced_ranges_hold_every_layer_exactly_once(weights: tuple[float, float]) -> None:
    embedding, head = weights
    for num_layers in range(1, 25):
        for num_stages in range(1, num_layers + 1):
            ranges = stage_layer_ranges(num_layers, num_stages, embedding_weight=embedding, head_weight=head)
            check_partition(ranges, num_layers, num_stages)


def test_balancing_counts_the_embedding_and_the_head() -> None:
    assert stage_layer_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layer_ranges(8, 4, embedding_weight=0, head_weight=0) == [range(2 * s, 2 * s + 2) for s in range(4)]
    # a head worth 4 blocks: the last stage takes fewer layers (cost 4 + 2 = 6 = the first's 6)
    assert [len(r) for r in stage_layer_ranges(12, 2, embedding_weight=0, head_weight=4)] == [8, 4]
    # the slowest stage is as cheap as possible: 32 layers + 1 + 1 over 4 stages -> at most 9
    costs = [len(r) + (s == 0) + (s == 3) for s, r in enumerate(stage_layer_ranges(32, 4))]
    assert max(costs) == 9


def test_explicit_counts_are_taken_as_given_and_checked() -> None:
    assert stage_layer_ranges(8, 3, layers_per_stage=[2, 5, 1]) == [range(0, 2), range(2, 7), range(7, 8)]
    with pytest.raises(ValueError, match="sums to 7, but the model has 8 layers"):
        stage_layer_ranges(8, 3, layers_per_stage=[2, 4, 1])
    with pytest.raises(ValueError, match="has 2 entries but there are 3 stages"):
        stage_layer_ranges(8, 3, layers_per_stage=[4, 4])
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        stage_layer_ranges(8, 3, layers_per_stage=[4, 4, 0])
    with pytest.raises(ValueError, match="need at least 5 layers"):
        stage_layer_ranges(4, 5)


@functools.lru_cache(maxsize=None)
def model_config(family: str) -> Any:
    """Composed once per family (a Hydra round trip); the tests vary only n_layers."""
    return OmegaConf.to_object(compose(MODELS[family]).model)


def meta_model(family: str, num_layers: int) -> torch.nn.Module:
    return build_meta_model(dataclasses.replace(model_config(family), n_layers=num_layers))


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_split_keeps_every_layer_on_exactly_one_stage(family: str) -> None:
    combos = [(4, 2, 1), (4, 2, 2), (5, 2, 1), (7, 3, 2), (8, 4, 2), (9, 2, 3), (6, 3, 1), (12, 4, 3), (3, 3, 1)]
    for num_layers, pp, virtual in combos:
        model = meta_model(family, num_layers)
        num_stages = pp * virtual
        ranges = stage_layer_ranges(num_layers, num_stages)
        stages = {}
        for rank in range(pp):
            indices = stage_indices_of_rank(rank, pp, virtual)
            for index, part in zip(indices, split_model(model, ranges, indices), strict=True):
                stages[index] = part
        assert sorted(stages) == list(range(num_stages))
        held = [key for s in range(num_stages) for key in stages[s].layers.keys()]
        assert held == [str(i) for i in range(num_layers)], (num_layers, pp, virtual, held)
        for s, part in stages.items():
            assert list(part.layers.keys()) == [str(i) for i in ranges[s]]
            for name in model.first_stage_modules:
                assert (getattr(part, name) is not None) == (s == 0)
            for name in model.last_stage_modules:
                assert (getattr(part, name) is not None) == (s == num_stages - 1)
        # together the stages hold every weight of the model under its own name
        keys = [k for s in range(num_stages) for k in stages[s].state_dict()]
        assert sorted(keys) == sorted(model.state_dict().keys())
        assert len(model.layers) == num_layers  # the model itself is untouched


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_stages_initialize_alone_and_chain_to_the_full_forward(family: str) -> None:
    torch.manual_seed(0)
    model = meta_model(family, 5)
    ranges = stage_layer_ranges(5, 3)
    # a stage whose missing modules are None initializes on its own (sharded init of big models)
    for part in split_model(model, ranges, [0, 1, 2]):
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights()
    # split after materializing: the stages run in a chain give the unsplit model's logits
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model.eval()
    tokens = torch.randint(0, 256, (2, 16))
    hidden = tokens
    for part in split_model(model, ranges, [0, 1, 2]):
        part.eval()
        hidden = part(hidden)
    torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)


# ---- the V placement (zbv, dualpipev) -----------------------------------------------------------------
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_v_placement_is_torchs_and_puts_both_ends_on_rank_0(pp: int) -> None:
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    torchs = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
    held = {rank: stage_indices_of_rank(rank, pp, 2, v_shape=True) for rank in range(pp)}
    assert {stage: rank for rank, stages in held.items() for stage in stages} == torchs
    assert held[0] == [0, 2 * pp - 1] and last_stage_rank(pp, 2, v_shape=True) == 0
    assert last_stage_rank(pp, 2) == pp - 1  # looped: stage 2P - 1 on rank P - 1
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_indices_of_rank(0, pp, 3, v_shape=True)


def test_v_split_gives_rank_0_the_embedding_and_the_tied_head_as_two_copies() -> None:
    model = meta_model("gpt", 4)
    ranges = stage_layer_ranges(4, 4)
    first, last = split_model(model, ranges, stage_indices_of_rank(0, 2, 2, v_shape=True))
    assert (first.pp_stage_index, last.pp_stage_index) == (0, 3)
    assert first.tok_embeddings is not None and first.output is None
    assert last.tok_embeddings is None and last.output is not None
    # the checkpoint's names are the unsplit model's, whichever rank holds the stage
    assert set(first.state_dict()) | set(last.state_dict()) <= set(model.state_dict())


def test_local_tie_sums_the_two_copies_gradients_and_counts_the_mirror_once() -> None:
    torch.manual_seed(0)
    model = meta_model("gpt", 4)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    parts = split_model(model, stage_layer_ranges(4, 4), [0, 3])
    with torch.no_grad():
        parts[1].output.weight.add_(1.0)  # a sharded init draws the two copies apart
    tied = TiedWeights()
    tied.make_group(model, None, pp_size=2, last_stage_pp_rank=0)  # type: ignore[arg-type]  # no group: local
    assert tied.local and tied.group is None
    tied.find(parts, lambda m: m, num_stages=4)
    embedding, head = parts[0].tok_embeddings.weight, parts[1].output.weight
    assert tied.params == [embedding] and tied.mirrors == [head]
    tied.broadcast_from_first_stage()
    assert torch.equal(head, embedding)
    embedding.grad, head.grad = torch.full_like(embedding, 2.0), torch.full_like(head, 3.0)
    tied.sum_grads()
    assert torch.equal(embedding.grad, torch.full_like(embedding, 5.0)) and torch.equal(head.grad, embedding.grad)
    assert tied.is_mirror(head) and not tied.is_mirror(embedding)
    owners = tied.optimizer_modules(parts)[2:]
    assert [type(o) for o in owners] == [torch.nn.Embedding] and owners[0].weight is head


@pytest.mark.parametrize("pp", [2, 3])
def test_forward_only_order_over_the_v_runs_every_forward_once_with_local_turn(pp: int) -> None:
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    schedule = SimpleNamespace(stage_index_to_group_rank=generate_stage_to_rank_mapping(pp, 2 * pp, style="v"))
    order = v_forward_only_order(schedule, pp, 4)
    forwards = {(a.stage_index, a.microbatch_index): rank for rank, actions in order.items() for a in actions
                if a.computation_type.value == "F"}
    assert forwards == {(s, mb): schedule.stage_index_to_group_rank[s] for s in range(2 * pp) for mb in range(4)}
    kinds = [a.computation_type.value for actions in order.values() for a in actions]
    assert not {"I", "W", "B"} & set(kinds)
    # every stage boundary is a send and a receive per micro-batch, but the V's turn (P-1 -> P, one rank)
    assert kinds.count("SEND_F") == kinds.count("RECV_F") == (2 * pp - 2) * 4


# ---- validation -------------------------------------------------------------------------------------
def test_strategy_options_are_checked_on_creation() -> None:
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, "
                                         "dualpipev"):
        PipelineParallel(schedule="dualpipe")
    with pytest.raises(ValueError, match="schedule=1f1b runs one stage per rank"):
        PipelineParallel(schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        PipelineParallel(layers_per_stage=[4, 0])
    for schedule in ("zbv", "dualpipev"):
        for virtual in (1, 3):
            with pytest.raises(ValueError, match=f"schedule={schedule} places exactly 2 stages per rank in a V"):
                PipelineParallel(schedule=schedule, virtual_stages=virtual)


def test_pipeline_constraints() -> None:
    strategy = PipelineParallel(schedule="interleaved_1f1b", virtual_stages=2)
    strategy.validate_pipeline(num_layers=8, pp=4, num_microbatches=8)
    strategy.validate_pipeline(num_layers=8, pp=4, num_microbatches=6)  # one round: torch accepts it
    with pytest.raises(ValueError, match="runs them in max\\(1, M // pp\\) = 2 rounds"):
        strategy.validate_pipeline(num_layers=8, pp=2, num_microbatches=5)
    with pytest.raises(ValueError, match="= 3, fewer than the pp=4 pipeline stages"):
        strategy.validate_pipeline(num_layers=8, pp=4, num_microbatches=3)
    with pytest.raises(ValueError, match="4 x 2 = 8 stages need at least 8 layers, the model has 6"):
        strategy.validate_pipeline(num_layers=6, pp=4, num_microbatches=8)
    with pytest.raises(ValueError, match="trainer.compile=false"):
        PipelineParallel(schedule="zero_bubble", virtual_stages=2).validate_pipeline(
            num_layers=8, pp=2, num_microbatches=4, compile=True)
    zbv = PipelineParallel(schedule="zbv", virtual_stages=2)
    zbv.validate_pipeline(num_layers=8, pp=2, num_microbatches=3)  # no rounds: any M >= pp
    with pytest.raises(ValueError, match="schedule=zbv splits each backward"):
        zbv.validate_pipeline(num_layers=8, pp=2, num_microbatches=4, compile=True)
    with pytest.raises(ValueError, match="4 x 2 = 8 stages need at least 8 layers, the model has 6"):
        zbv.validate_pipeline(num_layers=6, pp=4, num_microbatches=8)
    dualpipev = PipelineParallel(schedule="dualpipev", virtual_stages=2)
    dualpipev.validate_pipeline(num_layers=8, pp=2, num_microbatches=4)
    with pytest.raises(ValueError, match="= 3, but schedule=dualpipev needs at least as many as its 2 x pp = 4"):
        dualpipev.validate_pipeline(num_layers=8, pp=2, num_microbatches=3)


# ---- parity with one process ----------------------------------------------------------------------------
def column(run_dir: Path, name: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


def strategy_overrides(nproc: int, name: str) -> list[str]:
    three_d = {4: THREE_D, 8: THREE_D_8}.get(nproc, {})
    if name in three_d:
        _, data_parallel, micro, tp, cp = three_d[name]
        return ["strategy=3d", "pp=2", f"tp={tp}", f"cp={cp}", f"trainer.devices={nproc}",
                f"strategy.data_parallel={data_parallel}", f"trainer.micro_batch_size={micro}"]
    return ["strategy=pp", f"pp={nproc}", f"trainer.devices={nproc}"]


for _nproc, _named in RUNS.items():
    POOL.add("pipeline", _nproc, [
        {"name": name, "overrides": MODELS[model] + LOOP + SCHEDULES[schedule] + strategy_overrides(_nproc, name)}
        for name, (model, schedule) in _named.items()
    ])


@pytest.fixture(scope="module")
def runs() -> Path:
    for nproc in RUNS:
        out = POOL.ensure(nproc, "pipeline")
    for model, overrides in MODELS.items():  # the references: one process, same global batch
        trainer = build_trainer(compose(overrides + LOOP), out / model)
        (out / model / "summary.json").write_text(json.dumps(trainer.fit()))
        torch.save(trainer.strategy.full_state_dict(trainer.model_parts), out / model / "weights.pt")
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "name"), PARITY, ids=[f"pp{n}-{s}" for n, s in PARITY])
def test_pipeline_matches_single_process(runs: Path, nproc: int, name: str) -> None:
    run_dir = runs / f"np{nproc}" / name
    reference = runs / RUNS[nproc][name][0]
    for metric in ("train_loss", "grad_norm", "val_loss"):
        expected = column(reference, metric)
        assert len(expected) == (10 if metric != "val_loss" else 2)
        assert column(run_dir, metric) == pytest.approx(expected, rel=1e-4), metric
    expected_weights = torch.load(reference / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == expected_weights.keys()
    for key, value in expected_weights.items():
        torch.testing.assert_close(weights[key], value, atol=1e-4, rtol=0, msg=f"pp={nproc} {name}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_tied", "dualpipev_gpt_tied"])
def test_tied_head_and_embedding_stay_one_weight(runs: Path, name: str) -> None:
    weights = torch.load(runs / "np2" / name / "weights.pt", weights_only=True)
    # held by the first and the last stage as two copies (on two ranks, kept bitwise equal by the gradient
    # all-reduce; in DualPipeV's V both on rank 0, by the local sum)
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])


@pytest.mark.slow
def test_every_rank_reports_and_holds_only_its_stage(runs: Path) -> None:
    summary = json.loads((runs / "np4" / "1f1b" / "summary.json").read_text())
    single = json.loads((runs / "llama" / "summary.json").read_text())
    assert summary["world_size"] == 4 and len(summary["state_bytes_per_rank"]) == 4
    held = [rank["params"] for rank in summary["state_bytes_per_rank"]]
    assert sum(held) == single["state_bytes_per_rank"][0]["params"]  # untied: the stages partition the weights
    assert max(held) < single["state_bytes_per_rank"][0]["params"] / 2


# ---- FSDP2's all-gathers under each schedule against the planner's count --------------------------------
# pp=2 x dp=2 on 4 processes, 4 micro-batches; each configuration runs 1 and 2 steps, whose difference in rank
# 0's recorded all-gathers over dp is one step's (setup, shape inference and the final weights' gather cancel).
GATHER_RUNS = {
    "gathers_gpipe": ("gpipe", "fsdp"),
    "gathers_1f1b": ("1f1b", "fsdp"),
    "gathers_interleaved_1f1b": ("interleaved_1f1b", "fsdp"),
    "gathers_zero_bubble": ("zero_bubble", "fsdp"),
    "gathers_zbv": ("zbv", "fsdp"),
    "gathers_dualpipev": ("dualpipev", "fsdp"),
    "gathers_zbv_shard_grad_op": ("zbv", "shard_grad_op"),
}
GATHER_LOOP = [o for o in LOOP if not o.startswith(("trainer.max_steps", "trainer.val_every", "trainer.micro"))] + [
    "trainer.val_every=0", "trainer.micro_batch_size=1"]


def gather_overrides(name: str) -> list[str]:
    schedule, data_parallel = GATHER_RUNS[name]
    return [*LLAMA, *GATHER_LOOP, *SCHEDULES[schedule], "strategy=3d", "pp=2", "tp=1", "trainer.devices=4",
            f"strategy.data_parallel={data_parallel}"]


POOL.add("pipeline", 4, [{"name": f"{name}_{steps}", "overrides": [*gather_overrides(name), f"trainer.max_steps={steps}"]}
                         for name in GATHER_RUNS for steps in (1, 2)], count_collectives=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GATHER_RUNS))
def test_planner_counts_the_fsdp_gathers_the_schedule_runs(name: str) -> None:
    from trainer.planner.communication import step_collectives
    from trainer.planner.core import hardware_from_config
    from trainer.planner.layout import layout_from_config, model_config
    from trainer.planner.memory import RankCoords
    from trainer.planner.params import inventory

    out = POOL.ensure(4, "pipeline") / "np4"
    calls = [json.loads((out / f"{name}_{steps}" / "summary.json").read_text())["collective_calls"] for steps in (1, 2)]
    per_step = {key: calls[1].get(key, 0) - calls[0].get(key, 0) for key in calls[1]}
    measured_gathers = sum(n for key, n in per_step.items() if key.startswith("all_gather@dp"))
    measured_reductions = sum(n for key, n in per_step.items() if key.startswith("all_reduce@dp"))
    cfg = compose(gather_overrides(name))
    inv, layout = inventory(model_config(cfg)), layout_from_config(cfg)
    planned = {c.op: c.count for c in step_collectives(inv, layout, RankCoords(pp=0), hardware_from_config(cfg))
               if c.dimension == "dp"}
    assert measured_gathers == planned["all-gather"]
    assert measured_reductions == planned["reduce-scatter"]  # gloo runs a reduce-scatter as an all-reduce
