"""Benchmark: start-up tokenization in one process vs ``data.num_workers`` processes, and the per-step
batch assembly (index the dataset + ``pack_batch``) that the trainers do.

    python scripts/bench/data.py --rows 200000 --workers 2 --out result.json

Generates an SFT JSONL of ``--rows`` rows of random words (seeded) and a byte-level BPE
``tokenizer.json`` trained on its first rows, then times ``load_sft_dataset`` with the byte tokenizer
and with the HF tokenizer, serial and with workers (process start-up included), and checks that
the datasets are identical. The per-step figure packs ``--batch`` rows of ``--seq-len`` tokens.
Worker processes re-run this file's top level (spawn): keep the imports inside the functions (this
is why it times with its own wall + CPU clock rather than ``common.py``'s, which imports torch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_rows(path: Path, rows: int, seed: int) -> None:
    """SFT rows of ~20-word prompts and ~60-word responses from a 5,000-word vocabulary."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]
    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choices(words, k=rng.randint(10, 30)))
            response = " ".join(rng.choices(words, k=rng.randint(30, 90)))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def make_hf_tokenizer(data: Path, out: Path, rows: int) -> None:
    """A GPT-2-style byte-level BPE (vocabulary 8,192) trained on the first ``rows`` rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with data.open(encoding="utf-8") as f:
        texts = [" ".join(json.loads(line).values()) for line in itertools.islice(f, rows)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=8192, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def cpu_seconds() -> float:
    """User + system CPU of this process and of its finished children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(run: Callable[[], Any]) -> tuple[Any, float, float]:
    """``run()``'s result, wall seconds and CPU seconds (workers included: on a shared machine the
    wall time also says how busy the others kept the cores)."""
    start, cpu = time.perf_counter(), cpu_seconds()
    out = run()
    return out, round(time.perf_counter() - start, 2), round(cpu_seconds() - cpu, 2)


def time_loads(path: Path, tokenizer: Any, workers: int) -> dict[str, float]:
    """Seconds to load ``path`` serially and with ``workers`` processes (their start-up included);
    the datasets must be equal."""
    from megatron_rlhf.data import load_sft_dataset

    out, datasets = {}, {}
    for n in (0, workers):
        (datasets[n], report), out[f"workers_{n}_s"], out[f"workers_{n}_cpu_s"] = timed(
            lambda n=n: load_sft_dataset(path, tokenizer, max_length=4096, num_workers=n)
        )
    serial, parallel = datasets[0], datasets[workers]
    assert report.kept == len(serial) and serial.lengths.equal(parallel.lengths)
    assert all(
        serial[i].input_ids.equal(parallel[i].input_ids) and serial[i].loss_mask.equal(parallel[i].loss_mask)
        for i in range(0, len(serial), 97)
    )
    out["tokens"] = int(serial.lengths.sum())
    return out


def time_batches(tmp: Path, batch: int, seq_len: int, steps: int) -> dict[str, float]:
    """Per-step batch assembly: ``batch`` random rows of ``seq_len`` tokens, indexed and packed."""
    import torch

    from megatron_rlhf.data import ByteTokenizer, load_sft_dataset, pack_batch

    rng = random.Random(0)
    path = tmp / "step.jsonl"
    with path.open("w") as f:
        for _ in range(4 * batch):
            prompt = rng.randint(64, 256)
            n = rng.randint(seq_len // 2, seq_len - 1) - prompt
            f.write(
                json.dumps(
                    {
                        "prompt_ids": [rng.randrange(3, 259) for _ in range(prompt)],
                        "response_ids": [rng.randrange(3, 259) for _ in range(n)],
                    }
                )
                + "\n"
            )
    dataset, _ = load_sft_dataset(path, ByteTokenizer(300), max_length=seq_len)
    index_s, pack_s = [], []
    for step in range(steps):
        rows = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(step))[:batch].tolist()
        start = time.perf_counter()
        examples = [dataset[i] for i in rows]
        middle = time.perf_counter()
        packed = pack_batch(examples, 0)
        index_s.append(middle - start)
        pack_s.append(time.perf_counter() - middle)
    return {
        "index_ms": round(1000 * statistics.median(index_s), 2),
        "pack_ms": round(1000 * statistics.median(pack_s), 2),
        "shape": list(packed["input_ids"].shape),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from megatron_rlhf.data import ByteTokenizer, load_sft_dataset, load_tokenizer
    from megatron_rlhf.data.records import split_files

    result: dict[str, object] = {
        "rows": args.rows,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "load_average_before": os.getloadavg()[0],
    }  # a shared machine: say how busy
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        data = tmp / "sft.jsonl"
        write_rows(data, args.rows, seed=0)
        make_hf_tokenizer(data, tmp, rows=5000)
        result["file_mb"] = round(data.stat().st_size / 2**20, 1)
        few = tmp / "few.jsonl"
        with data.open() as f:
            few.write_text("".join(itertools.islice(f, 64)))
        # 64 rows: the workers' start-up; then the scan for spans, done in the main process.
        _, result["worker_start_s"], result["worker_start_cpu_s"] = timed(
            lambda: load_sft_dataset(few, ByteTokenizer(300), max_length=4096, num_workers=args.workers)
        )
        _, result["split_s"], _ = timed(lambda: split_files([data], 4 * args.workers))
        result["byte"] = time_loads(data, ByteTokenizer(300), args.workers)
        result["hf_bpe"] = time_loads(data, load_tokenizer(tmp), args.workers)
        result["per_step"] = time_batches(tmp, args.batch, args.seq_len, args.steps)
    result["load_average_after"] = os.getloadavg()[0]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
