"""The launcher: ``python -m tensorplay.distributed.run`` / ``tprun``.

Same flags and behaviour as ``torchrun`` (it is PyTorch's elastic launcher), so
multi-node c10d rendezvous works as it does there. Ours on top, for
``--max-restarts N``:

- Each restart gets a fresh store. PyTorch's c10d rendezvous shares one
  TCPStore across restarts by default, and the restarted workers' process group
  reads the dead attempt's addresses from it (Gloo: "connectFullMesh failed ...
  Connection refused"; PyTorch issues 135712, 167288). With restarts allowed we
  set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the environment sets it.
- Before restarting, one line on stderr names the rank that died, how (exit code
  or signal) and the restarts left, e.g. ``tprun: rank 1 (local_rank 1, pid 812)
  was killed by SIGKILL first; then rank 0 was killed by SIGTERM, ...; restarting the workers
  (1 of 1 restarts left)``.

The training script resumes from its checkpoint itself (``examples/train_lm.py
--resume auto``).

With ``--survive`` (one host): the launcher hosts the rendezvous store, a worker that
dies is named and replaced while ``--max-restarts`` allows, and the others keep running
(see [Note: survive mode's launcher] in ``_survive_agent.py``).

With ``TENSORPLAY_AS_TORCH=1`` each worker calls
``tensorplay.distributed.use_as_torch()`` before the training script runs, so a
framework that builds PyTorch's FSDP objects itself builds ours.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.run import get_args_parser, run

from tensorplay.distributed import _survive_agent
from tensorplay.distributed._as_torch import AS_TORCH_ENV

_SHARE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def parse_args(args: list[str]) -> Any:
    """torchrun's flags, parsed under the name ``tprun`` (``tprun --help`` prints ``usage: tprun ...``)."""
    parser = get_args_parser()
    parser.prog = "tprun"
    parser.description = "tensorplay's launcher: torchrun's flags, plus a named report of the rank that failed"
    parser.add_argument("--survive", action="store_true",
                        help="one host: the launcher holds the rendezvous store; a worker that dies is replaced "
                             f"({_survive_agent.JOIN_ENV}=1, while --max-restarts allows) and the others keep running")
    parsed = parser.parse_args(args)
    refusal = _survive_agent.check_survive_args(parsed) if parsed.survive else None
    if refusal is not None:
        parser.error(refusal)
    return parsed


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get(AS_TORCH_ENV) == "1" and not args.no_python:
        _run_as_torch(args)
    if args.survive:
        sys.exit(_survive_agent.launch(args))
    if args.max_restarts > 0:
        os.environ.setdefault(_SHARE_STORE, "1")
    with _report_failures():
        run(args)


def _run_as_torch(args: Any) -> None:
    """Each worker switches PyTorch's FSDP / ZeRO / hook modules to ours before the script runs (use_as_torch)."""
    script = [*(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    args.training_script, args.module = "tensorplay.distributed._as_torch", True
    args.training_script_args = script


def describe_failures(result: RunResult) -> str:
    """Which worker failed first (rank, local rank, pid, how it ended), then the ranks that ended after it."""
    if not result.failures:
        return "no worker failure recorded (the group was unhealthy)"
    # Timestamps are whole seconds: within one, a SIGTERM is the launcher stopping the survivors.
    ordered = sorted(result.failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode == -15))
    (rank, first), later = ordered[0], ordered[1:]
    text = f"rank {rank} (local_rank {first.local_rank}, pid {first.pid}) {_how(first)}"
    if later:
        text += " first; then " + ", ".join(f"rank {r} {_how(f)}" for r, f in later)
    return text


def _how(failure: ProcessFailure) -> str:
    return _survive_agent.exit_words(failure.exitcode)


@contextlib.contextmanager
def _report_failures() -> Iterator[None]:
    """While the launcher runs: say which rank died before the agent restarts the workers."""
    original = LocalElasticAgent._monitor_workers

    def monitor(agent: LocalElasticAgent, worker_group: Any) -> RunResult:
        result = original(agent, worker_group)
        left = agent._remaining_restarts
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and left > 0:
            print(f"tprun: {describe_failures(result)}; restarting the workers ({left} of "
                  f"{worker_group.spec.max_restarts} restarts left)", file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


__all__ = ["describe_failures", "get_args_parser", "main", "parse_args", "run"]

if __name__ == "__main__":
    main()
