"""Input formats of `prepare` (gz, zst, parquet, datasets), its workers, report and failure behaviour, the
document index, and the readers of corpora tokenized elsewhere (Megatron-LM .bin/.idx, nanoGPT .bin)."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

import trainer.data.prepare as prep
from trainer.data import MegatronIndexedDataset, NanoGPTDataset, TokenFileDataset, open_source

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5) for i in range(40)]
DOCS[7] = "Grüße aus Köln ☕ 日本語 🎉"


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE trained in memory (nothing downloads), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DOCS * 3, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def documents(ds: TokenFileDataset, split: str) -> list[bytes]:
    """The split's documents cut by the offsets index, EOS (256) dropped, as bytes."""
    tokens = np.asarray(ds.train_tokens() if split == "train" else ds.val_tokens())
    offsets = ds.doc_offsets(split)
    docs = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert all(d[-1] == 256 for d in docs)
    return [d[:-1].astype(np.uint8).tobytes() for d in docs]


# --------------------------------------------------------------------------- prepare


def prepared_documents(tmp_path: Path, name: str) -> tuple[list[bytes], list[bytes]]:
    """Prepare one input; check the report and the document index; its (train, val) documents."""
    meta = prep.prepare([str(tmp_path / name)], str(tmp_path / f"out-{name}"), val_fraction=0.2, append_eos=True)
    ds = TokenFileDataset(str(tmp_path / f"out-{name}"))
    got = (documents(ds, "train"), documents(ds, "val"))
    # Document boundaries are kept: the index cuts exactly the input documents.
    assert sorted(got[0] + got[1]) == sorted(d.encode() for d in DOCS), name
    (source,) = meta["sources"]
    assert source["documents"] == len(DOCS) and source["tokens"] == sum(ds.num_tokens.values())
    assert source["bytes"] == sum(len(d.encode()) for d in DOCS)
    return got


def test_jsonl_gz_zst_and_parquet_give_the_same_tokens(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    body = write_jsonl(tmp_path / "a.jsonl", DOCS).read_bytes()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "a.parquet", row_group_size=7)
    reference = prepared_documents(tmp_path, "a.jsonl")
    for name in ("a.jsonl.gz", "a.jsonl.zst", "a.parquet"):
        assert prepared_documents(tmp_path, name) == reference, name


def test_datasets_save_to_disk_directories(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the `datasets` package (extra `data`, in `dev`) reads its "
                                                      "own save_to_disk format")
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "hf"))
    # a DatasetDict: its splits in name order (train, then validation: DOCS' order here)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:30]}),
                          "validation": datasets.Dataset.from_dict({"text": DOCS[30:]})}).save_to_disk(
        str(tmp_path / "hfdict"))
    reference = prepared_documents(tmp_path, "a.jsonl")
    assert prepared_documents(tmp_path, "hf") == reference
    assert prepared_documents(tmp_path, "hfdict") == reference


