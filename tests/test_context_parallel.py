"""Context parallelism (`cp=N`, trainer/models/context_parallel.py): the sequence layouts, the ring kernel's
gradient (also with keys and values of different widths and a softmax scale of the caller's: MLA's), the
planner's accounting, and, in three gloo launches (2, 4 and 8 processes), parity with the
single-process run for both methods, both model families and cp composed with every other dimension,
exact resume under cp=2 and a cp=2 checkpoint resumed under cp=1 and under tp x dp. The 2-process launch
also runs document masking under tp, cp (both methods) and pp."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.launch_pool import POOL
from tests.test_checkpoint import BASE, HALF, assert_exact_resume, column, exact_resume_runs, half_checkpoint
from trainer.config import compose
from trainer.models.context_parallel import (
    ContextParallel,
    _block_pairs,
    local_positions,
    sequence_chunks,
    shard_sequence,
    unshard_sequence,
)
from trainer.run import build_trainer


# ---- layouts -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_put_back_together_give_the_sequence_and_positions_name_each_token(cp: int, balanced: bool) -> None:
    sequence = torch.arange(3 * 48).view(3, 48)  # [batch, seq]: each token's value is its position
    shards = [shard_sequence(sequence, rank, cp, balanced) for rank in range(cp)]
    assert all(s.shape == (3, 48 // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards, balanced), sequence)
    for rank, shard in enumerate(shards):
        assert torch.equal(local_positions(48 // cp, rank, cp, balanced), shard[0])


def test_the_load_balanced_ring_gives_every_rank_the_same_attention_work() -> None:
    """Rank r holds chunks r and 2cp-1-r: over a pass of the ring every rank computes the same number of
    chunk pairs (diagonal ones at half cost), where a contiguous split would leave the last rank cp times
    the first one's work."""
    for cp in (2, 4, 8):
        work = []
        for rank in range(cp):
            q_ids = sequence_chunks(rank, cp, True)
            pairs = [p for step in range(cp) for p in _block_pairs(q_ids, sequence_chunks((rank - step) % cp, cp, True))]
            work.append(sum(0.5 if causal else 1.0 for _, _, causal in pairs))
        assert work == [2 * cp] * cp  # (2cp)^2 / 2 chunk-pairs' worth of the causal triangle over cp ranks
        assert sequence_chunks(0, cp, True) == (0, 2 * cp - 1)


# ---- the ring kernel on one rank ---------------------------------------------------------------------------
@pytest.fixture
def world_of_one() -> ContextParallel:
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ContextParallel(dist.group.WORLD, 0, 1, "ring")
    if owned:
        dist.destroy_process_group()


def test_ring_attention_equals_causal_attention_forward_and_backward(world_of_one: ContextParallel) -> None:
    """cp=1 still cuts the sequence into two chunks and merges three block pairs by their log-sum-exps."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, requires_grad=True)  # grouped-query: 2 K/V heads for 4 query heads
    v = torch.randn(2, 2, 16, 8, requires_grad=True)
    grad = torch.randn(2, 4, 16, 8)
    out = world_of_one.attention(q, k, v, local_attention=None)  # type: ignore[arg-type]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("documents", [False, True])
def test_ring_attention_with_a_value_width_and_softmax_scale_of_its_own(world_of_one: ContextParallel,
                                                                        documents: bool) -> None:
    """MLA's shapes (DeepSeek-V3): keys of width 24 and values of width 12 travel together, the output has
    the values' width, and the softmax scale is the caller's (0.37, not 24^-0.5): SDPA's output and
    gradients, grouped-query, with and without document masks."""
    from trainer.models.documents import document_mask

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 24, requires_grad=True)
    k = torch.randn(2, 2, 16, 24, requires_grad=True)
    v = torch.randn(2, 2, 16, 12, requires_grad=True)
    grad = torch.randn(2, 4, 16, 12)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if documents else None
    out = world_of_one.attention(q, k, v, local_attention=None, doc_ids=doc_ids, scale=0.37)  # type: ignore[arg-type]
    mask = document_mask(doc_ids, doc_ids) if doc_ids is not None else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.37,
                                              enable_gqa=True)
    assert out.shape == (2, 4, 16, 12)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    # (the first query sees itself alone: its gradient is 0, which the two kernels round up to 1.9e-6 apart)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ring_attention_gradient_with_dropout_passes_gradcheck(world_of_one: ContextParallel) -> None:
    """The blockwise math kernel (attention dropout, or not the CPU flash kernel): its hand-written backward,
    masks redrawn from each block's seed, is checked against finite differences in float64."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.manual_seed(1)
    out = world_of_one.attention(q, k, v, local_attention=None, dropout_p=0.3)  # type: ignore[arg-type]
    torch.manual_seed(1)  # the same seed is drawn again: the same masks
    assert torch.equal(out, world_of_one.attention(q, k, v, local_attention=None, dropout_p=0.3))  # type: ignore[arg-type]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)
        return world_of_one.attention(q, k, v, local_attention=None, dropout_p=0.3)  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(attention, (q, k, v))


