"""The built-in generated corpus (autosp.train.sample_corpus) written as files (.txt and
.jsonl), and a BPE tokenizer trained on it, for the tests of ``autosp train``'s data path (no
download)."""

from __future__ import annotations

import json
from pathlib import Path

from autosp.train import sample_corpus

def documents(n: int = 40, seed: int = 0) -> list[str]:
    return list(sample_corpus.documents(n, seed))


def write_corpus(folder: Path, n: int = 40, seed: int = 0) -> Path:
    """Half the documents as .txt files, half as one .jsonl file."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = documents(n, seed)
    for i, d in enumerate(docs[: n // 2]):
        (folder / f"doc{i:03d}.txt").write_text(d)
    with open(folder / "rest.jsonl", "w") as fh:
        for d in docs[n // 2:]:
            fh.write(json.dumps({"text": d}) + "\n")
    return folder


def train_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE trained on the corpus, saved as a Hugging Face tokenizer folder with
    an end-of-document token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    return folder
