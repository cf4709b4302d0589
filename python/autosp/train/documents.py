"""Documents from local files, tokenised and packed into sequences of S tokens.

Sources (``data.source``: ``sample``, the built-in generated stories, or a file or a folder,
read in sorted path order):
  - ``.txt`` / ``.md``: each file is one document;
  - ``.jsonl``: one document per line, the string in ``data.text_field``;
  - ``.parquet``: the ``data.text_field`` column (needs pyarrow);
  - a ``datasets`` folder saved with ``save_to_disk`` (needs datasets).

Tokenizer (``data.tokenizer``): ``bytes`` (UTF-8 bytes, end of document 256, 257 ids) or a
local Hugging Face tokenizer folder (its ``eos_token_id`` ends each document).

Packing: the documents, each followed by the end-of-document token, form one token stream;
sequence k is tokens [k*S, (k+1)*S). Each token's position counts from 0 at its document's
start (and keeps counting when a document continues into the next sequence), so a model
given ``position_ids`` attends within documents only (autosp.models.llama's
``document_mask``; Hugging Face models' packed-sequence masks). The label of a document's
first token is -100: the previous document's last token does not learn to predict it.
For a model with a table of n positions (``max_position``: GPT-2's learned positions), a
longer document restarts at 0 every n tokens, as documents of n tokens each.
After the last sequence the stream starts again (the next epoch).

With ``data.streaming`` the files are read as the sequences are needed (for data larger than
memory); otherwise the whole stream is tokenised at start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autosp.errors import AutospError


class ByteTokenizer:
    """UTF-8 bytes; 256 ends a document."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(folder)
        if self.tok.eos_token_id is None:
            raise AutospError(f"[autosp:train] data.tokenizer = {folder!r}: found a tokenizer "
                              "without an eos_token; expected one, to end each packed document")
        self.eos_id = int(self.tok.eos_token_id)
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    if spec in ("", "bytes"):
        return ByteTokenizer()
    if not os.path.isdir(spec):
        raise AutospError(f"[autosp:train] data.tokenizer = {spec!r}: found no such folder; "
                          "expected 'bytes' or a local Hugging Face tokenizer folder")
    return HFTokenizer(spec)


_EXTENSIONS = (".txt", ".md", ".jsonl", ".parquet")


def _files(source: str) -> list[str]:
    if os.path.isfile(source):
        if not source.endswith(_EXTENSIONS):
            raise AutospError(f"[autosp:train] data.source = {source!r}: found a file of a kind "
                              f"autosp does not read; expected one of {list(_EXTENSIONS)}, or a "
                              "folder of them")
        return [source]
    if not os.path.isdir(source):
        raise AutospError(f"[autosp:train] data.source = {source!r}: found no such file or "
                          "folder; expected 'synthetic', a file or a folder of documents")
    if os.path.isfile(os.path.join(source, "dataset_info.json")):
        return [source]  # a datasets folder
    found = sorted(os.path.join(root, f) for root, _, names in os.walk(source) for f in names
                   if f.endswith(_EXTENSIONS))
    if not found:
        raise AutospError(f"[autosp:train] data.source = {source!r}: found no .txt, .md, .jsonl "
                          "or .parquet file in it")
    return found


def _need(module: str, what: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise AutospError(f"[autosp:train] data.source: reading {what} needs the '{module}' "
                          f"package; install it (pip install {module.split('.')[0]})") from None


def iter_texts(source: str, text_field: str) -> Iterator[str]:
    """Every document of ``source``, in order ("sample": the built-in generated stories)."""
    if source == "sample":
        from autosp.train.sample_corpus import documents

        yield from documents()
        return
    for path in _files(source):
        if os.path.isdir(path):
            ds = _need("datasets", "a datasets folder").load_from_disk(path)
            yield from (row[text_field] for row in ds)
        elif path.endswith(".parquet"):
            pq = _need("pyarrow.parquet", ".parquet files")
            for batch in pq.ParquetFile(path).iter_batches(columns=[text_field]):
                yield from batch.column(0).to_pylist()
        elif path.endswith(".jsonl"):
            yield from _jsonl_texts(path, text_field)
        else:
            try:
                with open(path, encoding="utf-8") as fh:
                    yield fh.read()
            except UnicodeDecodeError as e:
                raise AutospError(f"[autosp:train] {path}: found bytes that are not UTF-8 ({e}); "
                                  "expected UTF-8 text") from None


def _jsonl_texts(path: str, text_field: str) -> Iterator[str]:
    def bad(n: int, found: str) -> AutospError:
        return AutospError(f"[autosp:train] {path}:{n}: found {found}; expected a JSON object "
                           f"with a string in data.text_field = {text_field!r}")

    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise bad(n, "bytes that are not UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise bad(n, f"invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise bad(n, f"a {type(row).__name__}")
            if not isinstance(row.get(text_field), str):
                found = (f"keys {sorted(row)}" if text_field not in row
                         else f"{text_field} = {row[text_field]!r}")
                raise bad(n, found)
            yield row[text_field]


def _token_stream(texts: Callable[[], Iterator[str]], tok: Any) -> Iterator[tuple[int, int]]:
    """(token, position in its document), over the documents, forever."""
    while True:
        empty = True
        for text in texts():
            ids = tok.encode(text) + [tok.eos_id]
            empty = False
            yield from ((t, p) for p, t in enumerate(ids))
        if empty:
            raise AutospError("[autosp:train] data.source holds no document")


class PackedDocuments:
    """Sequence k of the packed stream: (ids [S], position_ids [S], labels [S])."""

    def __init__(self, texts: Callable[[], Iterator[str]], tok: Any, seq_len: int,
                 streaming: bool) -> None:
        self.seq_len = seq_len
        self.streaming = streaming
        #: The model's position table's size (train.model.position_table_size), or None.
        self.max_position: int | None = None
        self._texts, self._tok = texts, tok
        if not streaming:
            ids: list[int] = []
            pos: list[int] = []
            for text in texts():
                doc = tok.encode(text) + [tok.eos_id]
                ids += doc
                pos += range(len(doc))
            if not ids:
                raise AutospError("[autosp:train] data.source holds no document")
            self._ids = torch.tensor(ids, dtype=torch.long)
            self._pos = torch.tensor(pos, dtype=torch.long)
        self._restart()

    def _restart(self) -> None:
        self._stream = _token_stream(self._texts, self._tok) if self.streaming else None
        self._next = 0  # the index of the sequence the stream yields next

    def sequence(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        S = self.seq_len
        if not self.streaming:
            n = self._ids.numel()
            idx = torch.arange(k * S, (k + 1) * S) % n  # wraps around: the next epoch
            ids, pos = self._ids[idx], self._pos[idx]
        else:
            if k < self._next:
                self._restart()
            while True:
                chunk = [next(self._stream) for _ in range(S)]
                self._next += 1
                if self._next - 1 == k:
                    break
            ids = torch.tensor([t for t, _ in chunk], dtype=torch.long)
            pos = torch.tensor([p for _, p in chunk], dtype=torch.long)
        if self.max_position:
            pos = pos % self.max_position
        labels = ids.clone()
        labels[pos == 0] = -100
        return ids, pos, labels
