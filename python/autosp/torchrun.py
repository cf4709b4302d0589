"""``python -m autosp.torchrun <torchrun's arguments>``: torchrun, run in this process, for
``autosp train``'s launcher (autosp.cli).

It runs what ``python -m torch.distributed.run`` runs, with one difference: when a rank
fails, torchrun raises ``ChildFailedError`` and Python prints torchrun's own traceback and
its failure table after the ranks' messages. A user reads that as a crash of the launcher.
Here the failure ends in one line that names each failed rank and how it ended (its exit code
or signal), and the ranks torchrun stopped after it; the ranks have printed what went wrong above it (autosp's ranks print an autosp
error as one line each, autosp.train.loop). The exit status is 1, as torchrun's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def describe(failures: dict[int, Any]) -> str:
    """One line for torchrun's ``failures`` (global rank -> ProcessFailure): the ranks that
    failed (an exit code, or a signal), then those torchrun stopped with SIGTERM once another
    had failed."""
    import signal

    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    stopped = sorted(r for r, f in failures.items() if f.exitcode == -signal.SIGTERM)
    failed = [f"rank {r} " + (f"killed by {f.signal_name()}" if f.exitcode < 0
                              else f"failed (exit code {f.exitcode})")
              for r, f in sorted(failures.items()) if r not in stopped]
    if not failed:
        return f"autosp train: {ranks(stopped)} ended by SIGTERM"
    tail = f"; torchrun then stopped {ranks(stopped)}" if stopped else ""
    return f"autosp train: {', '.join(failed)}{tail}. Each rank's own message is above."


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
