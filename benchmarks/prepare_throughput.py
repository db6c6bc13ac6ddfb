"""Tokens/s of `python -m trainer.data.prepare` with 1 and 2 worker processes on a generated corpus.

The corpus (default 50 MB of JSONL, deterministic, English-like: Zipf-distributed words of a fixed
vocabulary in sentences and paragraphs) and a byte-level BPE tokenizer (trained on its first 2 MB with
`tokenizers`, vocabulary 8192) are written into a temporary directory; nothing downloads. Each worker count
runs `prepare` through its CLI entry point (`main`, as `python -m` runs it) `--repeats` times, alternating
(1, 2, 2, 1, ...) so that machine noise hits both alike; the best wall time of each is reported, with the
ratio. Both outputs are checked to be byte-identical.

    python benchmarks/prepare_throughput.py                       # ~2 minutes on 2 CPU cores
    python benchmarks/prepare_throughput.py --mb 5 --repeats 1    # smoke test

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.data.prepare import main as prepare_main  # noqa: E402


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSONL documents of Zipf-distributed words until ``megabytes`` MB; returns the bytes written."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    # 20k distinct words, short ones frequent (as in English)
    words = ["".join(rng.choice(letters, size=int(n))) for n in np.clip(rng.poisson(4, 20_000) + 1, 1, 14)]
    target = int(megabytes * 1e6)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            ranks = np.minimum(rng.zipf(1.2, size=int(rng.integers(80, 1200))), len(words)) - 1
            sentences = []
            for chunk in np.array_split(ranks, max(1, len(ranks) // 15)):
                s = " ".join(words[i] for i in chunk)
                sentences.append(s[:1].upper() + s[1:] + ".")
            line = json.dumps({"text": " ".join(sentences)}) + "\n"
            f.write(line)
            written += len(line.encode())
    return written


def train_tokenizer(corpus: Path, out: Path, vocab: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample() -> list[str]:
        texts, size = [], 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
                size += len(texts[-1])
                if size > 2_000_000:
                    break
        return texts

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(out))
    return out


def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> tuple[float, int]:
    """Wall seconds and tokens written by one `prepare` run."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = prepare_main([str(corpus), "--output", str(out), "--tokenizer", str(tokenizer), "--append-eos",
                             "--workers", str(workers), "--no-progress"])
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"prepare failed with status {code}")
    meta = json.loads((out / "meta.json").read_text())
    return seconds, sum(meta["num_tokens"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="corpus size in MB (default 50)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per worker count (default 2)")
    args = parser.parse_args()
    # Each worker process is one tokenizing thread: the comparison is processes, not the Rust thread pool.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        size = make_corpus(corpus, args.mb)
        tokenizer = train_tokenizer(corpus, root / "tokenizer.json")
        print(f"corpus: {size / 1e6:.1f} MB of JSONL, tokenizer: byte-level BPE, vocabulary 8192; "
              f"{os.cpu_count()} CPU cores")
        best: dict[int, float] = {}
        tokens = 0
        order = [1, 2, 2, 1] * ((args.repeats + 1) // 2)
        for workers in order[: 2 * args.repeats]:
            seconds, tokens = run_prepare(corpus, tokenizer, root / f"out{workers}", workers)
            best[workers] = min(best.get(workers, float("inf")), seconds)
            print(f"workers={workers}: {seconds:.2f} s, {tokens / seconds:,.0f} tokens/s")
        for name in ("train.bin", "val.bin", "train.offsets.bin", "val.offsets.bin"):
            if (root / "out1" / name).read_bytes() != (root / "out2" / name).read_bytes():
                raise SystemExit(f"outputs differ: {name}")
    rates = {w: tokens / s for w, s in best.items()}
    ratio = rates[2] / rates[1]
    print(f"best: 1 worker {rates[1]:,.0f} tokens/s, 2 workers {rates[2]:,.0f} tokens/s, ratio 2/1 = {ratio:.2f} "
          f"({tokens:,} tokens, {size / tokens:.2f} bytes/token)")
    print(json.dumps({"corpus_bytes": size, "tokens": tokens, "tokens_per_s_1_worker": rates[1],
                      "tokens_per_s_2_workers": rates[2], "ratio_2_over_1": ratio,
                      "seconds_1_worker": best[1], "seconds_2_workers": best[2]}))


if __name__ == "__main__":
    main()
