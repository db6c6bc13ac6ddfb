"""Activation-checkpointing policies change what the forward keeps for the backward, never the maths.

Parity (fp32, same seed and batches, 3 steps): every policy (full, every_n, selective, attention, offload)
gives the per-step losses and, at every step, every parameter's gradient of `none` within 1e-6 relative,
under strategy=single, fsdp (2 processes) and pp (2 processes, 1F1B, 4 micro-batches), selective also
under tp=2, and with a GPT whose dropout (on the attention probabilities and both residual branches) is
replayed by the recomputation. The multi-process runs share one torchrun launch
(tests/distributed_harness.py). Compile is not exercised here (inductor needs tens of seconds per block
graph on this machine); see docs/BENCHMARKS.md for the compiled check.
Effect: the same runs would pass if a policy did nothing, so the saved activations of one forward are
measured too (SavedActivationMeter, as benchmarks/activation_checkpointing.py does at full size): each
policy keeps what it promises and no more FLOPs run than it says.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, CheckpointWrapper
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from trainer.plugins.activation_checkpointing import (
    ACTIVATION_CHECKPOINTING_SCHEMAS,
    ActivationCheckpointing,
    ActivationOffloading,
    AttentionCheckpointing,
    EveryNthCheckpointing,
    FullCheckpointing,
)
from trainer.plugins.activation_checkpointing.accounting import SavedActivationMeter
from trainer.plugins.activation_checkpointing.offload import SaveActivationsOnHost
from trainer.plugins.strategies.pipeline import split_model
from tests.launch_pool import POOL
from trainer.callback import Callback
from trainer.config import ConfigError, compose, validate
from trainer.loss import cross_entropy_loss
from trainer.models import GPTConfig, LlamaConfig, build_meta_model
from trainer.run import build_trainer

POLICIES = ["none", "full", "every_n", "selective", "attention", "offload"]
LLAMA = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# GPT-2 style with dropout 0.1 everywhere and the materialized attention (dropout inside the core).
GPT = ["model=gpt2_small", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_hidden_dim=256",
       "model.vocab_size=256", "model.max_seq_len=64", "model.attn_impl=materialized"]
# 3 steps of 8 sequences x 32 tokens, every step logged; a given peak_flops skips the matmul benchmark.
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.max_steps=3", "trainer.log_every=1",
        "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=1", "data.max_bytes=200000",
        "callbacks=none", "trainer.peak_flops=1e12"]
STRATEGIES = {  # two processes each; micro-batch 2: accumulation 2 under fsdp, 4 pipeline micro-batches
    "fsdp": ["strategy=fsdp", "trainer.devices=2", "trainer.micro_batch_size=2"],
    "pp": ["strategy=pp", "pp=2", "trainer.devices=2", "trainer.micro_batch_size=2"],
    # selective checkpointing caches DTensor outputs of sharded matmuls and skips re-running reduce-scatters
    "tp": ["strategy=tp", "tp=2", "trainer.devices=2", "trainer.micro_batch_size=4"],
}
POLICIES_UNDER = {"fsdp": POLICIES, "pp": POLICIES, "tp": ["none", "selective"]}


class GradientRecorder(Callback):
    """Keeps every parameter's full gradient of each step (before clipping) and saves them per rank at
    the end, under the names of the unwrapped model."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_after_backward(self, trainer: Any) -> None:
        grads = {}
        for part in trainer.model_parts:
            for name, param in part.named_parameters():
                grad = param.grad
                if grad is None:
                    continue
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()  # collective: every rank walks the same parameters in order
                grads[name.replace(_CHECKPOINT_PREFIX, "")] = grad.detach().clone()
        self.steps.append(grads)

    def on_fit_end(self, trainer: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, self.directory / f"grads_rank{trainer.strategy.rank}.pt")


def overrides(model: list[str], policy: str, run_dir: Path) -> list[str]:
    return [*model, *LOOP, f"activation_checkpointing={policy}",
            f"+callbacks.grads._target_={__name__}.GradientRecorder", f"+callbacks.grads.directory={run_dir}"]


def losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def gradients(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Per step, the gradients of all ranks merged (pipeline stages hold different parameters)."""
    merged: list[dict[str, torch.Tensor]] = []
    for path in sorted(run_dir.glob("grads_rank*.pt")):
        for step, grads in enumerate(torch.load(path, weights_only=True)):
            if step == len(merged):
                merged.append({})
            merged[step].update(grads)
    return merged


def assert_same_training(run_dir: Path, reference_dir: Path) -> None:
    expected = losses(reference_dir)
    assert len(expected) == 3
    assert losses(run_dir) == pytest.approx(expected, rel=1e-6)
    actual_steps, expected_steps = gradients(run_dir), gradients(reference_dir)
    assert len(actual_steps) == len(expected_steps) == 3
    for step, (actual, reference) in enumerate(zip(actual_steps, expected_steps, strict=True)):
        assert actual.keys() == reference.keys()
        for name, grad in reference.items():
            # 1e-6 relative to the tensor's scale, so that entries near zero do not demand more than fp32 has
            torch.testing.assert_close(actual[name], grad, rtol=1e-6, atol=1e-6 * grad.abs().max().item(),
                                       msg=f"step {step + 1}, {name}")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: a second intra-op thread only adds contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- parity ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ac_single")
    # GPT: attention replays the dropout inside the core with torch.utils.checkpoint's RNG restore (as full
    # and every_n do for whole blocks), selective redraws every dropout mask in its recompute pass
    for family, model, policies in (("llama", LLAMA, POLICIES), ("gpt", GPT, ["none", "selective", "attention"])):
        for policy in policies:
            run_dir = out / family / policy
            cfg = compose(overrides(model, policy, run_dir) + ["trainer.micro_batch_size=4"])
            build_trainer(cfg, run_dir).fit()
    return out


_DISTRIBUTED = POOL.directory("activation_checkpointing") / "np2"
POOL.add("activation_checkpointing", 2, [
    {"name": f"{strategy}_{policy}", "overrides": overrides(LLAMA, policy, _DISTRIBUTED / f"{strategy}_{policy}")
     + strategy_overrides}
    for strategy, strategy_overrides in STRATEGIES.items() for policy in POLICIES_UNDER[strategy]])


@pytest.fixture(scope="module")
def distributed_runs() -> Path:
    return POOL.ensure(2, "activation_checkpointing") / "np2"


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_single_process_policy_matches_none(single_runs: Path, policy: str) -> None:
    written = OmegaConf.load(single_runs / "llama" / policy / "config.yaml")  # the run used the policy
    assert written.activation_checkpointing._target_ == ACTIVATION_CHECKPOINTING_SCHEMAS[policy]._target_
    assert_same_training(single_runs / "llama" / policy, single_runs / "llama" / "none")


@pytest.mark.parametrize("policy", ["selective", "attention"])
def test_recomputation_replays_dropout(single_runs: Path, policy: str) -> None:
    assert_same_training(single_runs / "gpt" / policy, single_runs / "gpt" / "none")


PARITY = [(strategy, policy) for strategy in STRATEGIES for policy in POLICIES_UNDER[strategy][1:]]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "policy"), PARITY, ids=[f"{s}-{p}" for s, p in PARITY])
def test_distributed_policy_matches_none(distributed_runs: Path, strategy: str, policy: str) -> None:
    assert_same_training(distributed_runs / f"{strategy}_{policy}", distributed_runs / f"{strategy}_none")


@pytest.mark.slow
def test_offload_on_cpu_says_once_that_it_changes_nothing(distributed_runs: Path) -> None:
    # once per run (fsdp and pp), from rank 0 only, although every block of every step passes through it
    said = {name: (distributed_runs / name / "train.log").read_text().count("offloading changes nothing here")
            for name in ("fsdp_offload", "pp_offload", "fsdp_none")}
    assert said == {"fsdp_offload": 1, "pp_offload": 1, "fsdp_none": 0}


# ---- what each policy keeps -------------------------------------------------------------------------------
# Built from the dataclasses directly: composing a Hydra config costs seconds on the shared machine, and the
# parity runs above already go through compose and validation for every option.
SMALL_GPT = dict(vocab_size=256, max_seq_len=64, dim=64, n_layers=4, n_heads=4, ffn_hidden_dim=256,
                 attn_impl="materialized", dropout=0.0)
SMALL_LLAMA = dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, max_seq_len=64)


def policy_from_schema(name: str, **options: Any) -> ActivationCheckpointing:
    return instantiate(OmegaConf.structured(ACTIVATION_CHECKPOINTING_SCHEMAS[name]), **options)


def measured(policy_name: str, **options: Any) -> tuple[int, int, int]:
    """(saved activation bytes, forward FLOPs, forward + backward FLOPs) of one micro-batch of a 4-block
    GPT with materialized attention (seq_len 64, where the S x S terms are a large share)."""
    model = build_meta_model(GPTConfig(**SMALL_GPT))
    policy = policy_from_schema(policy_name, **options)
    meter = SavedActivationMeter.applying(policy, model)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        with meter:
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        forward = counter.get_total_flops()
        loss.backward()
    return meter.bytes, forward, counter.get_total_flops()


@pytest.fixture(scope="module")
def footprint() -> dict[str, tuple[int, int, int]]:
    return {name: measured(name) for name in POLICIES} | {"every_4": measured("every_n", n=4)}


def test_each_policy_keeps_what_it_promises(footprint: dict[str, tuple[int, int, int]]) -> None:
    saved = {name: value[0] for name, value in footprint.items()}
    flops = {name: value[2] for name, value in footprint.items()}
    forward = footprint["none"][1]
    # full keeps only block inputs: the bulk goes, for at most one more forward of the blocks (torch stops
    # recomputing a block once the last activation its backward needs is back, so the final MLP matmul,
    # whose output only feeds the residual add, is not redone: 2/3 of a forward here)
    assert saved["full"] < 0.3 * saved["none"]
    assert 0.5 * forward < flops["full"] - flops["none"] <= forward
    # every_n sits between: every second block, then one block in four
    assert saved["full"] < saved["every_n"] < saved["every_4"] < saved["none"]
    assert flops["none"] < flops["every_4"] < flops["every_n"] < flops["full"]
    # selective recomputes no matmul; the attention core's recompute costs its two matmuls per block
    assert saved["full"] < saved["selective"] < saved["none"] and flops["selective"] == flops["none"]
    assert saved["full"] < saved["attention"] < saved["none"]
    assert 0 < flops["attention"] - flops["none"] < 0.15 * flops["none"]
    # on CPU, offloading has nowhere to move the activations to
    assert saved["offload"] == saved["none"] and flops["offload"] == flops["none"]


def test_every_n_counts_global_layers_so_pipeline_stages_agree() -> None:
    model = build_meta_model(LlamaConfig(**SMALL_LLAMA))
    first, second = split_model(model, [range(0, 2), range(2, 4)], [0, 1])
    whole = build_meta_model(LlamaConfig(**SMALL_LLAMA))
    for part in (whole, first, second):
        EveryNthCheckpointing(n=2).apply(part)
    wrapped = {name for part in (first, second) for name, block in part.layers.items()
               if isinstance(block, CheckpointWrapper)}
    assert wrapped == {name for name, block in whole.layers.items() if isinstance(block, CheckpointWrapper)}
    assert wrapped == {"1", "3"}  # the 2nd and 4th block


@pytest.mark.parametrize("policy", POLICIES)
def test_wrapped_model_keeps_its_parameter_names(policy: str) -> None:
    reference = build_meta_model(GPTConfig(**SMALL_GPT))
    model = build_meta_model(GPTConfig(**SMALL_GPT))
    policy_from_schema(policy).apply(model)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert [n.replace(_CHECKPOINT_PREFIX, "") for n, _ in model.named_parameters()] == \
        [n for n, _ in reference.named_parameters()]


def test_attention_policy_needs_an_attention_core() -> None:
    block = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no `core_attention` submodule"):
        AttentionCheckpointing().wrap_block(block, 0, 1)


def test_offload_says_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    model = build_meta_model(LlamaConfig(**SMALL_LLAMA))
    ActivationOffloading().apply(model)
    model.to_empty(device="cpu")
    model.init_weights()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        for _ in range(2):
            model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    assert [r.getMessage() for r in caplog.records].count(
        "activation_checkpointing=offload: the activations already live in CPU memory on this device; "
        "offloading changes nothing here and is skipped") == 1


def test_offload_hooks_move_activations_and_keep_leaves_in_place() -> None:
    """The accelerator path's hooks, run on CPU (where save_on_cpu's copy returns the tensor itself)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(2, 3, 8, requires_grad=True)
    mlp(x).square().sum().backward()
    expected = [t.grad.clone() for t in (x, *mlp.parameters())]
    x.grad = None
    mlp.zero_grad()

    hooks = SaveActivationsOnHost(pin_memory=False, device_type="cpu")
    offload_pack, leaves = hooks.pack_hook, {p.untyped_storage().data_ptr() for p in (x, *mlp.parameters())}
    decisions: list[tuple[bool, bool]] = []  # (is a leaf or a view of one, offloaded)

    def pack(tensor: torch.Tensor) -> Any:
        packed = offload_pack(tensor)
        decisions.append((tensor.untyped_storage().data_ptr() in leaves, packed[0]))
        return packed

    hooks.pack_hook = pack
    with hooks:
        loss = mlp(x).square().sum()
    loss.backward()
    assert {leaf for leaf, offloaded in decisions if offloaded} == {False}  # activations only, and some
    assert {leaf for leaf, offloaded in decisions if not offloaded} == {True}  # x and the weights stay
    for grad, reference in zip([t.grad for t in (x, *mlp.parameters())], expected, strict=True):
        torch.testing.assert_close(grad, reference, rtol=0, atol=0)


