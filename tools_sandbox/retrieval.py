"""The ``retrieve`` tool: BM25 search over a folder of documents, for iterative RAG.

The corpus is every ``.md`` and ``.txt`` file under a folder (the shipped demo corpus
in tools_sandbox/corpus, or ``AMPD_CORPUS_DIR``), split into paragraphs, indexed with
bm25s once per worker process.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import bm25s

SHIPPED_CORPUS = Path(__file__).parent / "corpus"


@dataclass(frozen=True)
class Passage:
    source: str
    text: str


def corpus_dir() -> Path:
    return Path(os.environ.get("AMPD_CORPUS_DIR", SHIPPED_CORPUS))


def load_passages(folder: Path) -> list[Passage]:
    passages = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".md", ".txt") and p.is_file()):
        for paragraph in path.read_text(errors="replace").split("\n\n"):
            text = " ".join(line.lstrip("#").strip() for line in paragraph.splitlines()).strip()
            if text:
                passages.append(Passage(str(path.relative_to(folder)), text))
    return passages


@functools.cache
def _index(folder: Path) -> tuple[bm25s.BM25, list[Passage]]:
    passages = load_passages(folder)
    if not passages:
        raise ValueError(f"no .md or .txt documents under {folder}")
    index = bm25s.BM25()
    index.index(bm25s.tokenize([p.text for p in passages], show_progress=False), show_progress=False)
    return index, passages


def retrieve(query: str, k: int = 3, folder: Path | None = None) -> list[Passage]:
    index, passages = _index(folder or corpus_dir())
    tokens = bm25s.tokenize([query], show_progress=False)
    if not tokens.vocab:  # only stop words: nothing to match
        return []
    ids, scores = index.retrieve(tokens, k=min(k, len(passages)), show_progress=False)
    return [passages[i] for i, score in zip(ids[0], scores[0], strict=True) if score > 0]
