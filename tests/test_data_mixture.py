"""Weighted mixtures (`data=mixture`): shares, the dp-size-independent sample order, exact resume across
stops and schedule changes, per-source validation, and the one-line errors of bad data configs; the
Megatron and nanoGPT readers train like our own format."""

from __future__ import annotations

import csv
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.data.prepare as prep
from trainer.data import MixtureData, MixtureLoader, TokenFileDataset, TokenWindows
from trainer.data.mixture import DataSourceError, Phase

SEQ = 4
SIZES = (50, 120, 333)  # windows per source: small ones repeat (new epochs), as in Megatron


def windows() -> list[TokenWindows]:
    # Source d's tokens are d * 100_000 + position: a sample's first token names its source and window.
    return [TokenWindows(np.arange(d * 100_000, d * 100_000 + n * SEQ + 1, dtype=np.int64), SEQ)
            for d, n in enumerate(SIZES)]


NAMES = ["web", "code", "books"]


def loader(phases: list[Phase], dp_rank: int = 0, dp_size: int = 1, gbs: int = 16, mbs: int = 2) -> MixtureLoader:
    return MixtureLoader(windows(), NAMES, phases, gbs, mbs, dp_rank=dp_rank, dp_size=dp_size, seed=7)


def global_batches(loaders: list[MixtureLoader], steps: int) -> list[torch.Tensor]:
    """The global batch of each step: every rank's micro-batches, in rank order, stacked."""
    out = []
    for _ in range(steps):
        per_rank = [torch.cat([x for x, _ in next(ld)]) for ld in loaders]
        out.append(torch.cat(per_rank))
    return out


def ranks(phases: list[Phase], dp: int, state: dict | None = None) -> list[MixtureLoader]:
    lds = [loader(phases, r, dp) for r in range(dp)]
    for ld in lds:
        if state is not None:
            ld.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    return lds


BASE = [Phase(0, (0.5, 0.3, 0.2))]
SCHEDULED = [Phase(0, (0.5, 0.3, 0.2)), Phase(14, (0.1, 0.1, 0.8))]


def sample_sources(batch: torch.Tensor) -> np.ndarray:
    """The source of each sample (row) of a global batch, read from its tokens (`windows`: source d's
    tokens are d * 100_000 + position); every token of a row must name the same source."""
    sources = batch.div(100_000, rounding_mode="floor")
    assert bool((sources == sources[:, :1]).all()), "a sample mixes sources"
    return sources[:, 0].numpy()


def test_shares_over_1000_global_batches_are_within_1_percent() -> None:
    for weights in [(0.5, 0.3, 0.2), (0.9, 0.07, 0.03), (1 / 3, 1 / 3, 1 / 3), (0.0, 0.25, 0.75)]:
        ld = loader([Phase(0, weights)])
        counts = np.zeros(3)
        for _ in range(1000):
            (batch,) = global_batches([ld], 1)
            sources = sample_sources(batch)
            assert np.array_equal(sources, ld.last_sources)  # the loader's own record agrees with the content
            counts += np.bincount(sources, minlength=3)
        shares = counts / counts.sum()
        assert np.all(np.abs(shares - weights) < 0.01), (weights, shares)
        # Megatron's rule is exact: every source within one sample of its target at any point
        assert np.all(np.abs(counts - np.array(weights) * counts.sum()) <= 1), counts


