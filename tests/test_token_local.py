"""Token-local regions: MoE routing written with data-dependent indices (torch.where on a
sharded expert mask, the routed rows gathered, an expert MLP on them, index_add_ back into
the tokens). Each rank routes its own tokens; the core proves the region exact or refuses
it (csrc/analysis/rules_local.cpp).

Every case is a tiny model (vocab 128, hidden 32, 4 experts, batch 2, S = 16 at world 2)
compiled with autosp (aot_eager, no remat) and compared with itself on one device by
styles.run_case: the loss within 1e-5 and every gradient max|g - g_ref| / max|g_ref| <=
1e-4, two batches. All cases run in one spawn of two Gloo ranks; each is then its own test.
The refusals are the ways routing can go wrong on a rank's share of the tokens: mixing the
routed rows (sort, cumsum, mean over them), reading this rank's count of routed tokens as a
number, positions used on a dim they were not found in, the [n, ndim] form of nonzero, and
random draws on the routed rows.
"""

from __future__ import annotations

import functools
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import styles
from distributed import make_batch, run_ranks

V, D, B, E = 128, 32, 2, 4
SEQ_LEN = 16
RANK_TIMEOUT_S = 600.0


def ids_labels(seed: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(V, B, seq_len, seed)


class Routed(nn.Module):
    """Embedding, a router over E experts, ``route(self, h, flat, probs)`` -> (mixed [B*S, D],
    an extra loss term), a head and a cross-entropy."""

    def __init__(self, route: Callable) -> None:
        super().__init__()
        self.route = route
        self.embed = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + torch.tanh(self.fc(h))
        flat = h.view(-1, D)
        probs = F.softmax(self.gate(flat), dim=-1)
        mixed, extra = self.route(self, h, flat, probs)
        logits = self.head(h + mixed.view_as(h))
        # Switch Transformer's load balancing: the gate gets a gradient in every case.
        balance = E * (F.one_hot(probs.argmax(-1), E).float().mean(0) * probs.mean(0)).sum()
        return F.cross_entropy(logits.view(-1, V), labels.reshape(-1)) + 0.1 * extra + 0.01 * balance


def expert(m, e, x):
    return F.gelu(m.experts[e](x))


# ======================================================================================
# Exact.


def r_where_top2(m, h, flat, probs):  # Mixtral's older loop: one_hot + torch.where + index_add_
    w, idx = torch.topk(probs, 2, dim=-1)
    mask = F.one_hot(idx, E).permute(2, 1, 0)  # [E, k, T]
    out = torch.zeros_like(flat)
    for e in range(E):
        slot, tok = torch.where(mask[e])
        out.index_add_(0, tok, expert(m, e, flat[tok]) * w[tok, slot, None])
    return out, flat.new_zeros(())


def r_nonzero_top1_out_of_place(m, h, flat, probs):
    top = probs.argmax(-1)
    out = flat * 0
    for e in range(E):
        tok = torch.nonzero(top == e, as_tuple=True)[0]
        out = out.index_add(0, tok, expert(m, e, flat[tok]) * probs[tok, e, None])
    return out, flat.new_zeros(())


def r_zeros_destination(m, h, flat, probs):  # torch.zeros((B * S, D)) written in place
    w, idx = torch.topk(probs, 2, dim=-1)
    out = torch.zeros((flat.shape[0], D), dtype=flat.dtype)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        out.index_add_(0, tok, expert(m, e, flat[tok]) * w[tok, slot].unsqueeze(-1))
    return out, flat.new_zeros(())


def r_z_loss_over_routed(m, h, flat, probs):  # a sum over routed rows: partial on each rank
    top = probs.argmax(-1)
    out = torch.zeros_like(flat)
    extra = flat.new_zeros(())
    for e in range(E):
        (tok,) = torch.where(top == e)
        y = expert(m, e, flat[tok])
        out.index_add_(0, tok, y)
        extra = extra + (y ** 2).sum() / flat.size(0)
    return out, extra


def r_where_2d_mask(m, h, flat, probs):  # positions of [B, S] pick from [B, S, D]
    b, s = torch.where(h.sum(-1) > 0)
    picked = h[b, s]
    mixed, _ = r_nonzero_top1_out_of_place(m, h, flat, probs)
    return mixed, (picked.pow(2).sum(-1)).sum() / h.numel()


# ======================================================================================
# Refused. Each routes every token (top-1) and adds the wrong step on expert 0's rows.


def top1(m, flat, probs):
    return r_nonzero_top1_out_of_place(m, None, flat, probs)[0]


def r_sort_routed(m, h, flat, probs):
    (tok,) = torch.where(probs.argmax(-1) == 0)
    y = expert(m, 0, flat[tok]).sort(dim=0).values
    return top1(m, flat, probs).index_add(0, tok, y), flat.new_zeros(())


def r_mean_over_routed(m, h, flat, probs):
    (tok,) = torch.where(probs.argmax(-1) == 0)
    return top1(m, flat, probs), expert(m, 0, flat[tok]).mean()


def r_divide_by_local_count(m, h, flat, probs):
    (tok,) = torch.where(probs.argmax(-1) == 0)
    y = expert(m, 0, flat[tok]) / tok.size(0)
    return top1(m, flat, probs).index_add(0, tok, y), flat.new_zeros(())


def r_cumsum_routed(m, h, flat, probs):
    (tok,) = torch.where(probs.argmax(-1) == 0)
    y = expert(m, 0, flat[tok]).cumsum(0)
    return top1(m, flat, probs).index_add(0, tok, y), flat.new_zeros(())


def r_positions_of_another_dim(m, h, flat, probs):  # positions in [S] used on [B*S]
    (tok,) = torch.where(h[0].sum(-1) > 0)
    return top1(m, flat, probs), flat[tok].sum() / flat.numel()


def r_nonzero_matrix(m, h, flat, probs):
    nz = torch.nonzero(probs.argmax(-1) == 0)
    return top1(m, flat, probs), flat[nz[:, 0]].sum() / flat.numel()


def r_dropout_routed(m, h, flat, probs):
    (tok,) = torch.where(probs.argmax(-1) == 0)
    y = F.dropout(expert(m, 0, flat[tok]), 0.5, training=True)
    return top1(m, flat, probs).index_add(0, tok, y), flat.new_zeros(())


# Boolean-mask selection of rows (no routing): a loss over the selected tokens.


class Masked(nn.Module):
    """``loss(self, h, logits, labels)``: a loss over rows selected on each rank's tokens."""

    def __init__(self, loss: Callable) -> None:
        super().__init__()
        self.loss = loss
        self.embed = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + torch.tanh(self.fc(h))
        return self.loss(self, h, self.head(h), labels)


def m_ce_of_selected(m, h, logits, labels):  # cross-entropy over the rows torch.where picks
    (tok,) = torch.where(h.sum(-1).view(-1) > 0)
    return F.cross_entropy(logits.view(-1, V)[tok], labels.view(-1)[tok])


def m_sum_over_count(m, h, logits, labels):  # a boolean-mask selection, summed
    keep = h.sum(-1) > 0
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + h[keep].pow(2).sum() / keep.sum()


def m_mean_of_selected(m, h, logits, labels):  # refused: a mean over the rank's rows
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + h[h.sum(-1) > 0].pow(2).mean()


def m_ce_of_label_mask(m, h, logits, labels):  # refused: the mask from labels is replicated
    keep = labels % 3 != 0
    return F.cross_entropy(logits[keep], labels[keep])


# Found by a breaker review (each was a silent mismatch before its fix).


def r_positions_as_values(m, h, flat, probs):  # refused: tok % S reads chunk positions as numbers
    (tok,) = torch.where(probs.argmax(-1) == 0)
    table = torch.arange(flat.size(0), dtype=flat.dtype)
    return top1(m, flat, probs), table[tok % h.size(1)].sum() / flat.numel()


def r_fill_reads_count(m, h, flat, probs):  # refused: 1/n with n this rank's count
    (tok,) = torch.where(probs.argmax(-1) == 0)
    n = tok.size(0)
    w = torch.full((n, 1), 1.0 / (n + 1))
    return top1(m, flat, probs).index_add(0, tok, expert(m, 0, flat[tok]) * w), flat.new_zeros(())


def m_partial_plus_scalar(m, h, logits, labels):  # exact: P + c needs the sum first
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + (h.pow(2).sum() + 1000.0).sqrt()


def m_selection_sum_over_local_count(m, h, logits, labels):  # refused: a partial / this rank's count
    sel = h[h.sum(-1) > 0]
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + sel.pow(2).sum() / sel.shape[0]


def m_add_scalar_by_keyword(m, h, logits, labels):  # exact: torch.add(P, other=c) reduces first
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + torch.add(h.pow(2).sum(), other=100.0).sqrt()


def m_int_cast_of_partial(m, h, logits, labels):  # exact: the cast waits for the sum
    total = (h.detach().pow(2).sum() * 10).to(torch.int64)
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) * (1 + total.float() * 1e-6)


