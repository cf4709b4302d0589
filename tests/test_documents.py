"""``autosp train``'s document data (autosp.train.documents, autosp.train.data.Batches): packing,
attention within documents, data-parallel sampling, and the input check across an SP group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import corpus
from autosp.errors import AutospError
from autosp.train.config import DataConfig
from autosp.train.data import Batches
from autosp.train.documents import ByteTokenizer, PackedDocuments, iter_texts, load_tokenizer
from distributed import run_ranks

DOCS = ["ab", "cdefghij", "k", "lmnopqrstuvwxyz0123456789", "XY"]


def _packed(seq_len: int, streaming: bool = False) -> PackedDocuments:
    return PackedDocuments(lambda: iter(DOCS), ByteTokenizer(), seq_len, streaming)


def test_packing_positions_and_labels() -> None:
    """The stream is every document then its end token; positions restart at each document
    (and continue into the next sequence); a document's first token is not a target."""
    docs = _packed(8)
    stream = [t for d in DOCS for t in list(d.encode()) + [256]]
    ids = torch.cat([docs.sequence(k)[0] for k in range(8)])
    pos = torch.cat([docs.sequence(k)[1] for k in range(8)])
    labels = torch.cat([docs.sequence(k)[2] for k in range(8)])
    n = len(stream)
    assert ids[:n].tolist() == stream
    assert ids[n:].tolist() == stream[: 64 - n]  # the next epoch starts over
    expected_pos = [p for d in DOCS for p in range(len(d) + 1)]
    assert pos[:n].tolist() == expected_pos
    assert pos[8].item() == 5 and pos[16].item() == 2  # documents continue across sequences
    assert (labels == -100).tolist() == (pos == 0).tolist()


@pytest.mark.parametrize("streaming", [False, True])
def test_positions_restart_where_the_models_position_table_ends(streaming: bool) -> None:
    """With a model's table of 4 positions (GPT-2's learned positions), a longer document
    restarts at 0 every 4 tokens, as documents of 4 tokens; the first token of each is not a
    target. Positions 4 and up failed mid-run with GPT-2 (found by breaker helper-88)."""
    docs = _packed(8, streaming)
    docs.max_position = 4
    pos = torch.cat([docs.sequence(k)[1] for k in range(8)])
    labels = torch.cat([docs.sequence(k)[2] for k in range(8)])
    n = sum(len(d) + 1 for d in DOCS)
    assert pos[:n].tolist() == [p % 4 for d in DOCS for p in range(len(d) + 1)]
    assert int(pos.max()) == 3
    assert (labels == -100).tolist() == (pos == 0).tolist()


def test_streaming_gives_the_same_sequences() -> None:
    a, b = _packed(7), _packed(7, streaming=True)
    for k in [0, 1, 4, 9, 2, 2, 12]:  # forward, past an epoch, back (the stream restarts)
        assert all(torch.equal(x, y) for x, y in zip(a.sequence(k), b.sequence(k))), k


def _per_document_losses(logits: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                         pos: torch.Tensor) -> list[float]:
    """Mean next-token loss of each document of one packed row (targets of -100 dropped)."""
    ce = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")
    doc = (pos == 0).cumsum(0)[1:]  # the document of each target
    valid = labels[1:] != -100
    return [ce[(doc == d) & valid].mean().item() for d in doc[valid].unique()]