def test_sample_sequence_is_the_same_for_dp_1_2_4_and_across_a_schedule_change() -> None:
    reference = global_batches(ranks(SCHEDULED, 1), 30)
    for dp in (2, 4):
        other = global_batches(ranks(SCHEDULED, dp), 30)
        assert all(torch.equal(a, b) for a, b in zip(reference, other, strict=True)), dp
    sources = [np.bincount(sample_sources(torch.cat(reference[s:e])), minlength=3) for s, e in ((0, 14), (14, 30))]
    assert np.allclose(sources[0] / sources[0].sum(), (0.5, 0.3, 0.2), atol=1 / 200)
    assert np.allclose(sources[1] / sources[1].sum(), (0.1, 0.1, 0.8), atol=1 / 200)  # the new mix from step 14
    # The samples are the windows: every source is read through a permutation, repeated by epochs. In the
    # order a source gives its samples (batch by batch, row by row), each run of len(windows) samples is a
    # shuffled permutation of all its windows, the next run another one, and the last (partial) run repeats
    # no window.
    samples = torch.cat(reference)
    origin = sample_sources(samples)
    for d, n in enumerate(SIZES):
        rows = samples[origin == d]
        offset = rows[:, 0] - d * 100_000
        assert bool((offset % SEQ == 0).all()) and bool((rows == rows[:, :1] + torch.arange(SEQ)).all())
        order = (offset // SEQ).tolist()  # window index of each sample, in the order the source gave them
        epochs = [order[i:i + n] for i in range(0, len(order), n)]
        for epoch in epochs:
            assert len(set(epoch)) == len(epoch) and set(epoch) <= set(range(n)), (d, epoch)
        full = [e for e in epochs if len(e) == n]
        assert all(e != sorted(e) for e in full), d  # shuffled, not read in order
        assert all(a != b for a, b in zip(full[:-1], full[1:], strict=True)), d  # a new permutation per epoch
        if d == 0:  # the smallest source is read 2.7 times over here: the repetition is exercised
            assert len(order) > 2 * n and len(full) == 2, len(order)


@pytest.mark.parametrize("stop", [0, 1, 7, 13, 14, 15, 29])
def test_stop_and_resume_at_any_step_on_another_dp_size_replays_the_same_samples(stop: int) -> None:
    reference = global_batches(ranks(SCHEDULED, 1), 30)
    first = ranks(SCHEDULED, 2)
    before = global_batches(first, stop)
    state = first[0].state_dict()
    assert state == first[1].state_dict()  # rank-independent
    after = global_batches(ranks(SCHEDULED, 4, state), 30 - stop)
    assert all(torch.equal(a, b) for a, b in zip(reference, before + after, strict=True))


def test_schedule_added_at_resume_starts_its_mix_there() -> None:
    first = ranks(BASE, 1)
    global_batches(first, 10)
    state = first[0].state_dict()
    edited = [Phase(0, (0.5, 0.3, 0.2)), Phase(4, (0.0, 0.0, 1.0))]  # an entry whose step has passed
    one, two = (global_batches(ranks(edited, dp, state), 5) for dp in (1, 2))
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert bool((torch.cat(one)[:, 0] >= 200_000).all())  # from the resume step on: books only


def test_skipped_positions_are_consumed_not_returned() -> None:
    reference = global_batches(ranks(BASE, 1), 6)
    lds = ranks(BASE, 2)
    for ld in lds:
        ld.skip([2, 3])
    got = global_batches(lds, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, reference[:2] + reference[4:], strict=True))
    assert lds[0].last_position == 5


def test_load_state_refuses_another_mixture() -> None:
    state = loader(BASE).state_dict()
    other = MixtureLoader(windows()[:2], NAMES[:2], [Phase(0, (0.5, 0.5))], 16, 2)
    with pytest.raises(ValueError, match="sources"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=16"):
        loader(BASE, gbs=8).load_state_dict(state)


# --------------------------------------------------------------------------- sources and config errors


def token_dir(tmp_path: Path, name: str, docs: int = 60, append_eos: bool = True, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, size=30))}) + "\n" for _ in range(docs)))
    prep.prepare([str(src)], str(tmp_path / name), val_fraction=0.2, append_eos=append_eos)
    return tmp_path / name


def test_mixture_data_checks(tmp_path: Path) -> None:
    a, b = token_dir(tmp_path, "a"), token_dir(tmp_path, "b", seed=1)
    mix = MixtureData([{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1, "name": "bee"}],
                      [{"step": 5, "weights": {"bee": 1}}])
    assert mix.names == ["a", "bee"] and mix.base_weights == (0.75, 0.25) and mix.vocab_size == 257
    assert mix.weights_at(4) == (0.75, 0.25) and mix.weights_at(5) == (0.0, 1.0)
    cases = [
        ([{"path": str(a), "weight": 1}, {"path": str(a), "weight": 1}], [], "data.sources[1].name: 'a' is used twice"),
        ([{"path": str(a)}], [{"step": 3, "weights": {"nope": 1}}], "data.schedule[0].weights: unknown source 'nope'"),
        ([{"path": str(a)}], [{"step": 3, "weights": {"a": 0}}], "data.schedule[0].weights: weights sum to 0"),
        ([{"path": str(a)}], [{"step": 3, "weights": {"a": 1}}, {"step": 2, "weights": {"a": 1}}],
         "data.schedule[1].step: must be an integer >= 0 and above"),
        ([], [], "data.sources: is empty"),
    ]
    for sources, schedule, message in cases:
        with pytest.raises(DataSourceError) as error:
            MixtureData(sources, schedule)
        assert str(error.value).startswith(message), str(error.value)


