"""The errors a call of the compiled module (autosp.sp_module) raises where the user can act:
the SP process group gone, Dynamo's recompile limit reached, a graph break, and a hook on the
compiled model itself. Each says what was found and what was expected."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autosp.errors import AutospError


def group_alive(group_name: str | None) -> bool:
    """Whether torch.distributed is initialised and, when named, the process group exists."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    resolve = getattr(torch.distributed.distributed_c10d, "_resolve_process_group", None)
    if group_name is None or resolve is None:
        return True
    try:
        resolve(group_name)
    except (RuntimeError, ValueError, KeyError):
        return False
    return True


def dead_group(where: str, group_name: str | None) -> AutospError:
    return AutospError(
        f"[autosp:{where}] found the SP process group{f' {group_name!r}' if group_name else ''} gone "
        "(torch.distributed not initialised, or the group destroyed); expected the process group "
        "autosp.init_mesh was built on to stay alive while the model is compiled and called: call "
        "dist.destroy_process_group() only after the last step, and after a new "
        "dist.init_process_group(...) build a new mesh and compile again."
    )


def recompile_limit(cls: str, call: str, training: bool, seen: int, compiles_of_code: int) -> AutospError:
    """Dynamo's recompile limit hit by the call ``call`` (its tensors, described) of a module of
    class ``cls``, called with ``seen`` distinct signatures; ``compiles_of_code``: how many
    autosp.compile calls in this process compiled this forward's code."""
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    if limit is not None and seen <= limit and compiles_of_code > 1:
        # Dynamo counts the graphs of a code object, not of a module: other instances of the
        # class (or earlier autosp.compile calls on them) used up the limit.
        return AutospError(
            f"[autosp:recompile] found Dynamo's recompile limit reached for {cls}.forward "
            f"(this call: {call}, training={training}; "
            f"{compiles_of_code} autosp.compile calls of it in this process), "
            "although this module has "
            f"been called with only {seen} distinct batch shapes, dtypes and train modes: "
            "Dynamo counts the graphs of every module whose forward is this code in the "
            f"process (other instances of {cls}, or earlier autosp.compile calls on them), "
            f"and stops at torch._dynamo.config.recompile_limit = {limit}. Expected at most "
            f"{limit} compiles of one forward per process: call torch._dynamo.reset() before "
            "compiling a new instance (it drops every compiled graph of the process), or raise "
            "torch._dynamo.config.recompile_limit.")
    return AutospError(
        "[autosp:recompile] found one input signature too many for the model's forward (this "
        f"call: {call}, training={training}; this module has been called with "
        f"{seen} distinct batch shapes, dtypes and train modes): Dynamo compiles "
        "one graph per batch size, dtype, non-tensor argument value and train/eval mode (for a "
        "model that reads self.training; a new sequence length does not recompile), and per change "
        "of anything else its guards hold, such as which parameters require gradients, "
        "autocast, the inputs' strides or the module hooks (a hook replaced, or one whose "
        "captured values change, at every step compiles at every step), and stops at "
        f"torch._dynamo.config.recompile_limit = {limit} per function. Expected at most {limit}: "
        "pad the batch to a few fixed sizes (padding rows whose labels are all -100 add nothing "
        "to a cross-entropy with ignore_index=-100), or raise torch._dynamo.config.recompile_limit "
        "(each new signature compiles the model again)."
    )


def hook_on_model(hooks: str, inner: AutospError) -> AutospError:
    """autosp found no sequence in a frame of its own that torch.compile made for ``hooks``,
    registered on the compiled model itself."""
    return AutospError(
        "[autosp:capture] found a hook on the compiled model itself "
        f"({hooks}): torch.compile runs the hooks of the module it compiles as "
        "frames of their own, outside the model's graph, and autosp found no "
        "sequence to split in one of them (" + str(inner).split(";")[0] + "); "
        "expected hooks on the model's submodules: register it on a submodule "
        "(the final norm, the head), or apply it to the output after the call.")


def graph_break(text: str, kind: str) -> AutospError:
    """Dynamo could not capture the model in one graph; ``text``: its message, ``kind``: its
    exception's class name."""
    hint = ""
    if "data-dependent" in text:
        hint = (" The model's control flow or shapes depend on tensor values (e.g. looping "
                "over the experts a batch hits, or torch.where(mask) in MoE routing); write it "
                "with shapes that do not depend on data (for Hugging Face MoE models, "
                "experts_implementation=\"batched_mm\" in the config or from_config).")
    return AutospError(
        "[autosp:capture] found a graph break (Dynamo could not capture the model in one "
        f"graph): {text.splitlines()[0] if text else kind}; expected a model that "
        f"torch.compile(fullgraph=True) captures whole.{hint} The full Dynamo message "
        "follows.\n" + text
    )