# ---- configuration (every option composes and validates in the parity runs above) -------------------------
@pytest.mark.parametrize(("n", "message"), [(0, "n >= 1"), (5, "checkpoints no block of a 4-layer model")])
def test_every_n_rejects_an_n_that_checkpoints_nothing(n: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        validate(compose([*LLAMA, "activation_checkpointing=every_n", f"activation_checkpointing.n={n}"]))
    assert error.value.key == "activation_checkpointing"


def test_selective_under_the_zero_bubble_schedule_fails_at_validation() -> None:
    # zero-bubble's split backward passes twice over a region; torch's selective cache serves one pass
    cfg = compose([*LLAMA, *STRATEGIES["pp"], "strategy.schedule=zero_bubble", "strategy.virtual_stages=2",
                   "activation_checkpointing=selective"])
    with pytest.raises(ConfigError, match="selective cannot run under strategy.schedule=zero_bubble") as error:
        validate(cfg)
    assert error.value.key == "activation_checkpointing"



MOE_EP = ["model=tiny_moe", "model.n_experts=4", "trainer.devices=4", "trainer.seq_len=128",
          "trainer.global_batch_size=16", "trainer.micro_batch_size=2",
          "activation_checkpointing=selective"]


@pytest.mark.parametrize("strategy", [["strategy=zero3", "ep=4"], ["strategy=3d", "pp=2", "ep=2"],
                                      ["strategy=3d", "pp=2", "ep=2", "strategy.data_parallel=ddp"]])
def test_selective_with_experts_in_their_own_fsdp_units_fails_at_validation(strategy: list[str]) -> None:
    # these trained into "profiler._record_function_enter_new ... not found in storage" in the first backward
    with pytest.raises(ConfigError, match="selective cannot run with ep=. under strategy=(zero3|3d): the experts' "
                                          "own FSDP2 unit") as error:
        validate(compose([*MOE_EP, *strategy]))
    assert error.value.key == "activation_checkpointing"


@pytest.mark.parametrize("strategy", [["strategy=ddp", "ep=4"], ["strategy=zero2", "ep=4"], ["strategy=zero3"]])
def test_selective_with_experts_that_stay_in_the_block_validates(strategy: list[str]) -> None:
    validate(compose([*MOE_EP, *strategy]))  # each trained 2 steps on 4 processes (measured)

def test_full_is_every_n_with_n_1() -> None:
    model = build_meta_model(LlamaConfig(**SMALL_LLAMA))
    EveryNthCheckpointing(n=1).apply(model)
    assert all(isinstance(block, CheckpointWrapper) for block in model.layers.values())
    assert isinstance(FullCheckpointing().wrap_block(nn.Linear(2, 2), 0, 1), CheckpointWrapper)