def preflight_error(capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    from trainer.cli import preflight

    with pytest.raises(SystemExit) as exit_:
        preflight(list(overrides))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_bad_data_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.config import register_configs

    register_configs()
    a = token_dir(tmp_path, "a")
    no_eos = token_dir(tmp_path, "noeos", append_eos=False)  # bytes without EOS: vocabulary 256
    nano = tmp_path / "nano"
    nano.mkdir()
    np.asarray(TokenFileDataset(str(a)).train_tokens()).tofile(nano / "train.bin")
    (tmp_path / "bad.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x01" + b"\0" * 30)
    (tmp_path / "bad.bin").write_bytes(b"")
    mix = ["data=mixture", "model.vocab_size=300"]

    def sources(*specs: str) -> str:
        return "data.sources=[" + ",".join(specs) + "]"

    cases = {
        f"{{path: {tmp_path / 'missing'}, weight: 1}}": f"error: data.sources[0]: data source not found: {tmp_path / 'missing'}",
        f"{{path: {a}, weight: -1}}": "error: data.sources[0].weight: must be a finite number >= 0, got -1.0",
        f"{{path: {a}, weight: 0}}": "error: data.sources: weights sum to 0.0; at least one source needs a positive weight",
        f"{{path: {tmp_path / 'bad'}, vocab_size: 257}}": f"error: data.sources[0]: {tmp_path / 'bad.idx'}: malformed index",
    }
    for spec, expected in cases.items():
        assert preflight_error(capsys, *mix, sources(spec)).startswith(expected), spec
    err = preflight_error(capsys, *mix, sources(f"{{path: {a}}}", f"{{path: {no_eos}}}"))
    assert err == ("error: data.sources[1]: vocab_size 256 of 'noeos' differs from 257 of 'a': all sources must "
                   "share one tokenizer")
    err = preflight_error(capsys, *mix, sources(f"{{path: {a}}}", f"{{path: {nano}, vocab_size: 257}}"))
    assert err.startswith("error: data.sources[1]: eos_id None of 'nano' differs from 256 of 'a'")
    err = preflight_error(capsys, "data=mixture", "model.vocab_size=256", sources(f"{{path: {a}}}"))
    assert err == ("error: data: the data has 257 token ids but model.vocab_size is 256: pick a model whose "
                   "vocabulary covers the data")
    err = preflight_error(capsys, "data=megatron", f"data.path={tmp_path / 'bad'}", "data.vocab_size=257",
                          "model.vocab_size=300")
    assert err.startswith(f"error: data: {tmp_path / 'bad.idx'}: malformed index")
    err = preflight_error(capsys, *mix, sources(f"{{path: {a}}}", f"{{path: {tmp_path / 'bad'}, vocab_size: 257, "
                                                 "val_fraction: 0}"))
    assert err.startswith("error: data.sources[1]: ") and "malformed index" in err
    from trainer.data.formats import write_megatron

    write_megatron(tmp_path / "mt", [np.arange(200) % 256, np.arange(300) % 256])
    err = preflight_error(capsys, *mix, sources(f"{{path: {a}}}", f"{{path: {tmp_path / 'mt'}, vocab_size: 257, "
                                                 "eos_id: 256, val_fraction: 0}"))
    assert err == ("error: data.sources[1]: the validation split of 'mt' has 0 tokens, fewer than one window of "
                   "trainer.seq_len + 1 = 257")
    err = preflight_error(capsys, "data=token_file", f"data.path={tmp_path / 'nothing'}")
    assert err == f"error: data.path: {tmp_path / 'nothing'} does not exist"


# --------------------------------------------------------------------------- end to end

MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden_dim=64",
         "model.vocab_size=257"]
LOOP = ["trainer.seq_len=32", "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "trainer.log_every=1",
        "trainer.val_batches=1", "trainer.val_every=3", "lr_schedule.warmup_steps=1", "trainer.peak_flops=1e12"]


def run(run_dir: Path, *overrides: str) -> list[dict[str, str]]:
    from trainer.config import compose
    from trainer.run import train

    train(compose(MODEL + LOOP + list(overrides)), run_dir)
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def losses(rows: list[dict[str, str]]) -> dict[int, float]:
    return {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}


@pytest.mark.slow
def test_mixture_run_logs_per_source_val_and_resumes_exactly(tmp_path: Path) -> None:
    a, b = token_dir(tmp_path, "a", docs=80), token_dir(tmp_path, "b", docs=80, seed=1)
    mix = ["data=mixture", f"data.sources=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3, name: bee}}]",
           "data.schedule=[{step: 3, weights: {bee: 1}}]"]
    mix += ["trainer.max_steps=6"]
    straight = run(tmp_path / "straight", *mix, "callbacks=none")
    # Stopped after step 3 (a checkpoint there; the LR schedule still spans 6 steps), then resumed.
    stop = ["callbacks=[checkpoint]", "callbacks.checkpoint.every_n_steps=3",
            "+callbacks.stop._target_=tests.test_checkpoint.StopAfterSteps", "+callbacks.stop.steps=3"]
    run(tmp_path / "first", *mix, *stop)
    resumed = run(tmp_path / "second", *mix, "callbacks=none", f"resume={tmp_path / 'first' / 'checkpoints'}")
    assert {s: l for s, l in losses(straight).items() if s > 3} == losses(resumed)
    val = [r for r in straight if r.get("val_loss")]
    assert [int(r["step"]) for r in val] == [3, 6]
    for r in val:  # overall = the base weights' mean of the per-source losses
        parts = float(r["val_loss/a"]), float(r["val_loss/bee"])
        assert float(r["val_loss"]) == pytest.approx(0.7 * parts[0] + 0.3 * parts[1], rel=1e-6)


