"""Data-parallel strategies in 2 and 4 gloo processes against the single-process run.

Parity: same global batch and seed give the same per-step losses (rtol 1e-5) and final weights
(atol 1e-5). Accounting: the bytes each rank holds follow the ZeRO stages.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.launch_pool import POOL
from trainer.config import compose
from trainer.run import build_trainer

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# STEPS steps of 16 sequences x 32 tokens; val at the middle and the end, every step's loss logged.
STEPS = 10
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=16", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
        f"trainer.val_every={STEPS // 2}", "trainer.val_batches=1", "lr_schedule.warmup_steps=2", "data.max_bytes=1000000",
        "callbacks=none"]
# (name, strategy overrides, processes); micro-batch = 16 / (2 x dp) gives accumulation 2 everywhere
STRATEGIES = {
    2: ["ddp", "zero1", "zero2", "zero3", "fsdp_full", "fsdp_grad_op", "zero3_offload", "zero1_offload",
        "zero2_offload", "zero3_optimizer_offload", "ddp_fp16", "ddp_powersgd", "zero3_reduce_per_step",
        "zero3_reduce_per_microbatch", "zero1_small_buckets"],
    4: ["ddp", "zero1", "zero2", "zero3", "fsdp_full", "fsdp_grad_op", "fsdp_hybrid"],
}
STRATEGY_OVERRIDES = {
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero1"],
    "zero2": ["strategy=zero2"],
    "zero3": ["strategy=zero3"],
    "fsdp_full": ["strategy=fsdp", "strategy.sharding=full_shard"],
    "fsdp_grad_op": ["strategy=fsdp", "strategy.sharding=shard_grad_op"],
    "fsdp_hybrid": ["strategy=fsdp", "strategy.sharding=hybrid_shard", "strategy.dp_replicate=2"],
    # on CPU offloading has nothing to move: it must say so and change nothing
    "zero3_offload": ["strategy=zero3", "strategy.offload_params=true", "strategy.offload_optimizer=true"],
    # ZeRO-Offload: the optimizer steps host copies of this rank's partition (on CPU, the same memory)
    "zero1_offload": ["strategy=zero1", "strategy.offload_optimizer=true"],
    # the all-gather after the step in buckets of 10 KB: one per few tensors instead of one for the model
    "zero1_small_buckets": ["strategy=zero1", "strategy.bucket_cap_mb=0.01"],
    "zero2_offload": ["strategy=zero2", "strategy.offload_optimizer=true"],
    "zero3_optimizer_offload": ["strategy=zero3", "strategy.offload_optimizer=true"],
    # accumulation: one reduce-scatter per step, parameters kept gathered between the micro-batches (what
    # grad_sync=auto, the default, chooses here: it fits), or a reduce-scatter after every micro-batch
    "zero3_reduce_per_step": ["strategy=zero3", "strategy.grad_sync=step", "strategy.reshard_after_backward=false"],
    "zero3_reduce_per_microbatch": ["strategy=zero3", "strategy.grad_sync=microbatch"],
    # gradient compression changes the gradients, so these are checked for training, not parity
    "ddp_fp16": ["strategy=ddp", "strategy.comm_hook=fp16"],
    "ddp_powersgd": ["strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd_start_iter=2"],
}
COMPRESSED = {"ddp_fp16", "ddp_powersgd"}


def losses(run_dir: Path, column: str = "train_loss") -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[column]) for r in csv.DictReader(f) if r.get(column)]


# One run per strategy and world size, in the session's shared launches (tests/launch_pool.py).
for _nproc, _names in STRATEGIES.items():
    POOL.add("strategies", _nproc, [{"name": name, "overrides": MODEL + LOOP + STRATEGY_OVERRIDES[name] + [
        f"trainer.devices={_nproc}", f"trainer.micro_batch_size={16 // (2 * _nproc)}"]} for name in _names],
        count_collectives=True)


@pytest.fixture(scope="module")
def runs() -> Path:
    for nproc in STRATEGIES:
        POOL.ensure(nproc, "strategies")
    out = POOL.directory("strategies")
    # the single-process reference, same global batch (16) as 2 micro-batches of 8
    reference = build_trainer(compose(MODEL + LOOP + ["trainer.micro_batch_size=8"]), out / "single")
    reference.fit()
    torch.save(reference.strategy.full_state_dict(reference.model_parts), out / "single" / "weights.pt")
    return out


PARAMS = [(nproc, name) for nproc, names in STRATEGIES.items() for name in names if name not in COMPRESSED]


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "name"), PARAMS, ids=[f"{n}-{s}" for n, s in PARAMS])
def test_losses_and_weights_match_single_process(runs: Path, nproc: int, name: str) -> None:
    run_dir = runs / f"np{nproc}" / name
    expected = losses(runs / "single")
    assert len(expected) == STEPS
    assert losses(run_dir) == pytest.approx(expected, rel=1e-5)
    # Adam hides a constant gradient scale from the losses; the global norm does not
    assert losses(run_dir, "grad_norm") == pytest.approx(losses(runs / "single", "grad_norm"), rel=1e-5)
    reference = torch.load(runs / "single" / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=0, msg=f"{name} on {nproc}: {key}")


@pytest.mark.slow
def test_zero3_reduces_once_per_step_when_it_fits_or_when_asked(runs: Path) -> None:
    """zero3 with grad_sync=microbatch reduce-scatters every FSDP unit's gradients after each of the 2
    micro-batches of a step; grad_sync=step once per step (the same losses and weights: the parity test
    above), and with reshard_after_backward=false the second micro-batch's forward gathers nothing again.
    The default, grad_sync=auto, chose the latter here (the whole tiny model fits) and wrote it into the
    run's config. (gloo records a reduce-scatter as an all-reduce of the whole input.)"""
    every = json.loads((runs / "np2" / "zero3_reduce_per_microbatch" / "summary.json").read_text())
    once = json.loads((runs / "np2" / "zero3_reduce_per_step" / "summary.json").read_text())
    auto = json.loads((runs / "np2" / "zero3" / "summary.json").read_text())
    units, steps = every["fsdp_units"], STEPS
    assert units == once["fsdp_units"] == 3  # 2 blocks and the root
    assert every["collective_calls"]["all_reduce@dp_shard"] == units * 2 * steps
    assert once["collective_calls"]["all_reduce@dp_shard"] == units * steps
    assert once["collective_calls"]["all_gather@dp_shard"] < every["collective_calls"]["all_gather@dp_shard"]
    assert auto["collective_calls"] == once["collective_calls"]
    recorded = yaml.safe_load((runs / "np2" / "zero3" / "config.yaml").read_text())["strategy"]
    assert (recorded["grad_sync"], recorded["reshard_after_backward"]) == ("step", False)