@pytest.mark.parametrize("family", ["tiny-llama", "hf-qwen2"])
def test_packed_documents_give_their_own_losses(family: str) -> None:
    """A packed row of whole documents gives each document the loss it has alone: attention
    and positions never cross a document boundary."""
    torch.manual_seed(0)
    if family == "tiny-llama":
        from autosp.models.llama import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, num_layers=2,
                                             num_heads=4, num_kv_heads=2)).eval()

        def logits(ids, pos=None):
            return model(ids[None], position_ids=None if pos is None else pos[None])[0]
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("qwen2", vocab_size=257, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   attn_implementation="sdpa")
        hf = AutoModelForCausalLM.from_config(cfg).eval()

        def logits(ids, pos=None):
            return hf(input_ids=ids[None], position_ids=None if pos is None else pos[None],
                      use_cache=False).logits[0]  # with a cache, transformers ignores packing

    stream = [list(d.encode()) + [256] for d in DOCS]
    total = sum(len(d) for d in stream)
    ids, pos, labels = _packed(total).sequence(0)
    with torch.no_grad():
        packed = _per_document_losses(logits(ids, pos), ids, labels, pos)
        alone = []
        for d in stream:
            t = torch.tensor(d)
            alone.append(F.cross_entropy(logits(t)[:-1], t[1:]).item())
    # the one-token document "k" + end token has one target, like the others
    assert packed == pytest.approx(alone, rel=1e-5, abs=1e-6)


def test_data_parallel_ranks_get_disjoint_batches(tmp_path: Path) -> None:
    corpus.write_corpus(tmp_path / "c")
    data = DataConfig(source=str(tmp_path / "c"))
    b = Batches(data, seq_len=32, batch_size=2, grad_accum=2, dp_size=2, seed=0)
    seen = {}
    for step in range(3):
        for micro in range(2):
            for r in range(2):
                ids, labels, pos = b.micro_batch(step, micro, r, vocab=0)
                assert ids.shape == (2, 32) and pos.shape == (2, 32)
                for row in ids:
                    key = tuple(row.tolist())
                    assert key not in seen, "two micro-batches share a sequence"
                    seen[key] = (step, micro, r)
    # another Batches over the same files (another rank of the SP group) draws the same
    again = Batches(data, seq_len=32, batch_size=2, grad_accum=2, dp_size=2, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(again.micro_batch(2, 1, 1, 0), b.micro_batch(2, 1, 1, 0)))
    assert b.vocab_size == 257


def test_data_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(AutospError, match="data.source .*no such file"):
        list(iter_texts(str(tmp_path / "missing"), "text"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AutospError, match="found no .txt"):
        list(iter_texts(str(tmp_path / "empty"), "text"))
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(AutospError, match=r"x.jsonl:1: found keys \['body'\]"):
        list(iter_texts(str(tmp_path / "x.jsonl"), "text"))
    with pytest.raises(AutospError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "no-tokenizer"))


def test_tokenizer_larger_than_the_model(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from autosp.train.config import ModelConfig
    from autosp.train.model import build_model

    AutoConfig.for_model("qwen2", vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2).save_pretrained(tmp_path)
    with pytest.raises(AutospError, match="found 257 token ids; expected at most the model's vocab_size 100"):
        build_model(ModelConfig(hf_config=str(tmp_path)), seed=0, vocab_size=257)


def _sp_group_worker(rank: int, world: int, folders: list[str]) -> str:
    """Each rank's loader reads folders[rank]; one micro-batch through the compiled model."""
    import autosp
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM

    mesh = autosp.init_mesh(world)
    b = Batches(DataConfig(source=folders[rank]), seq_len=32, batch_size=2, grad_accum=1,
                dp_size=1, seed=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, num_layers=1, num_heads=4))
    compiled = autosp.compile(model, mesh=mesh, backend="aot_eager", remat="none")
    try:
        compiled(*b.micro_batch(0, 0, 0, 257)).backward()
    except autosp.AutospError as e:
        return "error: " + str(e)
    return "ok"


