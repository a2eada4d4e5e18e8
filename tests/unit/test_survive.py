"""The pure parts of surviving a lost rank: the data split, the settlement through a store, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tensorplay.distributed import survive
from tensorplay.distributed.survive.membership import Member, Membership


def test_sampler_gives_the_lost_ranks_samples_to_the_survivors():
    sampler = survive.Sampler(global_batch=12, dataset_size=40)
    for world in (4, 3, 2, 1):
        shares = [sampler.indices(3, rank, world) for rank in range(world)]
        assert torch.equal(torch.cat(shares), (torch.arange(36, 48)) % 40)
        assert all(sampler.weight(rank, world) == 1.0 for rank in range(world))


def test_sampler_weights_make_averaged_share_means_the_global_mean():
    uneven, values = survive.Sampler(global_batch=10, dataset_size=10), torch.arange(10.0) ** 2
    assert [len(uneven.indices(0, rank, 3)) for rank in range(3)] == [3, 3, 4]
    averaged = sum(uneven.weight(rank, 3) * values[uneven.indices(0, rank, 3)].mean() for rank in range(3)) / 3
    assert averaged == pytest.approx(values.mean().item())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"global_batch": 0, "dataset_size": 4}, "global_batch must be >= 1, got 0"),
    ({"global_batch": 4, "dataset_size": 0}, "dataset_size must be >= 1, got 0"),
])
def test_sampler_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        survive.Sampler(**kwargs)


def test_sampler_rejects_a_world_larger_than_the_global_batch():
    with pytest.raises(ValueError, match="global_batch 2 is smaller than the world size 3"):
        survive.Sampler(2, 8).check_world(3)


def _build():
    raise AssertionError("not reached")


def test_job_names_the_missing_store_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT must name the job's store"):
        survive.Job(_build, survive.Sampler(4, 4))


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE"])
def test_job_names_the_missing_rank_or_world_size(monkeypatch, missing):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TENSORPLAY_SURVIVE_JOIN", raising=False)
    monkeypatch.delenv(missing)
    with pytest.raises(ValueError, match=f"the environment variable {missing} must be set to a non-negative "
                                         "integer \\(the launcher sets it\\), got None"):
        survive.Job(_build, survive.Sampler(4, 4), store=dist.HashStore())


def test_job_refuses_a_default_group_it_did_not_start():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="create the Job before init_process_group, not after"):
            survive.Job(_build, survive.Sampler(4, 4), store=dist.HashStore())
    finally:
        dist.destroy_process_group()


def test_job_rejects_a_bad_settle_time():
    with pytest.raises(ValueError, match="settle_s must be > 0 seconds, got 0"):
        survive.Job(_build, survive.Sampler(4, 4), settle_s=0, store=dist.HashStore())


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_settlement_names_the_dead_member_at_once_and_the_step_a_survivor_committed():
    store = dist.HashStore()
    store.append("tensorplay_survive/g0/pids", f"0 {os.getpid()} {os.uname().nodename}\n")
    store.append("tensorplay_survive/g0/pids", f"1 {_gone_pid()} {os.uname().nodename}\n")
    store.append("tensorplay_survive/g0/pids", f"2 {os.getpid()} {os.uname().nodename}\n")
    # member 2 finished the commit of step 5 (it is at 6); member 0 was inside it; member 1 is dead
    store.append("tensorplay_survive/g1/members", '{"id": 2, "step": 6, "in_commit": false, "doing": "x"}\n')
    settlement = Membership(store, settle_s=30).settle(0, [0, 1, 2], Member(0, 5, True, "in the commit"))
    assert settlement.lost == [1] and settlement.ids() == [0, 2]
    assert settlement.step == 6 and settlement.generation == 1


def test_settlement_waits_no_longer_than_settle_s_for_a_live_member():
    store = dist.HashStore()
    for member in (0, 1):
        store.append("tensorplay_survive/g0/pids", f"{member} {os.getpid()} {os.uname().nodename}\n")
    settlement = Membership(store, settle_s=0.2).settle(0, [0, 1], Member(0, 3, False, "computing"))
    assert settlement.lost == [1] and settlement.ids() == [0] and settlement.step == 3


def test_recover_refuses_a_rank_lost_it_did_not_settle():
    job = survive.Job.__new__(survive.Job)
    job._settlement = None
    with pytest.raises(ValueError, match="this rank settled no generation 3"):
        job.recover(survive.RankLost([1], 4, {0: "computing"}, 3))


def test_rank_lost_is_a_collective_divergence_and_names_everything():
    from tensorplay.distributed._comm.watch import CollectiveDivergence

    lost = survive.RankLost([2], 7, {0: "computing step 7 (before its commit)", 1: "in the commit of step 7"}, 1)
    assert isinstance(lost, CollectiveDivergence)
    assert str(lost) == ("rank(s) [2] of the job were lost; 2 survivor(s) carry on from step 7 in generation 1 "
                         "after Job.recover() (rank 0 was computing step 7 (before its commit); rank 1 was in "
                         "the commit of step 7)")


def _live(optimizer_class, **hyper):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, optimizer_class(model.parameters(), **hyper)


@pytest.mark.parametrize(("optimizer_class", "hyper", "warm"), [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, True),
    (torch.optim.AdamW, {"lr": 0.01}, True),
    (torch.optim.AdamW, {"lr": 0.01}, False),  # the first step creates the state the copy had none of
])
def test_the_buddy_replays_the_lost_ranks_step_bitwise(optimizer_class, hyper, warm):
    from tensorplay.distributed.survive.buddy import _hyperparameters, _replay
    from tensorplay.distributed.survive.shard_state import ShardParts

    model, optimizer = _live(optimizer_class, **hyper)
    if warm:
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    grads = {fqn: torch.randn_like(p) for fqn, p in model.named_parameters()}
    copy = ShardParts({fqn: p.detach().clone() for fqn, p in model.named_parameters()},
                      {fqn: {k: v.clone() for k, v in sorted(optimizer.state[p].items())}
                       for fqn, p in model.named_parameters()}, dict(grads))
    sent = _hyperparameters(optimizer)  # as the copy is sent, before the commit
    for group in optimizer.param_groups:
        group["lr"] *= 0.5  # the loop's schedule moves on before a peer is found lost: the replay must not see it
    state = _replay(copy, optimizer, {id(p): fqn for fqn, p in model.named_parameters()}, sent)
    for group, settings in zip(optimizer.param_groups, sent, strict=True):
        group["lr"] = settings["lr"]
    for fqn, p in model.named_parameters():
        p.grad = grads[fqn]
    optimizer.step()  # the step the lost rank would have taken
    for fqn, p in model.named_parameters():
        assert torch.equal(copy.param[fqn], p.detach())
        assert state[fqn].keys() == optimizer.state[p].keys()
        assert all(torch.equal(state[fqn][k], optimizer.state[p][k]) for k in state[fqn])


def test_shard_specs_refuse_a_parameter_fully_shard_did_not_shard():
    from tensorplay.distributed.survive.shard_state import specs

    model, optimizer = _live(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="parameter 'weight' is not sharded \\(not a DTensor\\)"):
        specs(model, optimizer)


def test_a_shard_buffer_of_the_wrong_size_names_the_old_rank():
    from tensorplay.distributed.survive.shard_state import ShardSpec, unpack_shard

    spec = ShardSpec("layer.weight", torch.Size([3, 2]), ())  # old rank 1 of 2 holds 1 row: 2 elements
    with pytest.raises(ValueError, match="the shard buffer of old rank 1 has 5 elements, its layout 2"):
        unpack_shard(torch.zeros(5), [spec], rank=1, world=2, with_grads=False)


def test_job_rejects_an_unknown_redundancy():
    with pytest.raises(ValueError, match="redundancy must be None \\(every rank holds everything\\) or 'buddy', "
                                         "got 'mirror'"):
        survive.Job(_build, survive.Sampler(4, 4), redundancy="mirror", store=dist.HashStore())
