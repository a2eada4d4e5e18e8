"""Ranks that end normally right after training exit with status 0 (issue 27: an abort at interpreter exit).

Each run starts two real processes (a Gloo group on localhost) that train a few DDP steps with
``bf16_compress_wrapper(powerSGD_hook)`` and run collectives of ours in several more groups, each of whose
watches has a heartbeat every 0.1 ms (so that a heartbeat is inside a store call when the process ends), then
fall off the end of the script: no ``destroy_process_group``, no ``os._exit``.

Before the fix, two things could still be running when the interpreter finalized, and either aborted the
process with "terminate called without an active exception" (SIGABRT, after correct results):

* a Gloo worker thread releasing the hooks' future chain (Python callbacks, ``collect_all``'s futures), which
  takes the GIL after DDP already returned (see [Note: hook futures at exit] in ``ddp_comm_hooks/_exit.py``);
* the watch's daemon heartbeat thread inside ``store.set`` (see ``_at_exit`` in ``_comm/watch.py``).

CPython ends such a thread with ``pthread_exit`` when it retakes the GIL, and the unwinding crosses a
``noexcept`` C++ frame. Measured on the old code: 2 of 20 runs of the plain training aborted, 2 of 6 with
a fast heartbeat; this test's runs abort far more often there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tensorplay.testing.distributed import free_port

RUNS = 3
WORLD = 2
EXTRA_GROUPS = 4
STEPS = 4


def _rank_main() -> None:
    import torch

    torch.set_num_threads(1)
    import tensorplay as tp
    import tensorplay.distributed as dist
    from tensorplay.distributed._comm import collectives, watch
    from tensorplay.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}",
                            rank=int(os.environ["RANK"]), world_size=WORLD)
    for _ in range(EXTRA_GROUPS):
        group = dist.new_group(list(range(WORLD)))
        watch.configure(group, heartbeat_s=1e-4)
        collectives.all_reduce(tp.ones(4), group, where="start the watch")
    watch.configure(heartbeat_s=1e-4)

    tp.manual_seed(0)
    model = tp.nn.Sequential(tp.nn.Linear(16, 12), tp.nn.Tanh(), tp.nn.Linear(12, 12), tp.nn.Tanh(),
                             tp.nn.Linear(12, 2))
    ddp = tp.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)  # several buckets
    ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2),
                           default_hooks.bf16_compress_wrapper(powerSGD_hook.powerSGD_hook))
    opt = tp.optim.SGD(model.parameters(), lr=0.1)
    gen = tp.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        opt.zero_grad()
        ddp(tp.randn(8, 16, generator=gen)).square().mean().backward()
        opt.step()
    total = sum(float(p.detach().sum()) for p in model.parameters())
    print(f"rank {dist.get_rank()} done {total:.6f}", flush=True)
    # ends here: normal interpreter exit


def _run_once() -> list[tuple[int, str, str]]:
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, __file__], env=dict(env, RANK=str(rank)), cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(WORLD)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    return results


def test_ranks_exit_cleanly_after_hook_training() -> None:
    failures = []
    for run in range(RUNS):
        results = _run_once()
        totals = {out.split("done", 1)[1].strip() for _, out, _ in results if "done" in out}
        for rank, (code, out, err) in enumerate(results):
            if code != 0 or "terminate called" in err or "done" not in out:
                failures.append(f"run {run} rank {rank}: exit code {code}; stderr tail: {err[-800:]!r}")
        assert len(totals) <= 1, f"run {run}: the ranks' parameters differ: {totals}"
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    _rank_main()
