"""autosp: compiler-based sequence parallelism for PyTorch 2.

    mesh = autosp.init_mesh(sp_size=4)
    model = autosp.compile(model, mesh=mesh)
    loss = model(input_ids, labels)      # the full-length batch on every rank
    loss.backward()                      # exact single-device gradients

    autosp.plan("llama-3.2-1b", gpus=8, gpu_memory="80GB", sp=8)   # predicted memory
"""

from autosp.api import backend, compile, init_mesh
from autosp.offload_optimizer import OffloadOptimizer
from autosp.shard import MixedPrecisionPolicy, fully_shard
from autosp.errors import AutospError, AutospGatherWarning, AutospHookWarning
from autosp.compile_cache import source_hash as _source_hash

# The code's hash that keys autosp's entries in PyTorch's compile caches, taken now, from the
# files this process has just loaded: taken at the first compile, it would describe whatever
# is on disk by then, and a process running older code could write its graphs under the newer
# code's key (autosp.compile_cache.source_hash).
_source_hash()

__all__ = ["AutospError", "AutospGatherWarning", "AutospHookWarning", "MixedPrecisionPolicy", "OffloadOptimizer", "backend", "compile", "fully_shard",
           "init_mesh", "plan"]


def __getattr__(name: str) -> object:
    # autosp.plan is imported on first use: the planner is not needed to train.
    if name == "plan":
        from autosp.planner import plan

        return plan
    raise AttributeError(f"module 'autosp' has no attribute {name!r}")
__version__ = "0.1.0"