def test_each_cp_rank_draws_its_own_dropout_masks() -> None:
    """Dropout of split activations: cp rank r's streams are offset by (tp + 1) x r (stream 0, shared by the
    tp ranks of cp rank 0, stays shared), so the ranks' tokens do not all get the same masks."""
    from trainer.models import GPTConfig, build_model
    from trainer.parallel_dims import ParallelDims
    from trainer.plugins.strategies.ddp import DDP

    masks = []
    for rank in (0, 1):
        model = build_model(GPTConfig(vocab_size=64, max_seq_len=16, dim=32, n_layers=1, n_heads=2, dropout=0.5))
        strategy = DDP()
        strategy.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=2, world_size=2)
        strategy.context_parallel = ContextParallel(None, rank, 2, "ring")  # type: ignore[arg-type]
        strategy.apply_context_parallel(model)
        streams = {m.rng_stream for m in model.modules() if hasattr(m, "rng_stream")}
        assert streams == {2 * rank}
        assert model.context_parallel is strategy.context_parallel
        torch.manual_seed(0)
        masks.append(model.emb_dropout(torch.ones(64)) == 0)
    assert not torch.equal(masks[0], masks[1])


# ---- planner --------------------------------------------------------------------------------------------------
def _plan(overrides: list[str]):
    from trainer.planner import plan

    return plan(compose(overrides + ["mode=plan"]), exact=False, search=False)


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_planner_divides_activations_by_cp_and_counts_the_attention_traffic(method: str) -> None:
    base = ["model=llama3_8b", "hardware=h100_80g", "precision=bf16", "strategy=zero3", "trainer.devices=8",
            "trainer.seq_len=32768",
            "model.max_seq_len=32768", "trainer.micro_batch_size=1", "trainer.global_batch_size=8",
            f"cp_method={method}"]
    one = _plan(base + ["cp=1"])
    for cp in (2, 4):
        result = _plan(base + [f"cp={cp}", "trainer.global_batch_size=" + str(8 // cp)])
        # every term / cp; all_to_all also keeps attention's own output beside the all-to-all's (bf16, q / tp)
        extra = 32 * (32768 // cp) * 4096 * 2 if method == "all_to_all" else 0
        blocks = result.details["activations"]["blocks_bytes"]
        assert blocks == pytest.approx(one.details["activations"]["blocks_bytes"] / cp + extra, rel=1e-9)
        assert result.cp == cp and method in result.context_parallel
        cp_traffic = [c for c in result.communication if c["dimension"] == "cp"]
        # per layer and micro-batch, 8 K/V heads of 128 over s/cp tokens in bf16
        tokens, kv = 32768 // cp, 8 * 128
        layers, m = 32, 1
        if method == "ring":
            kv_hops = m * (cp - 1) * 2 * layers
            assert [c["op"] for c in cp_traffic] == ["point-to-point", "point-to-point"]
            assert cp_traffic[0]["payload_bytes"] == kv_hops * 2 * tokens * kv * 2
            assert cp_traffic[1]["payload_bytes"] == m * cp * layers * 2 * tokens * kv * 4
        else:
            (a2a,) = cp_traffic
            assert a2a["op"] == "all-to-all" and a2a["count"] == 4 * 2 * layers * m
            assert a2a["payload_bytes"] == 2 * layers * m * tokens * (2 * 4096 + 2 * kv) * 2
        # the weights' gradients are reduce-scattered over dp x cp = 8 ranks whatever cp is
        assert {c["group_size"] for c in result.communication if c["dimension"] == "dp"} == {8}


def test_planner_all_to_all_keeps_whole_sequence_scores_for_materialized_attention() -> None:
    """GPT with materialized attention: the ring keeps no scores; all_to_all's a/cp heads see all s keys."""
    base = ["model=gpt2_small", "model.attn_impl=materialized", "strategy=ddp", "trainer.devices=4", "cp=4",
            "trainer.seq_len=1024", "trainer.micro_batch_size=1", "trainer.global_batch_size=4",
            "hardware=h100_80g", "precision=bf16"]
    ring = _plan(base + ["cp_method=ring"]).details["activations"]["per_layer_none_bytes"]
    a2a = _plan(base + ["cp_method=all_to_all"]).details["activations"]["per_layer_none_bytes"]
    s, b, a = 256, 1, 12  # tokens per rank
    # all_to_all: over all 1,024 keys, the bf16 softmax output, its dropout mask (1 byte on CUDA) and the
    # bf16 dropout output (GPT-2's attention dropout 0.1); the ring keeps only its fp32 log-sum-exp per row
    assert a2a - ring == pytest.approx(a * s * b * (1024 * (2 + 1 + 2) - 4), rel=1e-12)


@pytest.mark.beside
def test_search_finds_context_parallel_layouts_for_a_sequence_one_gpu_cannot_hold() -> None:
    from trainer.planner import plan

    overrides = ["recipe=llama3_8b_128k_64xh100", "cp=1", "tp=8"]
    result = plan(compose(overrides + ["mode=plan"]), exact=False, search=True, overrides=overrides)
    assert not result.fits  # 131,072 tokens without cp: 132 GB of activations per GPU
    assert result.suggestions
    assert any(any(c.startswith("cp=") and c != "cp=1" for c in s.changes) for s in result.suggestions)


# ---- multi-process parity ---------------------------------------------------------------------------------
# 4 layers, GQA; heads, kv heads, MLP width, vocab and the sequence divide by tp=2 and cp up to 4.
MODEL = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
GPT = ["model=gpt2_small", "model.vocab_size=256", "model.max_seq_len=32", "model.dim=64", "model.n_layers=4",
       "model.n_heads=4", "model.ffn_hidden_dim=128", "model.dropout=0.0"]
GPT_MATERIALIZED = [*GPT, "model.attn_impl=materialized"]
# STEPS steps (validation at the middle and the end): a wrong shard, mask or reduction moves the loss by 1e-3
# or more from the first step; the tolerances below were measured over 20 steps, where rounding differences
# had longer to grow, and bound these runs too.
STEPS = 4
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=16", "trainer.micro_batch_size=8", f"trainer.max_steps={STEPS}",
        "trainer.log_every=1", f"trainer.val_every={STEPS // 2}", "trainer.val_batches=1", "lr_schedule.warmup_steps=2",
        "data.max_bytes=1000000", "callbacks=none"]
A2A = ["cp_method=all_to_all"]
# name: (model, overrides, processes)
PARITY = {
    "cp2_ring": (MODEL, ["strategy=ddp", "cp=2"], 2),
    "cp2_all_to_all": (MODEL, ["strategy=ddp", "cp=2", *A2A], 2),
    "gpt_cp2_ring": (GPT, ["strategy=ddp", "cp=2"], 2),
    "gpt_materialized_cp2_all_to_all": (GPT_MATERIALIZED, ["strategy=ddp", "cp=2", *A2A], 2),
    "cp4_ring": (MODEL, ["strategy=ddp", "cp=4"], 4),
    "cp4_all_to_all": (MODEL, ["strategy=ddp", "cp=4", *A2A], 4),
    "cp2_tp2": (MODEL, ["strategy=tp", "tp=2", "cp=2"], 4),
    "gpt_cp2_tp2_all_to_all": (GPT, ["strategy=tp", "tp=2", "cp=2", *A2A], 4),
    "cp2_pp2": (MODEL, ["strategy=pp", "pp=2", "cp=2", "trainer.micro_batch_size=4"], 4),
    "cp2_zero3_dp2": (MODEL, ["strategy=zero3", "cp=2", "trainer.micro_batch_size=4"], 4),
    "cp2_zero2_dp2": (MODEL, ["strategy=zero2", "cp=2", "trainer.micro_batch_size=4"], 4),
    "cp2_zero1_dp2": (MODEL, ["strategy=zero1", "cp=2", "trainer.micro_batch_size=4"], 4),
    # hybrid sharding: 2 replicas x 2 shards x cp 2 (each replica shards over dp_shard x cp = 4 ranks)
    "cp2_hybrid_shard_dp4": (MODEL, ["strategy=fsdp", "strategy.sharding=hybrid_shard", "strategy.dp_replicate=2",
                                     "cp=2", "trainer.micro_batch_size=2"], 8),
    # 4D on 8 processes: pp2 x tp2 x cp2 (FSDP over the cp ranks), and dp2 x tp2 x cp2 for GPT blocks
    "cp2_tp2_pp2_3d": (MODEL, ["strategy=3d", "pp=2", "tp=2", "cp=2", "trainer.micro_batch_size=4"], 8),
    "gpt_cp2_tp2_dp2_3d": (GPT, ["strategy=3d", "pp=1", "tp=2", "cp=2", "strategy.data_parallel=zero1",
                                 "trainer.micro_batch_size=4"], 8),
}
REFERENCES = {"single": MODEL, "single_gpt": GPT, "single_gpt_materialized": GPT_MATERIALIZED}
# Document masking (trainer/models/documents.py) on packed documents of 3 to 40 tokens, on 2 processes:
# name: (model, overrides); the references are the single-process masked runs.
DOCUMENTS = {
    "docs_tp2": (MODEL, ["strategy=tp", "tp=2"]),
    "gpt_docs_tp2": (GPT, ["strategy=tp", "tp=2"]),
    "docs_cp2_ring": (MODEL, ["strategy=ddp", "cp=2"]),
    "docs_cp2_all_to_all": (MODEL, ["strategy=ddp", "cp=2", *A2A]),
    "docs_pp2": (MODEL, ["strategy=pp", "pp=2", "trainer.micro_batch_size=4"]),
}
DOCUMENT_REFERENCES = {"single_docs": MODEL, "single_gpt_docs": GPT}


def document_data(path: Path) -> list[str]:
    """The loop over the packed documents written at `path` (tests/test_documents.py's)."""
    # 6 steps (the tolerances below were measured over 10): a wrong mask shows from the first step; later,
    # Adam amplifies float rounding (its update m / sqrt(v) is sensitive for rarely seen tokens), and the
    # packed documents' gradients drift past 1e-4 (all_to_all: 2e-4 by step 20, while the losses still
    # agree to 2e-7)
    loop = [o for o in LOOP if not o.startswith(("data.", "trainer.max_steps", "trainer.val_every"))]
    return [*loop, "trainer.max_steps=6", "trainer.val_every=3", "data=token_file", f"data.path={path}",
            "data.document_masking=true"]
# Exact resume and resharding (the checkpoint tests' 12-step loop): cp=2 alone, then its step-6 checkpoint
# resumed under tp=2 x dp=2 (ZeRO-1 states over dp) and, in the test, under one process.
CP2 = ["strategy=ddp", "cp=2", "trainer.devices=2", "trainer.micro_batch_size=8"]
TP_DP = ["strategy=3d", "strategy.data_parallel=zero1", "tp=2", "pp=1", "trainer.devices=4",
         "trainer.micro_batch_size=4"]


def _reference_of(name: str) -> str:
    if "docs" in name:
        return "single_gpt_docs" if name.startswith("gpt") else "single_docs"
    if name.startswith("gpt_materialized"):
        return "single_gpt_materialized"
    return "single_gpt" if name.startswith("gpt") else "single"


_OUT = POOL.directory("context_parallel")
_DOCUMENTS = _OUT / "documents"


def _write_documents() -> None:
    from tests.test_documents import write_documents

    if not _DOCUMENTS.exists():
        write_documents(_DOCUMENTS)


for _nproc in (2, 4, 8):
    _batch = [{"name": name, "overrides": model + LOOP + strategy + [f"trainer.devices={_nproc}"]}
              for name, (model, strategy, procs) in PARITY.items() if procs == _nproc]
    if _nproc == 2:
        _batch += exact_resume_runs("cp2", CP2, _OUT / "np2")
        _batch += [{"name": name, "overrides": model + document_data(_DOCUMENTS) + strategy + ["trainer.devices=2"]}
                   for name, (model, strategy) in DOCUMENTS.items()]
    POOL.add("context_parallel", _nproc, _batch, prepare=_write_documents if _nproc == 2 else None)
# reads the 2-process launch's checkpoint: a launch after it
POOL.add("context_parallel", 4, [{"name": "tp_dp-from-cp2", "overrides": BASE + TP_DP + [
    f"resume={half_checkpoint(_OUT / 'np2' / 'cp2-straight')}"]}], stage=1)


@pytest.fixture(scope="module")
def runs() -> Path:
    for nproc in (2, 4, 8):
        POOL.ensure(nproc, "context_parallel")
    out = POOL.ensure(4, "context_parallel", stage=1)
    references = {name: model + LOOP for name, model in REFERENCES.items()}
    references.update({name: model + document_data(_DOCUMENTS) for name, model in DOCUMENT_REFERENCES.items()})
    for name, overrides in references.items():
        trainer = build_trainer(compose(overrides), out / name)
        trainer.fit()
        torch.save(trainer.strategy.full_state_dict(trainer.model_parts), out / name / "weights.pt")
    return out


def _column(run_dir: Path, name: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


# Tolerances of the parity tests, from the largest differences measured over each test's runs (one launch
# of each, CPU, gloo): relative per-step train losses, gradient norms and validation losses, absolute final
# weights. The parity runs (20 steps): losses within 2.6e-7 (cp2_ring, cp2_tp2, cp2_pp2), gradient norms
# 8.7e-6 (cp4_all_to_all), validation losses 1.3e-7 (cp2_zero1_dp2, cp2_zero3_dp2), weights 2.8e-5
# (gpt_cp2_ring: Adam's m / sqrt(v) amplifies rounding for rarely seen tokens; Llama runs 1.4e-5). The
# masked runs (10 steps): losses 1.7e-7, gradient norms 1.1e-6 (docs_tp2), validation losses 8.6e-8,
# weights 1.25e-5 (docs_tp2). Margins: 10x-40x; the weights keep their earlier 1e-4 (3.5x over the GPT
# parity runs, 8x over the masked ones). A wrong mask, shard or reduction moves the loss by 1e-3 or more
# from the first step.
PARITY_REL = {"train_loss": 5e-6, "grad_norm": 1e-4, "val_loss": 5e-6}
DOCUMENTS_REL = {"train_loss": 5e-6, "grad_norm": 2e-5, "val_loss": 2e-6}
WEIGHTS_ATOL = 1e-4
# Resumed runs against the straight cp=2 run's losses: 1.6e-7 (under tp x dp), 1.5e-7 (one process); 30x.
RESUMED_REL = 5e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_context_parallel_matches_the_single_process_run(runs: Path, name: str) -> None:
    """STEPS steps: per-step losses and gradient norms, validation losses and the final weights."""
    run_dir = runs / f"np{PARITY[name][2]}" / name
    single = runs / _reference_of(name)
    assert len(_column(single, "train_loss")) == STEPS
    for metric, rel in PARITY_REL.items():
        assert _column(run_dir, metric) == pytest.approx(_column(single, metric), rel=rel), metric
    reference = torch.load(single / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=WEIGHTS_ATOL, rtol=0, msg=f"{name}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_document_masking_under_tp_cp_and_pp_matches_the_single_process_run(runs: Path, name: str) -> None:
    """Packed documents kept apart: the same losses, gradient norms and weights as one process (which gives
    each document what it gets alone: tests/test_documents.py), 6 steps."""
    run_dir, single = runs / "np2" / name, runs / _reference_of(name)
    assert len(_column(single, "train_loss")) == 6
    for metric, rel in DOCUMENTS_REL.items():
        assert _column(run_dir, metric) == pytest.approx(_column(single, metric), rel=rel), metric
    reference = torch.load(single / "weights.pt", weights_only=True)
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=WEIGHTS_ATOL, rtol=0, msg=f"{name}: {key}")


@pytest.mark.slow
def test_context_parallel_exact_resume_gives_the_same_losses(runs: Path) -> None:
    """cp=2: 12 steps straight vs 6, a save, and a resume for 6 more: bitwise the same losses."""
    assert_exact_resume(runs / "np2", "cp2")


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_under_tp_x_dp(runs: Path) -> None:
    straight = column(runs / "np2" / "cp2-straight")
    resumed = column(runs / "np4" / "tp_dp-from-cp2")
    assert sorted(resumed) == list(range(HALF + 1, 2 * HALF + 1))
    assert resumed == pytest.approx({step: straight[step] for step in resumed}, rel=RESUMED_REL)


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_on_one_process(runs: Path, tmp_path: Path) -> None:
    trainer = build_trainer(compose(BASE + ["trainer.micro_batch_size=8",
                                            f"resume={half_checkpoint(runs / 'np2' / 'cp2-straight')}"]), tmp_path)
    assert trainer.step == HALF
    trainer.fit()
    straight = column(runs / "np2" / "cp2-straight")
    resumed = column(tmp_path)
    assert sorted(resumed) == list(range(HALF + 1, 2 * HALF + 1))
    assert resumed == pytest.approx({step: straight[step] for step in resumed}, rel=RESUMED_REL)
