"""What a SequenceParallelModule's compiles did, read from its backend's records: the stages
of the last compile, and per compiled graph the ops gathered, tiled, decomposed."""

from __future__ import annotations

from typing import Any


class CompileRecords:
    """Properties of :class:`autosp.sp_module.SequenceParallelModule` over ``self.sp_backend``'s
    :class:`autosp.backend.CompileRecord` list."""

    sp_backend: Any

    @property
    def last_compile(self) -> Any:
        """Stage-by-stage record of the last compilation (core IR, plan, FX graph)."""
        return self.sp_backend.last

    @property
    def gathered(self) -> list[str]:
        """The ops of every compiled graph that run on the all-gathered full sequence
        (``unsupported="gather"``), each as the error autosp would have stopped with."""
        return [reason for rec in self.sp_backend.records for reason in rec.gathered]

    @property
    def loss_tiling(self) -> list[str]:
        """With ``tile_loss=True``: per cross-entropy of every compiled graph, "tiled: ..." or
        "not tiled: <why>", with its source line."""
        return [line for rec in self.sp_backend.records for line in rec.loss_tiling]

    @property
    def mlp_tiling(self) -> list[str]:
        """With ``tile_mlp=True``: per row-wise block (MLP) of every compiled graph, "tiled:
        ..." or "not tiled: <why>", with its source line."""
        return [line for rec in self.sp_backend.records for line in rec.mlp_tiling]

    @property
    def decomposed(self) -> list[str]:
        """Composite Torch functions (``multi_head_attention_forward``) taken apart into ATen
        ops and planned op by op (autosp.decompose), by name, over every compiled graph."""
        return [name for rec in self.sp_backend.records for name in rec.decomposed]

    @property
    def tiled_masks(self) -> list[str]:
        """The attention calls of every compiled graph whose ``[S, S]`` mask autosp never
        materialises: it is computed from its O(S) operands one tile of query rows at a time
        (see docs/sp.md, "Attention masks"). Each as its source location."""
        return [loc for rec in self.sp_backend.records for loc in rec.tiled_masks]
