"""When autosp lets Dynamo reuse a traced layer (``regions=True``; see autosp.dynamo_regions).

PyTorch 2.13's Dynamo traces the first call of a nested compile region and stamps that trace
out for later calls whose inputs match, re-checking the guards of what the first trace read
(``torch/_dynamo/variables/invoke_subgraph.py``). Its safety argument: a value reaches a region
through the region's arguments or through a source it can re-read on the new layer. State the
calling code wrote during the same trace breaks that argument. Dynamo serves such a read from
its record of side effects, with no source and so no guard, and the later calls get the first
call's value. Found by breaker helper-48 (torch 2.13, every gradient wrong, no error):

- a tensor set on a submodule of the layer before each call (``layer.sub.ctx = x0``), or in a
  list or plain object held by the layer (``layer.ctxl = [x0]``);
- a tensor set in a module-level dict or a global (``_CTX["t"] = x0``, ``global _G``);
- a number set in a global per layer (``global _SCALE; _SCALE = float(i + 1)``): every layer
  ran with layer 0's;
- and, where the hidden tensor was not also the call's input, torch's internal
  ``AssertionError: Freevar has no source``.

The rule here: while the calling trace has written to any object it did not create (an
attribute of a module or object, a global, a dict or list that existed before the trace), a
region call is traced, not stamped out, and its trace is not kept for reuse. The layers stay
exact, and autosp.outline still compiles alike layers once after the SP pass. A tensor's
attribute counts too, whoever made the tensor (``x.ctx = x0; x = layer(x)``).

Likewise while the calling trace has entered or left an autocast or grad mode (see
:func:`mode_entered`).

A model whose forward writes no such state (autosp.models' Llama, nanoGPT, a from-scratch
Llama) keeps the reuse (breaker helper-49 counted the same hits with and without the rule).
The rule is coarse: a write no layer reads also ends the reuse for the rest of the forward
(Meta's reference Llama writes ``self.freqs_cis = self.freqs_cis.to(h.device)`` first: 0 of 3
hits, against 3 without the rule), which costs compile time, not exactness. Hugging Face's
decoder layers are never reused by Dynamo, with or without it (it finds side effects in them).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


def outer_state_written(tx: Any) -> bool:
    """Whether the trace ``tx`` belongs to has written to an object that existed before it
    (Dynamo's ``SideEffects``: attribute and global stores, mutated dicts and lists), or an
    attribute of a tensor (``x.ctx = x0``: a tensor the trace made can reach a region as its
    argument, and the attribute with it, read without a source; breaker helper-49)."""
    from torch._dynamo.variables import TensorVariable
    from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

    effects = tx.output.side_effects
    if effects.mutated_sources:
        return True
    if any(attrs and isinstance(var, TensorVariable)
           for var, attrs in list(effects.store_attr_mutations.items())):
        return True
    has_dict = getattr(effects, "has_existing_dict_mutation", None)
    if has_dict is not None and has_dict():
        return True
    for var in list(effects.id_to_variable.values()):
        if isinstance(var.mutation_type, (AttributeMutationNew, ValueMutationNew)):
            continue
        if effects.is_modified(var):
            return True
    return False


def mode_entered(tx: Any) -> bool:
    """Whether the calling trace has entered or left an autocast or grad mode so far (a node
    of ``autosp.ops.MODE_NODES`` in its graph). Dynamo's reuse does not compare the mode at the call
    with the first trace's, and a layer that reads it (``torch.is_autocast_enabled()``,
    ``torch.is_grad_enabled()``) has the read folded into that trace: layer 1 of 3 under
    ``torch.autocast`` ran layer 0's branch (breaker helper-50; plain ``nested_compile_region``
    does the same)."""
    from autosp.ops import MODE_NODES

    return any(n.op == "call_function" and getattr(n.target, "__name__", "") in MODE_NODES
               for n in tx.output.graph.nodes)


@contextlib.contextmanager
def gated() -> Iterator[None]:
    """Dynamo's region reuse, refused while :func:`outer_state_written` holds (see the
    module). Patches ``find_reuse_match`` and ``save_reuse_entry`` in
    ``torch._dynamo.variables.invoke_subgraph`` for the duration, when they exist."""
    try:
        from torch._dynamo.variables import invoke_subgraph
    except ImportError:
        yield
        return
    find = getattr(invoke_subgraph, "find_reuse_match", None)
    save = getattr(invoke_subgraph, "save_reuse_entry", None)
    if find is None or save is None:
        yield
        return

    def written(tx: Any) -> bool:
        try:
            return outer_state_written(tx) or mode_entered(tx)
        except AttributeError:  # a Dynamo whose side-effect record this does not know: no reuse
            return True

    def gated_find(tx: Any, *args: Any, **kwargs: Any) -> Any:
        return None if written(tx) else find(tx, *args, **kwargs)

    def gated_save(tx: Any, *args: Any, **kwargs: Any) -> Any:
        return None if written(tx) else save(tx, *args, **kwargs)

    invoke_subgraph.find_reuse_match = gated_find
    invoke_subgraph.save_reuse_entry = gated_save
    try:
        yield
    finally:
        invoke_subgraph.find_reuse_match = find
        invoke_subgraph.save_reuse_entry = save
