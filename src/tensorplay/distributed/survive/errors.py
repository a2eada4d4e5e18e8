"""The one exception a training loop under :class:`~.job.Job` catches: a rank of the job was lost."""

from __future__ import annotations

from .._comm.watch import CollectiveDivergence

__all__ = ["RankLost"]


class RankLost(CollectiveDivergence):
    """Rank(s) of the job were lost; the survivors agreed on who is left and which step to retry.

    Raised on every survivor, after the membership is settled (so it names the lost ranks, not a guess).
    ``lost``: the lost ranks' ids (their ``RANK`` in the job's first generation, see :attr:`Job.member_id`);
    ``step``: the step the survivors carry on from (retried, or the next one when it had been committed);
    ``doing``: what each survivor was doing, by id; ``generation``: the generation :meth:`Job.recover` starts.
    A subclass of :class:`CollectiveDivergence`, so code that handles today's error still does.
    """

    def __init__(self, lost: list[int], step: int, doing: dict[int, str], generation: int) -> None:
        self.lost, self.step, self.doing, self.generation = lost, step, doing, generation
        survivors = "; ".join(f"rank {member} was {what}" for member, what in sorted(doing.items()))
        super().__init__(f"rank(s) {lost} of the job were lost; {len(doing)} survivor(s) carry on from step {step} "
                         f"in generation {generation} after Job.recover() ({survivors})")


class ShardsLost(CollectiveDivergence):
    """Both copies of a shard are gone (its rank and the rank holding its buddy copy): the job cannot carry
    on in-process and falls back to its checkpoint restart. Raised on every survivor alike."""
