"""Tests for trainer.data: corpora, the prepare tool, windows and the stateful loader."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.data.prepare as prep
from trainer.data.config import source_config
from trainer.data import StatefulLoader, StdlibCorpus, TokenFileDataset, TokenWindows, val_batches

REPO = Path(__file__).resolve().parents[1]
CONF_DATA = REPO / "conf" / "data"

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "Grüße aus Köln — naïve café ☕\n",
    "日本語のテキストと emoji 🎉🚀\n",
    "line one\r\nline two with CRLF\r\n",
    "    indented\n\ttabbed\n",
    "class Foo:\n    pass\n\n\n",
    "numbers 0123456789 and symbols !@#$%^&*()",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nprint(os.getcwd())\n",
    "a" * 500,
    "last document without newline",
]


# --------------------------------------------------------------------------- helpers


def run_prepare(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "trainer.data.prepare", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def split_on(ids: np.ndarray, sep: int) -> list[np.ndarray]:
    """Split a token array on ``sep`` (which terminates every document)."""
    ends = np.flatnonzero(ids == sep)
    assert len(ends) == 0 or ends[-1] == len(ids) - 1, "every document must end with EOS"
    return np.split(np.asarray(ids), ends + 1)[:-1] if len(ends) else []


def is_subsequence(sub: list[str], full: list[str]) -> bool:
    it = iter(full)
    return all(any(s == f for f in it) for s in sub)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE (vocab ~300) trained in-memory, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS * 3, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def corpus() -> StdlibCorpus:
    return StdlibCorpus()


# --------------------------------------------------------------------------- StdlibCorpus


def test_stdlib_corpus_is_real_deterministic_and_split_by_file(corpus: StdlibCorpus) -> None:
    train, val = corpus.train_tokens(), corpus.val_tokens()
    assert corpus.vocab_size == 256 and train.dtype == np.uint8 and train.ndim == 1
    assert train.size > 1_000_000 and val.size > 10_000
    assert b"def " in train[:200_000].tobytes()
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert list(corpus.train_files) == sorted(corpus.train_files)
    for rel in corpus.train_files + corpus.val_files:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"site-packages", "__pycache__", "test", "tests", "idle_test"} & set(parts), rel
    assert not train.flags.writeable  # the cached array must not be editable in place

    StdlibCorpus.clear_cache()
    start = time.perf_counter()
    again = StdlibCorpus()
    assert time.perf_counter() - start < 2.0
    assert np.array_equal(again.train_tokens(), train) and np.array_equal(again.val_tokens(), val)
    assert again.train_files == corpus.train_files and again.val_files == corpus.val_files
    desc = corpus.describe()
    assert f"{len(corpus.train_files)} files" in desc and f"{train.size:,} bytes" in desc


def test_stdlib_split_does_not_depend_on_max_bytes(corpus: StdlibCorpus) -> None:
    small = StdlibCorpus(max_bytes=300_000)
    assert small.train_tokens().size == 300_000
    assert small.val_tokens().size <= math.ceil(300_000 * 0.05)
    # Same per-file assignment, and the capped corpus is a prefix of the full one.
    assert not set(small.train_files) & set(corpus.val_files)
    assert not set(small.val_files) & set(corpus.train_files)
    assert small.train_files == corpus.train_files[: len(small.train_files)]
    assert np.array_equal(small.train_tokens(), corpus.train_tokens()[:300_000])


def test_stdlib_skip_rules_and_layout(tmp_path: Path) -> None:
    files = {
        "b.py": b"print('b')",
        "a.py": b"x = 1\n",
        "pkg/mod.py": b"# caf\xc3\xa9\n",
        "pkg/tests/t.py": b"T = 1",
        "test/t.py": b"T = 2",
        "idlelib/idle_test/x.py": b"T = 3",
        "site-packages/s.py": b"S = 1",
        "__pycache__/c.py": b"C = 1",
        "latin1.py": b"# caf\xe9\n",  # not UTF-8: skipped
        "notes.txt": b"not python",
    }
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)

    c = StdlibCorpus(val_fraction=0.0, max_bytes=None, root=str(tmp_path))
    assert c.train_files == ("a.py", "b.py", "pkg/mod.py") and c.val_files == ()
    assert c.train_tokens().tobytes() == b"x = 1\n\nprint('b')\n# caf\xc3\xa9\n"
    assert c.val_tokens().size == 0

    with_tests = StdlibCorpus(val_fraction=0.0, max_bytes=None, include_tests=True, root=str(tmp_path))
    assert set(with_tests.train_files) == {"a.py", "b.py", "pkg/mod.py", "pkg/tests/t.py", "test/t.py",
                                           "idlelib/idle_test/x.py"}
    # Even a tiny tree gets a (stable) validation file when one is asked for.
    held = StdlibCorpus(val_fraction=0.01, max_bytes=None, root=str(tmp_path))
    assert len(held.val_files) == 1 and held.val_tokens().size > 0

    with pytest.raises(ValueError, match="val_fraction"):
        StdlibCorpus(val_fraction=1.0, root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        StdlibCorpus(root=str(tmp_path / "missing"))


# --------------------------------------------------------------------------- prepare + TokenFileDataset


def test_prepare_bpe_round_trip(tmp_path: Path, bpe_tokenizer: Path) -> None:
    from tokenizers import Tokenizer

    text_file = tmp_path / "doc.txt"
    text_file.write_bytes(DOCS[0].encode())  # bytes: keep any CRLF untouched
    jsonl = write_jsonl(tmp_path / "docs.jsonl", DOCS[1:])
    out = tmp_path / "ds"
    res = run_prepare(text_file, jsonl, "--output", out, "--tokenizer", bpe_tokenizer,
                      "--val-fraction", "0.5", "--append-eos")
    assert res.returncode == 0, res.stderr
    # One report line per input (documents, tokens, bytes per token), then the summary.
    lines = res.stdout.splitlines()
    assert len(lines) == 3 and lines[-1].startswith(f"prepared {out}"), res.stdout
    assert lines[0].startswith(f"  {text_file}: 1 documents, ") and "bytes/token" in lines[0]
    assert lines[1].startswith(f"  {jsonl}: {len(DOCS) - 1} documents, ")

    ds = TokenFileDataset(str(out))
    tok = Tokenizer.from_file(str(bpe_tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    assert ds.meta["dtype"] == "uint16" and ds.vocab_size == tok.get_vocab_size() and ds.eos_id == eos
    assert isinstance(ds.train_tokens(), np.memmap) and not ds.train_tokens().flags.writeable
    assert ds.tokenizer_path is not None and ds.tokenizer_path.read_bytes() == bpe_tokenizer.read_bytes()
    decoded = {
        split: [tok.decode(d[:-1].tolist(), skip_special_tokens=False) for d in split_on(arr, eos)]
        for split, arr in (("train", ds.train_tokens()), ("val", ds.val_tokens()))
    }
    assert decoded["train"] and decoded["val"]
    assert sorted(decoded["train"] + decoded["val"]) == sorted(DOCS)
    assert is_subsequence(decoded["train"], DOCS) and is_subsequence(decoded["val"], DOCS)
    assert ds.meta["documents"] == {"train": len(decoded["train"]), "val": len(decoded["val"])}

    # Deterministic: a second run writes identical bytes.
    again = tmp_path / "ds2"
    assert prep.main([str(text_file), str(jsonl), "--output", str(again), "--tokenizer", str(bpe_tokenizer),
                      "--val-fraction", "0.5", "--append-eos"]) == 0
    for name in ("train.bin", "val.bin"):
        assert (out / name).read_bytes() == (again / name).read_bytes()


def test_prepare_bytes_round_trip(tmp_path: Path) -> None:
    text_file = tmp_path / "doc.txt"
    text_file.write_bytes(DOCS[3].encode())
    jsonl = write_jsonl(tmp_path / "docs.jsonl", DOCS[:3] + [""], key="content")
    res = run_prepare(text_file, jsonl, "--output", tmp_path / "ds", "--jsonl-key", "content",
                      "--val-fraction", "0")
    assert res.returncode == 0, res.stderr
    ds = TokenFileDataset(str(tmp_path / "ds"))
    assert ds.vocab_size == 256 and ds.eos_id is None and ds.meta["dtype"] == "uint16"
    assert ds.tokenizer == "bytes" and ds.tokenizer_path is None
    assert ds.val_tokens().size == 0 and ds.meta["documents"]["train"] == 4  # the empty doc is skipped
    assert ds.train_tokens().astype(np.uint8).tobytes().decode() == DOCS[3] + "".join(DOCS[:3])

    # EOS in bytes mode is the extra id 256.
    meta = prep.prepare([str(jsonl)], str(tmp_path / "eos"), val_fraction=0.0, jsonl_key="content",
                        append_eos=True)
    assert meta["vocab_size"] == 257 and meta["eos_id"] == 256
    docs = split_on(TokenFileDataset(str(tmp_path / "eos")).train_tokens(), 256)
    assert [d[:-1].astype(np.uint8).tobytes().decode() for d in docs] == DOCS[:3]


def test_prepare_streams_text_in_chunks_and_falls_back_to_token_tail(
    tmp_path: Path, bpe_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    monkeypatch.setattr(prep, "_TEXT_CHUNK_CHARS", 7)  # force many line-aligned chunks
    monkeypatch.setattr(prep, "_BATCH_MAX_PIECES", 3)
    text = "".join(DOCS)
    big = tmp_path / "big.txt"
    big.write_bytes(text.encode())

    meta = prep.prepare([str(big)], str(tmp_path / "b"), val_fraction=0.1)
    ds = TokenFileDataset(str(tmp_path / "b"))
    # One document cannot be split by document: val is the last 10% of tokens.
    assert meta["split"] == "token_tail" and ds.val_tokens().size == round(len(text.encode()) * 0.1)
    joined = np.concatenate([ds.train_tokens(), ds.val_tokens()]).astype(np.uint8).tobytes()
    assert joined.decode() == text

    prep.prepare([str(big)], str(tmp_path / "t"), tokenizer=str(bpe_tokenizer), val_fraction=0.0)
    ids = TokenFileDataset(str(tmp_path / "t")).train_tokens()
    assert Tokenizer.from_file(str(bpe_tokenizer)).decode(ids.tolist()) == text


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, [], "input file not found: "),
        ('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n', [], "bad.jsonl:3: invalid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', [], "bad.jsonl:2: missing key 'text'"),
        ('{"text": 5}\n', [], "bad.jsonl:1: value of 'text' is int"),
        ("[1, 2]\n", [], "bad.jsonl:1: expected a JSON object"),
        ('{"text": "ok"}\n', ["--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
        ('{"text": "ok"}\n', ["--tokenizer", "nope/tokenizer.json"], "tokenizer file not found"),
        ("\n", [], "no tokens produced"),
    ],
)
def test_prepare_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, args: list[str], message: str
) -> None:
    src = tmp_path / "bad.jsonl"
    if content is not None:
        src.write_text(content)
    out = tmp_path / "out"
    assert prep.main([str(src), "--output", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (out / "meta.json").exists()


def test_prepare_bad_input_exit_code_from_cli(tmp_path: Path, bpe_tokenizer: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    res = run_prepare(bad, "--output", tmp_path / "o")
    assert res.returncode == 2
    assert res.stderr.strip() == f"prepare: error: {bad}: not valid UTF-8 (invalid continuation byte)"
    ok = tmp_path / "ok.txt"
    ok.write_text("hi")
    res = run_prepare(ok, "--output", tmp_path / "o", "--tokenizer", bpe_tokenizer, "--append-eos",
                      "--eos-token", "<nope>")
    assert res.returncode == 2 and "no end-of-document token among <nope>" in res.stderr


def test_token_file_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="directory not found"):
        TokenFileDataset(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="meta.json not found"):
        TokenFileDataset(str(tmp_path))
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 10)
    ds_dir = tmp_path / "ds"
    prep.prepare([str(src)], str(ds_dir), val_fraction=0.0)
    meta_path = ds_dir / "meta.json"
    meta = json.loads(meta_path.read_text())

    with open(ds_dir / "train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"train\.bin: size is 242 bytes but meta\.json says 120 uint16"):
        TokenFileDataset(str(ds_dir))
    os.truncate(ds_dir / "train.bin", 240)
    assert TokenFileDataset(str(ds_dir)).train_tokens().size == 120
    (ds_dir / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"val\.bin not found"):
        TokenFileDataset(str(ds_dir))
    meta_path.write_text(json.dumps({**meta, "dtype": "int8"}))
    with pytest.raises(ValueError, match=r"meta\.json: dtype must be one of"):
        TokenFileDataset(str(ds_dir))
    meta_path.write_text("{not json")
    with pytest.raises(ValueError, match=r"meta\.json: not valid JSON"):
        TokenFileDataset(str(ds_dir))


# --------------------------------------------------------------------------- windows


def test_token_windows() -> None:
    tokens = np.arange(23, dtype=np.uint16)
    w = TokenWindows(tokens, seq_len=5)
    assert len(w) == 4  # (23 - 1) // 5
    x, y = w[1]
    assert x.dtype == torch.int64 and x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    assert w[-1][1].tolist() == [16, 17, 18, 19, 20]
    xb, yb = w.get_batch([3, 0])
    assert xb.shape == (2, 5) and xb.is_contiguous() and yb.is_contiguous()
    assert torch.equal(xb[1], w[0][0]) and torch.equal(yb[0], w[3][1])
    with pytest.raises(IndexError):
        w[4]
    with pytest.raises(ValueError, match="need at least seq_len \\+ 1 = 6 tokens for one window, got 5"):
        TokenWindows(np.arange(5), seq_len=5)


# --------------------------------------------------------------------------- StatefulLoader


def make_windows(n_windows: int = 37, seq_len: int = 4) -> TokenWindows:
    # Window i starts with token i*seq_len, which makes identities easy to read back.
    return TokenWindows(np.arange(n_windows * seq_len + 1, dtype=np.uint32), seq_len)


def window_ids(batches: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int = 4) -> list[int]:
    return [int(v) // seq_len for x, _ in batches for v in x[:, 0]]


def test_loader_union_over_ranks_equals_global_batch() -> None:
    w = make_windows()
    reference = StatefulLoader(w, global_batch_size=8, micro_batch_size=2, seed=3)
    expected = [window_ids(next(reference)) for _ in range(10)]  # crosses an epoch (4 steps/epoch)
    for dp_size in (1, 2, 4):
        ranks = [StatefulLoader(w, 8, 2, dp_rank=r, dp_size=dp_size, seed=3) for r in range(dp_size)]
        for step in range(10):
            per_rank = [next(loader) for loader in ranks]
            assert all(len(b) == 8 // (2 * dp_size) for b in per_rank)
            assert [i for b in per_rank for i in window_ids(b)] == expected[step]

    # Each epoch is a permutation prefix: no repeats, and epochs are shuffled differently.
    first_epoch = [i for step in expected[:4] for i in step]
    second_epoch = [i for step in expected[4:8] for i in step]
    assert len(set(first_epoch)) == 32 and len(set(second_epoch)) == 32 and first_epoch != second_epoch
    assert reference.steps_per_epoch == 4


def test_loader_micro_batches_and_order() -> None:
    w = make_windows()
    loader = StatefulLoader(w, global_batch_size=12, micro_batch_size=3, dp_rank=1, dp_size=2, shuffle=False)
    assert loader.num_micro_batches == 2 and loader.steps_per_epoch == 3
    step = next(loader)
    assert len(step) == 2
    for x, y in step:
        assert x.shape == (3, 4) and y.shape == (3, 4) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert window_ids(step) == [6, 7, 8, 9, 10, 11]  # rank 1's half of windows 0..11
    next(loader), next(loader)
    assert loader.epoch == 1 and loader.step_in_epoch == 0
    assert window_ids(next(loader)) == [6, 7, 8, 9, 10, 11]  # the 36th window is the dropped tail


@pytest.mark.parametrize("steps_before_save", [2, 3, 4, 7])  # mid-epoch, last step, boundary, later epoch
def test_loader_state_restore_is_exact(steps_before_save: int) -> None:
    w = make_windows()
    loader = StatefulLoader(w, global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=11)
    for _ in range(steps_before_save):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))  # must survive plain serialization
    expected = [next(loader) for _ in range(6)]  # crosses at least one epoch boundary

    restored = StatefulLoader(w, global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=999)
    restored.load_state_dict(state)
    assert restored.seed == 11
    for exp in expected:
        got = next(restored)
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(exp, got, strict=True))
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(exp, got, strict=True))

    # The state is about the global batch, so resuming with another rank layout is exact too.
    single = StatefulLoader(w, global_batch_size=8, micro_batch_size=4)
    single.load_state_dict(state)
    full = [window_ids(next(single)) for _ in range(6)]
    assert [ids[4:] for ids in full] == [window_ids(b) for b in expected]


def test_loader_validation_messages() -> None:
    w = make_windows()
    expected = r"global_batch_size \(10\) must be divisible by micro_batch_size \(2\) \* dp_size \(4\) = 8"
    with pytest.raises(ValueError, match=expected):
        StatefulLoader(w, global_batch_size=10, micro_batch_size=2, dp_size=4)
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\)"):
        StatefulLoader(w, 8, 2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch of 64"):
        StatefulLoader(w, 64, 2)
    loader = StatefulLoader(w, 8, 2)
    with pytest.raises(ValueError, match="num_windows=99"):
        loader.load_state_dict({**loader.state_dict(), "num_windows": 99})


# --------------------------------------------------------------------------- val_batches


def test_val_batches_fixed_and_sharded() -> None:
    w = make_windows(n_windows=30)
    single = val_batches(w, num_batches=3, micro_batch_size=2)
    assert window_ids(single) == [0, 1, 2, 3, 4, 5]
    again = val_batches(w, num_batches=3, micro_batch_size=2)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(single, again, strict=True))
    ranks = [val_batches(w, 3, 2, dp_rank=r, dp_size=2) for r in range(2)]
    assert [window_ids(b) for b in ranks] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert all(x.shape == (2, 4) for b in ranks for x, _ in b)

    # Too few windows: as many full batches as fit, or one smaller batch per rank.
    assert window_ids(val_batches(w, num_batches=100, micro_batch_size=4)) == list(range(28))
    small = make_windows(n_windows=5)
    tiny = [val_batches(small, 2, 4, dp_rank=r, dp_size=2) for r in range(2)]
    assert [window_ids(b) for b in tiny] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="fewer than dp_size"):
        val_batches(make_windows(n_windows=1), 1, 1, dp_size=2)


# --------------------------------------------------------------------------- Hydra configs


def test_hydra_configs_compose_and_instantiate(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.utils import instantiate

    from trainer.data import StdlibDataConfig, TokenFileDataConfig

    # Normally done by the project's config registration; repeated here to test in isolation.
    cs = ConfigStore.instance()
    cs.store(group="data", name="stdlib_schema", node=StdlibDataConfig)
    cs.store(group="data", name="token_file_schema", node=TokenFileDataConfig)

    src = tmp_path / "a.txt"
    src.write_text("some text " * 20)
    prep.prepare([str(src)], str(tmp_path / "ds"))
    with initialize_config_dir(config_dir=str(CONF_DATA.parent), version_base=None):
        cfg = compose(overrides=["+data=stdlib", "data.max_bytes=100000"])
        assert cfg.data.val_fraction == 0.05 and cfg.data.include_tests is False
        corpus = instantiate(source_config(cfg.data))
        assert isinstance(corpus, StdlibCorpus) and corpus.train_tokens().size == 100_000

        cfg = compose(overrides=["+data=token_file", f"data.path={tmp_path / 'ds'}"])
        ds = instantiate(source_config(cfg.data))
        assert isinstance(ds, TokenFileDataset) and ds.num_tokens["train"] > 0
        with pytest.raises(Exception, match="max_bytes"):
            compose(overrides=["+data=stdlib", "data.max_bytes=lots"])


# ---- token ids beyond the model's vocabulary --------------------------------------------------------------
def _token_dir(path: Path, train: np.ndarray, val: np.ndarray, vocab_size: int) -> Path:
    """A format-1 token directory whose meta.json says `vocab_size`, whatever ids the files hold."""
    path.mkdir()
    train.astype("<u2").tofile(path / "train.bin")
    val.astype("<u2").tofile(path / "val.bin")
    (path / "meta.json").write_text(json.dumps({"format_version": 1, "dtype": "uint16", "vocab_size": vocab_size,
                                                "num_tokens": {"train": len(train), "val": len(val)}}))
    return path


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_file_and_the_id(tmp_path: Path) -> None:
    """A meta.json that under-reports the vocabulary: the run is refused before it starts, with the file and
    its largest id (not an IndexError from the embedding hours later)."""
    from trainer.config import ConfigError, compose, validate

    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 256, 5000), rng.integers(0, 256, 1000)
    val[123] = 300
    data = _token_dir(tmp_path / "ds", train, val, vocab_size=256)
    cfg = compose(["model=tiny", "data=token_file", f"data.path={data}", "trainer.seq_len=32"])
    with pytest.raises(ConfigError, match=rf"^data: {data / 'val.bin'} holds token id 300, beyond model.vocab_size=256 "
                                          r"\(the source says its vocabulary has 256 ids\)"):
        validate(cfg)
    # the scan is cached beside the files, keyed by size and modification time
    cache = json.loads((data / "token_ids.json").read_text())
    assert (cache["train.bin"]["max"], cache["val.bin"]["max"]) == (int(train.max()), 300)
    # a model whose vocabulary covers the ids accepts the data
    validate(compose(["model=tiny", "model.vocab_size=512", "data=token_file", f"data.path={data}",
                      "trainer.seq_len=32"]))


def test_the_largest_id_is_read_from_the_cache_while_the_file_is_unchanged(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.data.token_ids as token_ids

    data = _token_dir(tmp_path / "ds", np.arange(1000) % 200, np.arange(100) % 50, vocab_size=256)
    tokens = np.memmap(data / "train.bin", dtype="<u2", mode="r")
    assert token_ids.largest_token_id(data / "train.bin", tokens) == 199
    cache = json.loads((data / "token_ids.json").read_text())
    cache["train.bin"]["max"] = 7  # what a current entry says is what is returned: no scan
    (data / "token_ids.json").write_text(json.dumps(cache))
    assert token_ids.largest_token_id(data / "train.bin", tokens) == 7
    os.utime(data / "train.bin", ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed: scanned again
    assert token_ids.largest_token_id(data / "train.bin", tokens) == 199

    # a directory the cache cannot be written to (read-only): scanned, no error, nothing left behind
    def refuse(src: str, dst: str) -> None:
        raise PermissionError(13, "Read-only file system", dst)

    (data / "token_ids.json").unlink()
    monkeypatch.setattr(token_ids.os, "replace", refuse)
    assert token_ids.largest_token_id(data / "train.bin", tokens) == 199
    assert sorted(p.name for p in data.iterdir()) == ["meta.json", "train.bin", "val.bin"]
