"""``python -m autosp.torchrun <torchrun's arguments>``: torchrun, run in this process, for
``autosp train``'s launcher (autosp.cli).

It runs what ``python -m torch.distributed.run`` runs, with one difference: when a rank
fails, torchrun raises ``ChildFailedError`` and Python prints torchrun's own traceback and
its failure table after the ranks' messages. A user reads that as a crash of the launcher.
Here the failure ends in one line that names how each rank ended (its exit code or signal);
the ranks have printed what went wrong above it (autosp's ranks print an autosp
error as one line each, autosp.train.loop). The exit status is 1, as torchrun's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def describe(failures: dict[int, Any]) -> str:
    """One line for torchrun's ``failures`` (global rank -> ProcessFailure): how each rank
    ended, by exit code or signal. It does not say which failed first: torchrun ends the other
    ranks once one fails (SIGTERM, then SIGKILL), and a rank that died of a signal from
    outside looks the same (found by breaker helper-90)."""
    parts = [f"rank {r} " + (f"killed by {f.signal_name()}" if f.exitcode < 0
                             else f"exit code {f.exitcode}")
             for r, f in sorted(failures.items())]
    return (f"autosp train: the run failed: {', '.join(parts)} (once a rank fails, torchrun "
            "ends the others with SIGTERM, then SIGKILL). Each rank's own message is above.")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs torchrun with ``argv`` (``sys.argv[1:]`` when None); returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as e:
        print(describe(e.failures), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
