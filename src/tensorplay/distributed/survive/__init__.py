"""Surviving a lost rank: the survivors carry on in their own processes (see docs/resilience.md).

    from tensorplay.distributed import survive

    job = survive.Job(build, survive.Sampler(global_batch=12, dataset_size=len(data)))
    while job.step < total_steps:
        try:
            with job.attempt():
                rows = job.indices()                       # this rank's share of global batch `job.step`
                loss = loss_fn(job.model(x[rows]), y[rows]) * job.weight()
                loss.backward()
                job.commit()                               # agree, then optimizer step: step `job.step` done
        except survive.RankLost as lost:
            job.recover(lost)                              # regrouped over the survivors; the step is retried
"""

from __future__ import annotations

from .errors import RankLost, ShardsLost
from .job import Job
from .sampler import Sampler

__all__ = ["Job", "RankLost", "Sampler", "ShardsLost"]