def write_megatron(prefix: Path, tokens: np.ndarray, offsets: np.ndarray) -> None:
    """Megatron-core's MMapIndexedDataset layout, one sequence per document, written field by field."""
    sizes = np.diff(offsets).astype("<i4")
    tokens.astype("<u2").tofile(f"{prefix}.bin")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + np.uint8(8).tobytes())
        f.write(np.uint64(len(sizes)).tobytes() + np.uint64(len(sizes) + 1).tobytes())
        f.write(sizes.tobytes())
        f.write((offsets[:-1] * 2).astype("<i8").tobytes())
        f.write(np.arange(len(sizes) + 1, dtype="<i8").tobytes())


@pytest.mark.slow
def test_megatron_and_nanogpt_files_train_like_our_format(tmp_path: Path) -> None:
    ours = token_dir(tmp_path, "ours", docs=80)
    ds = TokenFileDataset(str(ours))
    train, val = np.asarray(ds.train_tokens()), np.asarray(ds.val_tokens())
    write_megatron(tmp_path / "mt_train", train, ds.doc_offsets("train"))
    write_megatron(tmp_path / "mt_val", val, ds.doc_offsets("val"))
    nano = tmp_path / "nano"
    nano.mkdir()
    train.astype(np.uint16).tofile(nano / "train.bin")  # nanoGPT's prepare.py: np.uint16 arrays
    val.astype(np.uint16).tofile(nano / "val.bin")
    with open(nano / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 257}, f)
    steps = ["trainer.max_steps=3", "callbacks=none"]
    reference = run(tmp_path / "ours-run", "data=token_file", f"data.path={ours}", *steps)
    megatron = run(tmp_path / "mt-run", "data=megatron", f"data.path={tmp_path / 'mt_train'}", "data.vocab_size=257",
                   "data.eos_id=256", f"data.val_path={tmp_path / 'mt_val'}", *steps)
    nanogpt = run(tmp_path / "nano-run", "data=nanogpt", f"data.path={nano}", "data.eos_id=256", *steps)
    for other in (megatron, nanogpt):
        assert losses(other) == losses(reference)
        assert [r["val_loss"] for r in other if r.get("val_loss")] == [r["val_loss"] for r in reference
                                                                        if r.get("val_loss")]


@pytest.mark.slow
@pytest.mark.beside
def test_mixture_on_2_ddp_processes_matches_one_process_and_resumes_its_checkpoint(tmp_path: Path) -> None:
    """One 2-process launch: the mixture trained with ddp gives the single-process losses, and a ddp run
    resumed from a single-process checkpoint (another data-parallel size) continues them."""
    from tests.launch_pool import launch_harness

    a, b = token_dir(tmp_path, "a", docs=80), token_dir(tmp_path, "b", docs=80, seed=1)
    mix = ["data=mixture", f"data.sources=[{{path: {a}, weight: 0.6}}, {{path: {b}, weight: 0.4, name: bee}}]",
           "data.schedule=[{step: 2, weights: {a: 0.1, bee: 0.9}}]", "trainer.max_steps=5",
           "trainer.micro_batch_size=1"]
    single = losses(run(tmp_path / "single", *mix, "callbacks=none"))
    stop = ["callbacks=[checkpoint]", "callbacks.checkpoint.every_n_steps=3",
            "+callbacks.stop._target_=tests.test_checkpoint.StopAfterSteps", "+callbacks.stop.steps=3"]
    run(tmp_path / "first", *mix, *stop)
    ddp = MODEL + LOOP + mix + ["strategy=ddp", "trainer.devices=2", "callbacks=none"]
    launch_harness(tmp_path / "launch", 2, [
        {"name": "straight", "overrides": ddp},
        {"name": "resumed", "overrides": ddp + [f"resume={tmp_path / 'first' / 'checkpoints'}"]},
    ])
    for name, steps in (("straight", range(1, 6)), ("resumed", range(4, 6))):
        with open(tmp_path / "launch" / "np2" / name / "metrics.csv") as f:
            got = losses(list(csv.DictReader(f)))
        assert sorted(got) == list(steps), name
        for step in steps:  # the same samples; only the gradient reduction's float order differs
            assert got[step] == pytest.approx(single[step], rel=1e-5), (name, step)