def m_masked_mean(m, h, logits, labels):  # refused: torch.masked.mean is not mean
    keep = (h.sum(-1) > 0)[..., None].expand_as(h)
    return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + torch.masked.mean(h.pow(2), mask=keep)


CASES: dict[str, Callable] = {
    "where-top2-index-add": r_where_top2,
    "nonzero-top1-out-of-place": r_nonzero_top1_out_of_place,
    "zeros-destination-in-place": r_zeros_destination,
    "z-loss-over-routed": r_z_loss_over_routed,
    "where-2d-mask": r_where_2d_mask,
    "sort-routed": r_sort_routed,
    "mean-over-routed": r_mean_over_routed,
    "divide-by-local-count": r_divide_by_local_count,
    "cumsum-routed": r_cumsum_routed,
    "positions-of-another-dim": r_positions_of_another_dim,
    "nonzero-matrix": r_nonzero_matrix,
    "dropout-routed": r_dropout_routed,
    "positions-as-values": r_positions_as_values,
    "fill-reads-count": r_fill_reads_count,
}
MASKED = {
    "ce-of-mask-selected": m_ce_of_selected,
    "sum-over-mask-count": m_sum_over_count,
    "mean-of-mask-selected": m_mean_of_selected,
    "ce-of-label-mask": m_ce_of_label_mask,
    "partial-plus-scalar": m_partial_plus_scalar,
    "selection-sum-over-local-count": m_selection_sum_over_local_count,
    "add-scalar-by-keyword": m_add_scalar_by_keyword,
    "int-cast-of-partial": m_int_cast_of_partial,
    "masked-mean": m_masked_mean,
}