def test_sp_group_fed_different_documents_stops(tmp_path: Path) -> None:
    """The same files on every rank of an SP group train; one rank reading other files
    (a wrong path, a stale copy) is stopped by autosp's input check at the first step."""
    corpus.write_corpus(tmp_path / "a", seed=0)
    corpus.write_corpus(tmp_path / "b", seed=1)
    same = run_ranks(2, _sp_group_worker, [str(tmp_path / "a")] * 2)
    assert same == ["ok", "ok"]
    other = run_ranks(2, _sp_group_worker, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert all(r.startswith("error: ") for r in other), other
    assert "input_ids" in other[0] or "input" in other[0], other[0]


def test_a_model_that_ignores_packed_positions_is_refused() -> None:
    from autosp.models.llama import LlamaConfig, LlamaForCausalLM
    from autosp.train.model import check_attends_within_documents

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4))
    check_attends_within_documents(llama, 64)  # its document mask: accepted

    class IgnoresPositions(torch.nn.Module):  # causal over the whole row
        def __init__(self) -> None:
            super().__init__()
            self.model = llama

        def forward(self, ids, labels, position_ids=None):
            return self.model(ids, labels)

    with pytest.raises(AutospError, match="attention to stay within each document"):
        check_attends_within_documents(IgnoresPositions(), 64)


@pytest.mark.slow  # 90 s; the default suite keeps the 2-rank runs of test_cli and test_train_faults
def test_train_hf_model_on_documents_four_ranks(tmp_path: Path) -> None:
    """The issue's run: 4 ranks (dp2 x sp2), a tiny Hugging Face Qwen2 from its config, a
    local corpus (.txt and .jsonl) with a BPE tokenizer trained here, packed documents, 30
    steps: the loss falls, every metrics field is written, the first step equals one device,
    and a run resumed from step 27 repeats steps 27-29 exactly."""
    import subprocess

    from transformers import AutoConfig

    from autosp.train.metrics import FIELDS
    from test_cli import _autosp_command
    from test_train_faults import ENV

    corpus.write_corpus(tmp_path / "corpus")
    corpus.train_tokenizer(tmp_path / "tok")
    AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024).save_pretrained(tmp_path / "qwen2")
    base = [*_autosp_command(), "train", "--nproc", "4", "--sp", "2", "--hf-config",
            str(tmp_path / "qwen2"), "--source", str(tmp_path / "corpus"), "--tokenizer",
            str(tmp_path / "tok"), "--seq-len", "64", "--batch-size", "2", "--steps", "30",
            "--lr", "3e-3", "--warmup-steps", "3", "--backend", "aot_eager", "--predict", "false"]

    def run(out: Path, *extra: str) -> list[dict]:
        proc = subprocess.run([*base, "--out-dir", str(out), *extra], capture_output=True,
                              text=True, timeout=900, env=ENV)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "dp 2 x sp 2" in proc.stdout
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    full = run(tmp_path / "a", "--checkpoint-every", "27", "--check")
    assert [r["step"] for r in full] == list(range(30))
    assert all(set(FIELDS) <= set(r) for r in full)
    assert all(r["tokens"] == 2 * 64 * 2 for r in full)  # batch x seq x dp
    first, last = sum(r["loss"] for r in full[:3]) / 3, sum(r["loss"] for r in full[-3:]) / 3
    assert last < 0.6 * first, (first, last)
    resumed = run(tmp_path / "b", "--resume", str(tmp_path / "a" / "checkpoints" / "step-27"))
    assert [r["step"] for r in resumed] == [27, 28, 29]
    for a, b in zip(full[27:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a, b)


@pytest.mark.parametrize("name, content, found", [
    ("bad.txt", b"caf\xe9", "bad.txt: found bytes that are not UTF-8"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', r"bad.jsonl:2: found invalid JSON"),
    ("num.jsonl", b'{"text": 123}\n', r"num.jsonl:1: found text = 123"),
    ("str.jsonl", b'"just a string"\n', r"str.jsonl:1: found a str"),
    ("docs.json", b'["a", "b"]', "found a file of a kind autosp does not read"),
])
def test_unreadable_documents_name_the_file_and_line(tmp_path: Path, name: str, content: bytes,
                                                     found: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(AutospError, match=found):
        list(iter_texts(str(tmp_path / name), "text"))