def held(runs: Path, name: str, kind: str) -> list[int]:
    summary = json.loads((runs / "np4" / name / "summary.json").read_text())
    return [rank[kind] for rank in summary["state_bytes_per_rank"]]


@pytest.mark.slow
def test_zero_stages_shard_what_they_promise_on_4_ranks(runs: Path) -> None:
    """ZeRO (Rajbhandari et al. 2020): stage 1 shards optimizer states, 2 adds gradients, 3 parameters."""
    ddp = {kind: held(runs, "ddp", kind) for kind in ("params", "grads", "optimizer")}
    assert len(set(ddp["params"])) == 1 and ddp["optimizer"][0] == 2 * ddp["params"][0]  # Adam: m and v

    def quarter(values: list[int], full: int) -> None:
        for value in values:
            assert value == pytest.approx(full / 4, rel=0.02), (values, full)

    quarter(held(runs, "zero1", "optimizer"), ddp["optimizer"][0])
    assert held(runs, "zero1", "params") == ddp["params"] and held(runs, "zero1", "grads") == ddp["grads"]
    # textbook ZeRO-2: the whole parameters on every rank, a quarter of the gradients and optimizer states
    assert held(runs, "zero2", "params") == ddp["params"]
    quarter(held(runs, "zero2", "grads"), ddp["grads"][0])
    quarter(held(runs, "zero2", "optimizer"), ddp["optimizer"][0])
    quarter(held(runs, "zero3", "params"), ddp["params"][0])
    quarter(held(runs, "zero3", "grads"), ddp["grads"][0])
    # hybrid 2 x 2: each rank holds half (sharded over 2, replicated over 2)
    for value in held(runs, "fsdp_hybrid", "params"):
        assert value == pytest.approx(ddp["params"][0] / 2, rel=0.02)