def test_workers_write_the_same_bytes_and_the_report(tmp_path: Path, bpe_tokenizer: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    b = tmp_path / "b.txt"
    b.write_text("a plain text document\n" * 50)
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        args = [str(a), str(b), "--output", str(out), "--tokenizer", str(bpe_tokenizer), "--append-eos",
                "--workers", str(workers), "--progress"]
        assert prep.main(args) == 0
        outs.append(out)
        captured = capsys.readouterr()
        lines = captured.out.splitlines()
        assert lines[0].startswith(f"  {a}: {len(DOCS)} documents, ") and lines[0].endswith(" bytes/token")
        assert lines[1].startswith(f"  {b}: 1 documents, ")
        # the progress bar: input read, tokens/s, and tqdm's ETA field
        assert "tokens/s" in captured.err and "<" in captured.err, captured.err
    for name in ("train.bin", "val.bin", "train.offsets.bin", "val.offsets.bin"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_corrupt_line_names_file_and_line_and_keeps_the_existing_dataset(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert prep.main([str(write_jsonl(tmp_path / "good.jsonl", DOCS)), "--output", str(out), "--append-eos"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    lines = [json.dumps({"text": t}) for t in DOCS[:5]]
    lines.insert(3, '{"text": "cut off')
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    assert prep.main([str(bad), "--output", str(out), "--append-eos", "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prepare: error: {bad}:4: invalid JSON (") and err.count("\n") == 1, err
    # The dataset written before is untouched (nothing half-replaced) and nothing partial is left.
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert TokenFileDataset(str(out)).num_tokens["train"] > 0

    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:-12])
    assert prep.main([str(truncated), "--output", str(tmp_path / "t")]) == 2
    assert "t.jsonl.gz: cannot decompress" in capsys.readouterr().err


def test_bad_columns_and_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    assert prep.main([str(tmp_path / "a.parquet"), "--output", str(tmp_path / "o")]) == 2
    assert "a.parquet: no column 'text' (columns: body); pass --text-key" in capsys.readouterr().err
    assert prep.main([str(tmp_path / "a.parquet"), "--output", str(tmp_path / "o"), "--text-key", "body"]) == 0
    pq.write_table(pa.table({"text": pa.array(["ok", "ok", "ok"]), "n": [1, 2, 3]}), tmp_path / "b.parquet")
    assert prep.main([str(tmp_path / "b.parquet"), "--output", str(tmp_path / "o"), "--text-key", "n"]) == 2
    assert "b.parquet: row 1: value of 'n' is int, not a string" in capsys.readouterr().err
    (tmp_path / "notdata").mkdir()
    assert prep.main([str(tmp_path / "notdata"), "--output", str(tmp_path / "o")]) == 2
    assert "not a datasets save_to_disk directory" in capsys.readouterr().err


def test_document_index_survives_the_token_tail_split(tmp_path: Path) -> None:
    """When the document hash puts every document on one side, `prepare` cuts validation off the end of the
    tokens instead: train is the first total - n_val tokens (n_val = round(total * val_fraction)), val the
    rest, and the cut document continues as val's first (the offsets index is cut with the tokens)."""
    # Documents 0, 1, 2 (blake2b of the index: 0.097, 0.988, 0.575): at val_fraction 0.05 all go to train.
    docs = ["a" * 100, "b" * 40, "c" * 3]  # 101 + 41 + 4 = 146 tokens with their EOS
    write_jsonl(tmp_path / "three.jsonl", docs)
    meta = prep.prepare([str(tmp_path / "three.jsonl")], str(tmp_path / "o"), val_fraction=0.05, append_eos=True)
    ds = TokenFileDataset(str(tmp_path / "o"))
    assert meta["split"] == ds.meta["split"] == "token_tail" and meta["documents"] == {"train": 3, "val": 0}
    flat = b"".join(d.encode() + b"\xff" for d in docs)  # 0xff stands for the EOS (256) below
    # n_val = round(146 * 0.05) = 7: train keeps 139 tokens, cutting document 1 ("b" * 40 + EOS) two
    # tokens before its EOS; val is "bb", EOS, then document 2 ("ccc", EOS) from val offset 3.
    assert ds.num_tokens == {"train": 139, "val": 7}
    as_bytes = lambda a: bytes(np.where(np.asarray(a) == 256, 255, np.asarray(a)).astype(np.uint8))  # noqa: E731
    assert as_bytes(ds.train_tokens()) == flat[:139] and as_bytes(ds.val_tokens()) == flat[139:]
    assert list(ds.doc_offsets("train")) == [0, 101, 139]
    assert list(ds.doc_offsets("val")) == [0, 3, 7]

    # One document, on the validation side by its hash (document 0 at val_fraction 0.1: 0.097 < 0.1): it
    # becomes train, then its last round(1001 * 0.1) = 100 tokens become val.
    text = tmp_path / "one.txt"
    text.write_text("x" * 1000)
    meta = prep.prepare([str(text)], str(tmp_path / "v"), val_fraction=0.1, append_eos=True)
    ds = TokenFileDataset(str(tmp_path / "v"))
    assert meta["split"] == "token_tail" and meta["documents"] == {"train": 1, "val": 0}
    assert ds.num_tokens == {"train": 901, "val": 100}
    assert as_bytes(ds.train_tokens()) == b"x" * 901 and as_bytes(ds.val_tokens()) == b"x" * 99 + b"\xff"
    assert list(ds.doc_offsets("train")) == [0, 901] and list(ds.doc_offsets("val")) == [0, 100]


def test_malformed_offsets_index(tmp_path: Path) -> None:
    prep.prepare([str(write_jsonl(tmp_path / "a.jsonl", DOCS))], str(tmp_path / "o"), append_eos=True)
    index = tmp_path / "o" / "train.offsets.bin"
    good = index.read_bytes()
    index.write_bytes(good[:-3])
    with pytest.raises(ValueError, match="train.offsets.bin: malformed document index"):
        TokenFileDataset(str(tmp_path / "o"))
    index.write_bytes(good[:-8] + struct.pack("<Q", 5))
    with pytest.raises(ValueError, match=r"malformed document index \(starts at 0, ends at 5"):
        TokenFileDataset(str(tmp_path / "o"))
    offsets = np.frombuffer(good, dtype="<u8").copy()
    offsets[[1, 2]] = offsets[[2, 1]]
    index.write_bytes(offsets.tobytes())
    with pytest.raises(ValueError, match="offsets decrease"):
        TokenFileDataset(str(tmp_path / "o")).doc_offsets("train")


# --------------------------------------------------------------------------- Megatron-LM and nanoGPT


def write_megatron_by_hand(prefix: Path, docs: list[list[int]], dtype_code: int = 8) -> None:
    """Megatron-core's MMapIndexedDataset layout (indexed_dataset.py, _IndexWriter), written field by field."""
    dtype = {4: "<i4", 8: "<u2"}[dtype_code]
    item = np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.array(d, dtype=dtype).tobytes())
    sizes = [len(d) for d in docs]
    pointers = list(np.concatenate([[0], np.cumsum(sizes)[:-1]]) * item)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(docs) + 1))
        f.write(np.array(sizes, dtype="<i4").tobytes())
        f.write(np.array(pointers, dtype="<i8").tobytes())
        f.write(np.arange(len(docs) + 1, dtype="<i8").tobytes())


def test_megatron_indexed_dataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, 999, size=int(n))) + [999] for n in rng.integers(5, 40, size=50)]
    write_megatron_by_hand(tmp_path / "corpus_text_document", docs)
    ds = open_source(str(tmp_path / "corpus_text_document"), vocab_size=1000, eos_id=999, val_fraction=0.1)
    assert isinstance(ds, MegatronIndexedDataset)
    flat = np.concatenate(docs)
    cut = sum(len(d) for d in docs[:45])  # 10% of 50 documents held out, whole documents
    assert np.array_equal(ds.train_tokens(), flat[:cut]) and np.array_equal(ds.val_tokens(), flat[cut:])
    assert list(ds.doc_offsets("train")) == [0, *np.cumsum([len(d) for d in docs[:45]])]
    assert ds.doc_offsets("val")[-1] == len(flat) - cut
    # a path with the suffix, a separate validation prefix, and int32 tokens
    write_megatron_by_hand(tmp_path / "val_text_document", docs[:3], dtype_code=8)
    ds = MegatronIndexedDataset(str(tmp_path / "corpus_text_document.bin"), 1000,
                                val_path=str(tmp_path / "val_text_document"))
    assert len(ds.train_tokens()) == len(flat) and len(ds.val_tokens()) == sum(len(d) for d in docs[:3])
    write_megatron_by_hand(tmp_path / "wide", docs, dtype_code=4)
    assert np.array_equal(MegatronIndexedDataset(str(tmp_path / "wide"), 1000, val_fraction=0).train_tokens(), flat)


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda b: b"XXIDIDX\x00\x00" + b[9:], "malformed index (magic"),
    (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
    (lambda b: b[:17] + struct.pack("<B", 6) + b[18:], "dtype code 6 is not an integer token type"),
    (lambda b: b[:-8], "document entries need"),
    (lambda b: b[:20], "shorter than the header"),
    (lambda b: b[:34] + struct.pack("<i", 7) + b[38:], "pointers do not follow the lengths"),
    (lambda b: b[:-8] + struct.pack("<q", 2), "document index must rise"),
])
def test_megatron_malformed_index(tmp_path: Path, corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    write_megatron_by_hand(tmp_path / "c", [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    idx = tmp_path / "c.idx"
    idx.write_bytes(corrupt(idx.read_bytes()))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        MegatronIndexedDataset(str(tmp_path / "c"), 16)


def test_megatron_bin_size_and_missing_files(tmp_path: Path) -> None:
    write_megatron_by_hand(tmp_path / "c", [[1, 2, 3], [4, 5]])
    with open(tmp_path / "c.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"c\.bin: size is 12 bytes but c\.idx describes 10 bytes"):
        MegatronIndexedDataset(str(tmp_path / "c"), 16)
    (tmp_path / "c.bin").unlink()
    with pytest.raises(FileNotFoundError, match="Megatron indexed dataset file not found"):
        MegatronIndexedDataset(str(tmp_path / "c"), 16)
    with pytest.raises(ValueError, match="does not store its vocabulary"):
        open_source(str(tmp_path / "c"))


def test_nanogpt_bins(tmp_path: Path) -> None:
    # nanoGPT's data/*/prepare.py: np.uint16 ids written with tofile / a memmap
    train = np.random.default_rng(1).integers(0, 65, size=500).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    train[:100].tofile(tmp_path / "val.bin")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": {i: chr(65 + i) for i in range(65)}, "stoi": {}}, f)
    ds = open_source(str(tmp_path))
    assert isinstance(ds, NanoGPTDataset) and ds.vocab_size == 65 and ds.eos_id is None
    assert np.array_equal(ds.train_tokens(), train) and len(ds.val_tokens()) == 100
    assert list(ds.doc_offsets("train")) == [0, 500]
    # without meta.pkl: GPT-2 BPE, documents found at <|endoftext|>
    gpt2 = tmp_path / "owt"
    gpt2.mkdir()
    np.array([5, 6, 50256, 7, 50256, 8], dtype=np.uint16).tofile(gpt2 / "train.bin")
    ds = open_source(str(gpt2 / "train.bin"))
    assert (ds.vocab_size, ds.eos_id) == (50257, 50256) and list(ds.doc_offsets("train")) == [0, 3, 5, 6]
    assert len(ds.val_tokens()) == 0

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("pwned",))

    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": Evil()}, f)
    with pytest.raises(ValueError, match="meta.pkl: not a readable nanoGPT meta.pkl"):
        open_source(str(tmp_path))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "train.bin").write_bytes(b"\0\0\0")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        open_source(str(tmp_path / "odd"))


@pytest.mark.parametrize("val_fraction", [0.2, 0.5])
def test_shards_read_as_one_split(tmp_path: Path, val_fraction: float) -> None:
    from trainer.data import TokenWindows
    from trainer.data.token_file import ShardedTokens

    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    one = prep.prepare([str(src)], str(tmp_path / "one"), val_fraction=val_fraction, append_eos=True)
    assert "shards" not in one
    meta = prep.prepare([str(src)], str(tmp_path / "many"), val_fraction=val_fraction, append_eos=True,
                        shard_tokens=300)
    files = meta["shards"]["train"]
    assert len(files) > 3 and all(f["tokens"] <= 300 for f in files) and files[0]["file"] == "train-00000.bin"
    whole, sharded = TokenFileDataset(str(tmp_path / "one")), TokenFileDataset(str(tmp_path / "many"))
    assert isinstance(sharded.train_tokens(), ShardedTokens)
    for split in ("train", "val"):
        a = np.asarray(whole.train_tokens() if split == "train" else whole.val_tokens())
        b = np.asarray(sharded.train_tokens() if split == "train" else sharded.val_tokens())
        assert np.array_equal(a, b) and np.array_equal(whole.doc_offsets(split), sharded.doc_offsets(split))
    # windows that cross shard files gather from both
    w1, w2 = TokenWindows(whole.train_tokens(), 64), TokenWindows(sharded.train_tokens(), 64)
    idx = np.arange(len(w1))[::-1]
    assert all(torch_equal(x, y) for x, y in zip(w1.get_batch(idx), w2.get_batch(idx), strict=True))
    assert sharded.train_tokens()[5] == whole.train_tokens()[5]
    assert np.array_equal(sharded.train_tokens()[290:310], whole.train_tokens()[290:310])
    # a shard file that does not match meta.json is refused, naming it
    with open(tmp_path / "many" / "train-00001.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="train-00001.bin: size is 602 bytes but meta.json says 300"):
        TokenFileDataset(str(tmp_path / "many"))


def test_token_tail_split_over_shards(tmp_path: Path) -> None:
    text = tmp_path / "one.txt"
    text.write_text("z" * 1000)
    prep.prepare([str(text)], str(tmp_path / "s"), val_fraction=0.25, shard_tokens=300)
    ds = TokenFileDataset(str(tmp_path / "s"))
    assert ds.meta["split"] == "token_tail" and ds.num_tokens == {"train": 750, "val": 250}
    assert [n for _, n in ds.shards["train"]] == [300, 300, 150] and [n for _, n in ds.shards["val"]] == [150, 100]
    assert bytes(np.asarray(ds.train_tokens()).astype(np.uint8)) + bytes(np.asarray(ds.val_tokens()).astype(
        np.uint8)) == b"z" * 1000


def torch_equal(a: object, b: object) -> bool:
    import torch

    return bool(torch.equal(a, b))  # type: ignore[arg-type]
