"""The strategies ``autosp plan`` compares: their names, how a name is parsed
(:func:`parse_strategies`), every combination of a mode's memory techniques
(:func:`combinations`), and the core's options for one (:func:`core_plan_options`). Used by
``autosp.planner`` and by ``remat="auto"`` (autosp.remat_auto)."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from autosp import _core
from autosp.errors import AutospError
from autosp.plan_inputs import REMAT_STRATEGIES, SP_MODES

_STRATEGY_ENUM = {
    "none": "NONE",
    "default": "DEFAULT",
    "sequence-aware": "SEQUENCE_AWARE",
    "full": "FULL_CHECKPOINT",
}

def core_plan_options(remat: str, dtype: str, num_params: int, shards: int,
                      param_shards: int = 1, offload: bool = False, offload_all: bool = False,
                      loss_chunks: int = 0, offload_optimizer: bool = False) -> Any:
    """The core's ``MemoryOptions`` for one strategy: remat policy ``remat`` (a name of
    ``REMAT_STRATEGIES``), ``dtype`` "fp32" or "bf16", the model's parameter count and how
    the optimizer state (``shards``) and parameters (``param_shards``) are sharded."""
    options = _core.MemoryOptions()
    options.loss_chunks = loss_chunks
    options.strategy = getattr(_core.RematStrategy, _STRATEGY_ENUM[remat])
    options.offload_layer_outputs = offload or offload_all
    options.offload_layer_saved = offload_all
    from autosp.remat import DEFAULT_RECOMPUTE_FLOPS_RATIO

    options.recompute_flops_ratio = DEFAULT_RECOMPUTE_FLOPS_RATIO
    training = _core.TrainingConfig()
    training.num_params = num_params
    training.dtype = _core.DtypePolicy.BF16_MIXED if dtype == "bf16" else _core.DtypePolicy.FP32
    training.optimizer_shards = shards
    training.param_shards = param_shards
    training.optimizer_offload = offload_optimizer
    options.training = training
    return options


class Choice(NamedTuple):
    """One strategy: SP mode, remat, and the memory techniques on top."""

    mode: str
    remat: str
    tile_loss: bool = False
    tile_mlp: bool = False
    offload: bool = False
    offload_all: bool = False  # every tensor a layer saves (Offload(saved="all")); with offload

    @property
    def name(self) -> str:
        return (f"{self.mode} + {self.remat}" + (" + tiled loss" if self.tile_loss else "")
                + (" + tiled mlp" if self.tile_mlp else "")
                + (" + offload all" if self.offload_all else " + offload" if self.offload else ""))


#: The strategies planned by default beyond every (mode, remat): the tiled loss, the tiled loss
#: and MLP, and activation offload (remat=autosp.remat.Offload(...)) with and without both.
DEFAULT_EXTRAS = (
    Choice("no-sp", "sequence-aware", tile_loss=True),
    Choice("ulysses", "sequence-aware", tile_loss=True),
    Choice("ulysses", "full", tile_loss=True),
    Choice("ulysses", "sequence-aware", tile_loss=True, tile_mlp=True),
    Choice("ulysses", "full", tile_loss=True, tile_mlp=True),
    Choice("ulysses", "sequence-aware", offload=True),
    Choice("ulysses", "sequence-aware", tile_loss=True, offload=True),
    Choice("ulysses", "sequence-aware", tile_loss=True, tile_mlp=True, offload=True),
    Choice("ulysses", "sequence-aware", tile_loss=True, tile_mlp=True, offload=True,
           offload_all=True),
)
TILED = "tiled-loss"
TILED_MLP = "tiled-mlp"
OFFLOAD = "offload"
OFFLOAD_ALL = "offload-all"
EXTRAS = (TILED, TILED_MLP, OFFLOAD, OFFLOAD_ALL)  # in this order in a strategy's name; one offload


def combinations(mode: str = "ulysses", remats: Sequence[str] = ("none", "default",
                                                                 "sequence-aware")) -> list[str]:
    """Every strategy of `mode` with `remats` and any of the tiled loss, the tiled MLP and
    one of the two offloads (with the solver's policies only), as strategy names for plan()."""
    out = []
    for remat in remats:
        for mask in range(16):
            extras = [e for k, e in enumerate(EXTRAS) if mask >> k & 1]
            offloads = {OFFLOAD, OFFLOAD_ALL} & set(extras)
            if len(offloads) > 1 or (offloads and remat == "full"):
                continue
            out.append("+".join([mode, remat, *extras]))
    return out


def parse_strategies(strategies: Sequence[str] | None) -> list[Choice]:
    """``["ulysses+sequence-aware+tiled-loss", ...]`` (or ``["all"]``, or None for the
    defaults) as :class:`Choice` s; AutospError on an unknown part, one out of order, or two
    offloads."""
    if strategies is None:
        return [Choice(mode, r) for mode in SP_MODES for r in REMAT_STRATEGIES] + list(DEFAULT_EXTRAS)
    if list(strategies) == ["all"]:
        strategies = [c for mode in SP_MODES for c in combinations(mode, REMAT_STRATEGIES)]
    out = []
    for s in strategies:
        parts = s.replace(" ", "").replace("tiledloss", TILED).replace("tiledmlp", TILED_MLP).split("+")
        extras = parts[2:]
        offloads = {OFFLOAD, OFFLOAD_ALL} & set(extras)
        ok = (len(parts) >= 2 and parts[0] in SP_MODES and parts[1] in REMAT_STRATEGIES
              and extras == [e for e in EXTRAS if e in extras] and len(offloads) <= 1
              and not (offloads and parts[1] == "full"))
        if not ok:
            raise AutospError(
                f"[plan] unknown strategy {s!r}; expected '<{'|'.join(SP_MODES)}>+"
                f"<{'|'.join(REMAT_STRATEGIES)}>[+{TILED}][+{TILED_MLP}][+{OFFLOAD}|+{OFFLOAD_ALL}]', "
                f"e.g. 'ulysses+sequence-aware' or 'ulysses+sequence-aware+{TILED}+{TILED_MLP}+"
                f"{OFFLOAD}' (an offload goes with the solver's policies, not 'full')"
            )
        out.append(Choice(parts[0], parts[1], TILED in extras, TILED_MLP in extras,
                          bool(offloads), OFFLOAD_ALL in extras))
    return out