@pytest.mark.slow
def test_each_rank_reads_distinct_data_and_summary_has_every_rank(runs: Path) -> None:
    summary = json.loads((runs / "np4" / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 4 and len(summary["peak_memory_bytes_per_rank"]) == 4
    assert all(m > 0 for m in summary["peak_memory_bytes_per_rank"])


@pytest.mark.slow
def test_compressed_gradients_train_close_to_exact(runs: Path) -> None:
    exact = losses(runs / "single")
    for name in sorted(COMPRESSED):
        compressed = losses(runs / "np2" / name)
        assert len(compressed) == STEPS and compressed[-1] < compressed[0] - 0.5, (name, compressed)
        assert compressed != exact, f"{name}: the hook did not change the gradients"
        # same data, same init: the curves stay close (PowerSGD rank 1 is the coarser approximation)
        gap = max(abs(a - b) / b for a, b in zip(compressed, exact, strict=True))
        assert gap < (0.002 if name == "ddp_fp16" else 0.05), (name, gap)


@pytest.mark.slow
def test_offload_on_cpu_says_once_that_it_changes_nothing(runs: Path) -> None:
    logs = {name: (runs / "np2" / name / "train.log").read_text().count("offloading changes nothing here")
            for name in STRATEGIES[2]}
    assert logs == {name: int(name == "zero3_offload") for name in STRATEGIES[2]}


@pytest.mark.slow
def test_data_parallel_strategies_train_on_one_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config meant for N devices runs on 1 (`python -m trainer strategy=zero3 trainer.devices=1`):
    ddp, zero1 and zero3 (FSDP2) over a process group of one give the single-process losses. (It used to
    fail: no RANK for the env:// rendezvous, and no data-parallel mesh dimension to wrap over.)"""
    from trainer.config import compose
    from trainer.run import train

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # a plain CLI run
        monkeypatch.delenv(name, raising=False)
    overrides = [*MODEL, "trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
                 "trainer.max_steps=3", "trainer.log_every=1", "trainer.val_every=0", "lr_schedule.warmup_steps=1",
                 "data.max_bytes=200000", "trainer.peak_flops=1e12", "callbacks=none"]

    def losses(run_dir: Path) -> list[float]:
        with open(run_dir / "metrics.csv") as f:
            return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]

    train(compose(overrides), tmp_path / "single")
    assert len(losses(tmp_path / "single")) == 3
    for strategy in ("ddp", "zero1", "zero3"):
        summary = train(compose([*overrides, f"strategy={strategy}", "trainer.devices=1"]), tmp_path / strategy)
        assert summary["steps"] == 3 and summary["world_size"] == 1
        assert losses(tmp_path / strategy) == pytest.approx(losses(tmp_path / "single"), rel=1e-6), strategy


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_optimizer_offload_steps_host_copies_and_changes_no_loss(strategy: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`offload_optimizer=true` alone: the parameters (and the forward/backward) stay where they are, the
    optimizer steps copies of this rank's partition in host memory, so every optimizer state lives there,
    in storage of its own; the losses are those of the run without offload, bitwise."""
    import gc

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # a plain CLI run
        monkeypatch.delenv(name, raising=False)
    overrides = [*MODEL, "trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
                 "trainer.max_steps=3", "trainer.log_every=1", "trainer.val_every=0", "lr_schedule.warmup_steps=1",
                 "data.max_bytes=200000", "trainer.peak_flops=1e12", "callbacks=none", f"strategy={strategy}",
                 "trainer.devices=1"]

    def run(extra: list[str], name: str) -> tuple[list[float], list[tuple[str, int]], set[int]]:
        trainer = build_trainer(compose(overrides + extra), tmp_path / name)
        trainer.fit()
        param_storages = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                          for part in trainer.model_parts for p in part.parameters()}
        states = [(v.to_local() if hasattr(v, "to_local") else v) for state in trainer.optimizer.state.values()
                  for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        stepped = [(t.to_local() if hasattr(t, "to_local") else t) for g in trainer.optimizer.param_groups
                   for t in g["params"]]
        where = [(t.device.type, t.untyped_storage().data_ptr()) for t in states + stepped]
        strategy_ = trainer.strategy
        del trainer
        gc.collect()
        strategy_.teardown()
        return losses(tmp_path / name), where, param_storages

    plain, plain_where, plain_params = run([], "plain")
    offloaded, where, params = run(["strategy.offload_optimizer=true"], "offloaded")
    assert offloaded == plain
    assert where and all(device == "cpu" and storage not in params for device, storage in where)
    # without offload the optimizer steps views of the parameters themselves
    assert any(storage in plain_params for _, storage in plain_where)


@pytest.mark.parametrize("rows", [8, 7, 5, 1])
def test_updated_rows_are_written_back_in_rank_order(rows: int) -> None:
    """ZeRO-1/2's all-gather hands every rank each rank's Shard(0) chunk padded to the full chunk size;
    writing them back gives the whole parameter, also when the rows do not divide evenly (padding)."""
    from trainer.parallel_dims import shard_rows
    from trainer.plugins.strategies.ddp import _chunk_numel, _write_chunks

    world = 4
    whole = torch.randn(rows, 3)
    size = _chunk_numel(whole, world)
    chunks = torch.full((world, size), float("nan"))  # padding that must never be read
    for rank in range(world):
        mine = shard_rows(whole, rank, world).reshape(-1)
        chunks[rank, :mine.numel()] = mine
    target = torch.zeros(rows, 3)
    _write_chunks(target, chunks)
    assert torch.equal(target, whole)


def _gather_worker(rank: int, world: int, init_file: str) -> None:
    """Each rank overwrites its Shard(0) rows with rank-specific values; after the gather every rank must
    hold every rank's rows (uneven rows, a non-contiguous tensor, two dtypes, several buckets)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel_dims import shard_rows
    from trainer.plugins.strategies.ddp import ShardedOptimizerStates

    torch.set_num_threads(1)  # a forked child: no intra-op pool to share with the parent's
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        base = torch.zeros(5, 7)
        params = [torch.nn.Parameter(torch.zeros(rows, 3)) for rows in (7, 5, 1, 3)]
        params.append(torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64)))
        params.append(torch.nn.Parameter(base.t()))  # non-contiguous: 7 rows of a transposed buffer
        states = ShardedOptimizerStates(mesh, torch.device("cpu"), bucket_cap_mb=100 / 2**20)  # 100-byte buckets
        views = [states._sharded_view(param) for param in params]

        def expected(param: torch.Tensor) -> torch.Tensor:
            whole = torch.empty_like(param.data)
            for r in range(world):
                shard_rows(whole, r, world).copy_(torch.arange(shard_rows(whole, r, world).numel())
                                                  .view(shard_rows(whole, r, world).shape) + 100 * (r + 1) + step)
            return whole

        for step in range(3):  # the plans are built once, then reused
            for view in views:
                mine = view.to_local()
                mine.copy_(torch.arange(mine.numel()).view(mine.shape) + 100 * (rank + 1) + step)
            states._gather_updated_rows()
            for param in params:
                assert torch.equal(param.data, expected(param)), (rank, step, param.data)
        assert len(states._gather_plans) > 2
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_updated_rows_all_gather_with_uneven_rows_on_three_ranks(tmp_path: Path) -> None:
    """ZeRO-1/2's in-place all-gather of the updated rows (trainer's `_GatherPlan`) on 3 gloo processes,
    forked (0.3 s, against 12 s for spawned processes that import everything again)."""
    import torch.multiprocessing as mp

    mp.start_processes(_gather_worker, args=(3, str(tmp_path / "init")), nprocs=3, join=True, start_method="fork")
