"""Training text for draft heads: a corpus file split into documents, with a fixed held-out part.

A corpus is a text file (optionally .xz) of documents separated by `<|endoftext|>` lines; a
document may start with a `# file: PATH` line (as in the demo pair's corpus, the Python 3.11
standard library's sources). Documents whose name sorts into the last 5% are held out, so the
same split serves training and measurement everywhere.
"""

from __future__ import annotations

import lzma
import math
import os

HOLDOUT_FRACTION = 0.05
EOS = "<|endoftext|>"


def read_documents(corpus: str | os.PathLike) -> list[tuple[str, str]]:
    """[(name, text)] in file order."""
    opener = lzma.open if str(corpus).endswith(".xz") else open
    with opener(corpus, "rt", encoding="utf-8") as f:
        text = f.read()
    docs: list[tuple[str, str]] = []
    for chunk in text.split(EOS):
        chunk = chunk.strip("\n")
        if not chunk:
            continue
        header, _, body = chunk.partition("\n")
        if header.startswith("# file: "):
            docs.append((header[len("# file: "):], body))
        else:
            docs.append((f"doc{len(docs):06d}", chunk))
    return docs


def split_documents(corpus) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training documents, held-out documents); held out = names sorting into the last 5%."""
    docs = sorted(read_documents(corpus))
    if len(docs) < 2:
        raise ValueError(f"{corpus}: needs at least 2 documents separated by {EOS!r}, found {len(docs)}")
    cut = min(len(docs) - 1, int(math.floor(len(docs) * (1 - HOLDOUT_FRACTION))))
    return docs[:cut], docs[cut:]


def encode_documents(tokenizer, docs, eos_id: int) -> list[int]:
    """All documents' token ids, each followed by `eos_id`."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch([body for _, body in docs]):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return ids