EXACT = ["where-top2-index-add", "nonzero-top1-out-of-place", "zeros-destination-in-place",
         "z-loss-over-routed", "where-2d-mask", "ce-of-mask-selected", "sum-over-mask-count",
         "partial-plus-scalar", "add-scalar-by-keyword", "int-cast-of-partial"]

# Clear refusals: the op the AutospError must name.
REFUSED = {
    "sort-routed": "sort",
    "mean-over-routed": "mean",
    "divide-by-local-count": "div",
    "cumsum-routed": "cumsum",
    "positions-of-another-dim": "index",
    "dropout-routed": "dropout",
    "mean-of-mask-selected": "mean",
    "ce-of-label-mask": "cross_entropy",
    "positions-as-values": "remainder",
    "fill-reads-count": "full",
    "selection-sum-over-local-count": "div",
}

# Exact by default with the op on the gathered sequence (unsupported="gather"); refused at
# that op with unsupported="error" (run as "<name>[error]").
GATHERED = {
    "nonzero-matrix": "nonzero",
    "masked-mean": "masked_mean",
}


def _worker(rank: int, world_size: int, names: list[str], seq_len: int = SEQ_LEN) -> list[dict]:
    import warnings

    import autosp

    warnings.filterwarnings("ignore")
    mesh = autosp.init_mesh(world_size)
    build = {n: functools.partial(Masked, f) for n, f in MASKED.items()}
    build.update({n: functools.partial(Routed, f) for n, f in CASES.items()})
    out = []
    for n in names:
        out.append(styles.run_case(n, build[n], ids_labels, world_size, seq_len, mesh=mesh))
        if n in GATHERED:
            out.append(styles.run_case(f"{n}[error]", build[n], ids_labels, world_size, seq_len,
                                       mesh=mesh, unsupported="error"))
    return out


@functools.cache
def results() -> tuple[dict[str, dict], ...]:
    per_rank = run_ranks(2, _worker, EXACT + list(REFUSED) + list(GATHERED), timeout=RANK_TIMEOUT_S)
    return tuple({r["name"]: r for r in rank_results} for rank_results in per_rank)


@pytest.mark.parametrize("name", EXACT)
def test_token_local_exact_world2(name: str) -> None:
    styles.raise_worst_outcome(results(), name, "world 2")


@pytest.mark.parametrize("name", sorted(GATHERED))
def test_token_local_gathered_exact(name: str) -> None:
    styles.raise_worst_outcome(results(), name, "world 2")
    for rank, res in enumerate(results()):
        assert res[name]["gathered"], f"rank {rank}: {name} gathered nothing"


@pytest.mark.parametrize("name", sorted(REFUSED) + [f"{n}[error]" for n in sorted(GATHERED)])
def test_token_local_refused_clearly(name: str) -> None:
    import autosp

    with pytest.raises(autosp.AutospError) as info:
        styles.raise_worst_outcome(results(), name, "world 2")
    message = str(info.value)
    op = REFUSED.get(name) or GATHERED[name.removesuffix("[error]")]
    assert f"op '{op}'" in message, message
    assert "test_token_local.py:" in message, f"the refusal does not name the source line: {message}"


@pytest.mark.slow
def test_token_local_exact_world4() -> None:
    """The exact cases at world 4 (S = 32: 8 positions of each sequence per rank)."""
    per_rank = run_ranks(4, _worker, EXACT, 32, timeout=RANK_TIMEOUT_S)
    for name in EXACT:
        styles.raise_worst_outcome(tuple({r["name"]: r for r in rs} for rs in per_rank), name, "world 4")
