"""Prompts for `spectandem bench serve`: a JSONL file of {"prompt": ...} lines, or windows of the
held-out documents of a corpus file (drafter/data.py's format and split).

The shipped default, benchmarks/data/heldout-prompts.jsonl, was made by

    python -m benchmarks.bench.datasets --corpus python-stdlib-3.11.txt.xz \\
        --out benchmarks/data/heldout-prompts.jsonl

(the demo pair's corpus; 512 prompts, seed 0, 32-256 tokens each under the demo tokenizer). The
same windows are cut when `--dataset` names a corpus file directly.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATASET = Path(__file__).resolve().parent.parent / "data" / "heldout-prompts.jsonl"
CORPUS_SUFFIXES = (".txt", ".txt.xz")
MIN_TOKENS, MAX_TOKENS = 32, 256      # window lengths, in demo-tokenizer tokens
GENERATED_PROMPTS = 512


class DatasetError(Exception):
    """A dataset that cannot be read: missing, unreadable, empty or malformed."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text and where it came from (a JSONL line number or a held-out document)."""

    text: str
    source: str


def is_corpus(path: str | Path) -> bool:
    return str(path).endswith(CORPUS_SUFFIXES)


def load_prompts(path: str | Path, *, seed: int = 0, count: int = GENERATED_PROMPTS) -> list[Prompt]:
    """The prompts of a JSONL file (all of them, in file order) or of a corpus file (`count`
    windows of its held-out documents, cut with `seed`)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"--dataset: {path} does not exist or is not a file")
    if is_corpus(path):
        return corpus_prompts(path, count, seed)
    return jsonl_prompts(path)


def jsonl_prompts(path: Path) -> list[Prompt]:
    """Each line's "prompt" (a non-empty string) and "source" (optional: where the prompt came
    from; default FILE:LINE); blank lines are skipped."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"--dataset: {path}:{n}: not JSON ({exc.msg})") from None
            text = row.get("prompt") if isinstance(row, dict) else None
            if not isinstance(text, str) or not text:
                raise DatasetError(f'--dataset: {path}:{n}: expected {{"prompt": "<non-empty text>"}}')
            source = row.get("source")
            prompts.append(Prompt(text, source if isinstance(source, str) else f"{path.name}:{n}"))
    if not prompts:
        raise DatasetError(f"--dataset: {path} holds no prompts")
    return prompts


def corpus_prompts(corpus: Path, count: int, seed: int, tokenizer=None) -> list[Prompt]:
    """`count` windows of MIN_TOKENS..MAX_TOKENS tokens (demo tokenizer) of the corpus's held-out
    documents, each an exact slice of one document's text: documents taken in turn, window length
    and start drawn from `seed`. Documents shorter than MIN_TOKENS are skipped; a document shorter
    than the drawn length gives its whole text."""
    from drafter.data import split_documents

    try:
        _, held = split_documents(corpus)
    except (OSError, EOFError, ValueError) as exc:   # unreadable, a broken .xz, too few documents
        raise DatasetError(f"--dataset: {corpus}: {exc}") from None
    tokenizer = tokenizer or _demo_tokenizer()
    docs = []
    for (name, body), enc in zip(held, tokenizer.encode_batch([body for _, body in held])):
        if len(enc.ids) >= MIN_TOKENS:
            docs.append((name, body, enc.offsets))
    if not docs:
        raise DatasetError(f"--dataset: {corpus}: no held-out document has {MIN_TOKENS} tokens or more")
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        name, body, offsets = docs[i % len(docs)]
        length = min(rng.randint(MIN_TOKENS, MAX_TOKENS), len(offsets))
        start = rng.randint(0, len(offsets) - length)
        a, b = offsets[start][0], offsets[start + length - 1][1]
        prompts.append(Prompt(body[a:b], f"{name}@{a}:{b}"))
    return prompts


def _demo_tokenizer():
    from spectandem.checkpoint import load_tokenizer
    from spectandem.demo import demo_paths

    return load_tokenizer(demo_paths("none")[0])


def write_jsonl(prompts: list[Prompt], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.text, "source": p.source}, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="corpus file (.txt or .txt.xz, drafter/data.py's format)")
    ap.add_argument("--out", default=str(DEFAULT_DATASET), help="JSONL file to write")
    ap.add_argument("--count", type=int, default=GENERATED_PROMPTS, help="prompts to cut")
    ap.add_argument("--seed", type=int, default=0, help="seed of the window lengths and starts")
    args = ap.parse_args(argv)
    prompts = corpus_prompts(Path(args.corpus), args.count, args.seed)
    write_jsonl(prompts, Path(args.out))
    print(f"-> {args.out}: {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
