"""examples/train_lm.py, CI-sized: a 2-block, 32-wide byte LM for 6 steps on 2 ranks.

Every strategy trains (the loss falls); the strategies that do the same
arithmetic (fully_shard, hsdp, fsdp, zero, ddp, and fully_shard with gradient
accumulation and activation checkpointing) follow one loss curve within fp32
tolerance, and so does a 1-rank run (the non-distributed reference) and the
recipe with PyTorch's fully_shard and ZeRO swapped in (the oracle); a run
stopped at step 3 and resumed under another strategy at another world size
continues that curve; the PNG, the log and the per-rank table hold the run's
numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tensorplay.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import train_lm  # noqa: E402

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--batch-size", "8", "--steps", "6",
        "--warmup", "2", "--lr", "1e-2", "--val-every", "3", "--val-batches", "1", "--sample-bytes", "8",
        "--no-progress", "--no-plot", "--localsgd-warmup", "2", "--localsgd-period", "2"]
#: run name -> extra flags, all on 2 ranks.
RUNS = {
    "fully_shard": ["--strategy", "fully_shard", "--ckpt-every", "3", "--plot"],
    "hsdp": ["--strategy", "hsdp"],
    "fsdp": ["--strategy", "fsdp", "--ckpt-every", "3"],
    "zero": ["--strategy", "zero", "--ckpt-every", "3"],
    "ddp": ["--strategy", "ddp"],
    "localsgd": ["--strategy", "localsgd"],
    "fully_shard_ac_accum": ["--strategy", "fully_shard", "--ac", "--grad-accum", "2"],
    "fsdp_offload": ["--strategy", "fsdp", "--cpu-offload"],
    "fully_shard_offload": ["--strategy", "fully_shard", "--cpu-offload"],
    "fully_shard_bf16": ["--strategy", "fully_shard", "--mp", "bf16"],
    "ddp_fp16": ["--strategy", "ddp", "--mp", "fp16"],
    "fully_shard_fp16": ["--strategy", "fully_shard", "--mp", "fp16"],
    "fsdp_bf16": ["--strategy", "fsdp", "--mp", "bf16"],
    "fully_shard_accum_clip": ["--strategy", "fully_shard", "--grad-accum", "2", "--clip", "0.5"],
    "fully_shard_accum_clip_in_backward": ["--strategy", "fully_shard", "--grad-accum", "2", "--clip", "0.5",
                                           "--optim-in-backward"],
}
SAME_ARITHMETIC = ("fully_shard", "hsdp", "fsdp", "zero", "fully_shard_ac_accum", "fsdp_offload",
                   "fully_shard_offload")
#: Runs repeated with PyTorch's implementation of the same API swapped into the recipe (PyTorch's classic
#: FSDP is left out: it refuses to run without an accelerator).
PYTORCH_ORACLE = ("fully_shard", "zero", "fully_shard_bf16")
FP32 = {"rel": 2e-5, "abs": 2e-5}


def run_recipe(argv: list[str]) -> dict[str, Any]:
    return train_lm.main(argv)


def run_all(argvs: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    return {name: train_lm.main(argv) for name, argv in argvs.items()}


def run_all_with_pytorch(argvs: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """The recipe with PyTorch's fully_shard and ZeRO in place of ours (the oracle)."""
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.optim as torch_optim

    swaps = {name: getattr(torch_fsdp, name) for name in ("fully_shard", "MixedPrecisionPolicy", "OffloadPolicy",
                                                          "CPUOffloadPolicy")}
    swaps["ZeroRedundancyOptimizer"] = torch_optim.ZeroRedundancyOptimizer
    # PyTorch's ZeRO cannot be checkpointed through get_state_dict (it asks for consolidate_state_dict first).
    swaps["CHECKPOINTABLE"] = tuple(s for s in train_lm.CHECKPOINTABLE if s != "zero")
    ours = {name: getattr(train_lm, name) for name in swaps}
    try:
        for name, value in swaps.items():
            setattr(train_lm, name, value)
        return run_all(argvs)
    finally:
        for name, value in ours.items():
            setattr(train_lm, name, value)


def _without_checkpoints(flags: list[str]) -> list[str]:
    """``flags`` less ``--ckpt-every N``."""
    out, skip = [], False
    for flag in flags:
        if not skip and flag != "--ckpt-every":
            out.append(flag)
        skip = flag == "--ckpt-every"
    return out


def losses(result: dict[str, Any]) -> list[float]:
    return [loss for _, loss, _ in result["train"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("train_lm")
    argvs = {name: TINY + flags + ["--out", str(root / name)] for name, flags in RUNS.items()}
    results = run_distributed(run_all, argvs, world_size=2, timeout=600)
    assert results[0]["ddp"]["train"] == results[1]["ddp"]["train"]  # every rank logs the global mean
    oracle = {name: TINY + _without_checkpoints(RUNS[name]) + ["--out", str(root / f"torch_{name}")]
              for name in PYTORCH_ORACLE}
    pytorch = run_distributed(run_all_with_pytorch, oracle, world_size=2, timeout=600)[0]
    return results[0] | {f"pytorch_{name}": result for name, result in pytorch.items()}


@pytest.fixture(scope="module")
def one_rank(runs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """At 1 rank: the uninterrupted reference, and the 2-rank fully_shard run resumed from step 3 (ddp, fully_shard)."""
    root = tmp_path_factory.mktemp("train_lm_1")
    step3 = str(Path(runs["fully_shard"]["out_dir"]) / "checkpoints" / "step_000003")
    argvs = {"reference": TINY + ["--strategy", "ddp", "--out", str(root / "ref")],
             "resumed_ddp": TINY + ["--strategy", "ddp", "--resume", step3, "--out", str(root / "ddp")],
             "resumed_fully_shard": TINY + ["--strategy", "fully_shard", "--resume", step3, "--out",
                                            str(root / "fs"), "--plot",
                                            "--compare", runs["fully_shard"]["log"], runs["ddp"]["log"]]}
    return run_distributed(run_all, argvs, world_size=1, timeout=600)[0]


def test_every_strategy_trains(runs):
    for name, result in runs.items():
        curve = losses(result)
        assert len(curve) == 6, name
        assert curve[-1] < curve[0] - 0.05, (name, curve)
        assert result["val"][-1][1] < result["val"][0][1], (name, result["val"])


def test_same_arithmetic_same_curve(runs, one_rank):
    reference = losses(runs["ddp"])
    for name in SAME_ARITHMETIC:
        assert losses(runs[name]) == pytest.approx(reference, **FP32), name
    assert reference == pytest.approx(losses(one_rank["reference"]), **FP32)
    # Not the same arithmetic, so not the same curve: local steps after the warm-up; 16-bit compute.
    assert losses(runs["localsgd"])[:2] == pytest.approx(reference[:2], **FP32)
    assert losses(runs["localsgd"])[2:] != pytest.approx(reference[2:], **FP32)
    for name in ("fully_shard_bf16", "ddp_fp16", "fully_shard_fp16", "fsdp_bf16"):
        assert losses(runs[name]) == pytest.approx(reference, rel=2e-2), name


def test_optimizer_in_backward_with_accumulation_and_clipping_follows_the_plain_step(runs):
    plain, in_backward = runs["fully_shard_accum_clip"], runs["fully_shard_accum_clip_in_backward"]
    assert losses(in_backward) == pytest.approx(losses(plain), **FP32)
    assert losses(plain) != pytest.approx(losses(runs["fully_shard_ac_accum"]), **FP32), "--clip 0.5 must clip"
    # What the memory table shows: after backward the gradients are already stepped and freed.
    assert [row["grad_bytes"] for row in in_backward["table"]] == [0, 0]
    assert all(row["grad_bytes"] > 0 for row in plain["table"])


def test_recipe_matches_pytorch_implementations(runs):
    for name in PYTORCH_ORACLE:
        assert losses(runs[name]) == pytest.approx(losses(runs[f"pytorch_{name}"]), **FP32), name
        assert [v for _, v, _ in runs[name]["val"]] == pytest.approx(
            [v for _, v, _ in runs[f"pytorch_{name}"]["val"]], **FP32), name


def test_resume_elsewhere_continues_the_curve(runs, one_rank):
    uninterrupted = runs["fully_shard"]
    for name in ("resumed_ddp", "resumed_fully_shard"):
        resumed = one_rank[name]
        assert resumed["train"][:3] == uninterrupted["train"][:3]  # the history came with the checkpoint
        assert [label for *_, label in resumed["train"][3:]] == [resumed["label"]] * 3
        assert losses(resumed)[3:] == pytest.approx(losses(uninterrupted)[3:], **FP32), name
        assert resumed["val"][-1][1] == pytest.approx(uninterrupted["val"][-1][1], **FP32), name


def test_png_log_and_table_hold_the_run(runs, one_rank):
    import matplotlib.image

    for result in (runs["fully_shard"], one_rank["resumed_fully_shard"]):
        image = matplotlib.image.imread(result["png"])
        assert image.shape[0] > 300 and image.std() > 0.05
        log = json.loads(Path(result["log"]).read_text())
        assert log["train"] == [list(p) for p in result["train"]]
        assert Path(result["checkpoint"]).is_dir()
    table = runs["fully_shard"]["table"]
    assert [row["rank"] for row in table] == [0, 1]
    full = runs["fully_shard"]["full_param_bytes"]
    for strategy, share in (("fully_shard", 0.5), ("fsdp", 0.5), ("ddp", 1.0), ("zero", 1.0)):
        for row in runs[strategy]["table"]:
            assert row["param_bytes"] == pytest.approx(share * full, rel=0.02), strategy
            assert row["comm_bytes_per_step"] > 0, strategy
    ddp, zero, sharded = runs["ddp"]["table"], runs["zero"]["table"], runs["fully_shard"]["table"]
    assert ddp[0]["grad_bytes"] == full and ddp[0]["optim_bytes"] == pytest.approx(2 * full, rel=0.01)
    assert sum(r["optim_bytes"] for r in zero) == pytest.approx(2 * full, rel=0.05)
    assert all(r["grad_bytes"] == pytest.approx(full / 2, rel=0.02) for r in sharded)
    # DDP all-reduces every gradient once per step.
    assert ddp[0]["comm_bytes_per_step"] == pytest.approx(full, rel=0.01)
    # fully_shard gathers the parameters in forward and (but the root's) again in backward, and reduce-scatters
    # every gradient: however the bytes travel (shared memory here), each is counted.
    assert all(r["comm_bytes_per_step"] > 2 * full for r in sharded)
    assert runs["fully_shard"]["sample"]  # rank 0 sampled from the gathered weights


@pytest.fixture(scope="module")
def resumed_sharded(runs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """At 2 ranks, from step 3: ZeRO and classic FSDP resumed from their own checkpoints and from each other's."""
    root = tmp_path_factory.mktemp("train_lm_resume")
    step3 = {name: str(Path(runs[name]["out_dir"]) / "checkpoints" / "step_000003") for name in ("zero", "fsdp")}
    argvs = {f"{to}_from_{source}": TINY + ["--strategy", to, "--resume", step3[source], "--out",
                                             str(root / f"{to}_from_{source}")]
             for to, source in (("zero", "zero"), ("fsdp", "fsdp"), ("zero", "fsdp"), ("fsdp", "zero"))}
    return run_distributed(run_all, argvs, world_size=2, timeout=600)[0]


def test_zero_and_classic_fsdp_resume_equal_an_uninterrupted_run(runs, resumed_sharded):
    """--ckpt-every / --resume under --strategy zero and fsdp (PyTorch's recipe cannot: ZeRO's state has no FQN
    keys and classic FSDP's optimizer state is keyed by flat parameter), across the two as well."""
    for name, resumed in resumed_sharded.items():
        to, source = name.split("_from_")
        uninterrupted = runs[to]
        assert resumed["train"][:3] == runs[source]["train"][:3], name  # the history came with the checkpoint
        assert losses(resumed)[3:] == pytest.approx(losses(uninterrupted)[3:], **FP32), name
        assert resumed["val"][-1][1] == pytest.approx(uninterrupted["val"][-1][1], **FP32), name


def test_bad_flags_are_named(runs):
    cases = (["--strategy", "ddp", "--cpu-offload"], ["--batch-size", "7"], ["--survive", "--strategy", "zero"],
             ["--survive", "--strategy", "hsdp"], ["--survive", "--grad-accum", "2"])
    for flags in cases:
        with pytest.raises(ValueError, match="--"):
            train_lm.check_config(train_lm.parse_args(TINY + flags), world=2)


def count_shared_memory_collectives() -> tuple[int, int]:
    """Bytes and calls CommCounter sees for collectives that go through shared memory (no c10d call for the bytes)."""
    import torch

    import tensorplay.distributed as dist
    from lm_report import CommCounter
    from tensorplay.distributed._comm import collectives

    world = dist.get_world_size()

    def six() -> None:
        collectives.all_gather_flat(torch.empty(world * 100_000), torch.ones(100_000))
        collectives.reduce_scatter_flat(torch.empty(100_000), torch.ones(world * 100_000))
        collectives.all_reduce(torch.ones(100_000))
        collectives.broadcast(torch.ones(100_000), 0)
        # fully_shard's paths: the all-gather writes the parameters, the reduce-scatter reads the gradients
        collectives.all_gather_flat(collectives.GatherParts([(0, torch.empty(world, 100_000))]), torch.ones(100_000))
        collectives.reduce_scatter_flat(torch.empty(100_000), collectives.ScatterParts(
            [(0, torch.ones(world, 100_000, dtype=torch.float64))], 100_000, torch.float32))

    six()  # the group's first shared-memory operation sets it up (a few tiny c10d calls, counted too)
    counter = CommCounter()
    with counter.counting():
        six()
    return counter.bytes, counter.calls


def test_comm_counter_counts_shared_memory_collectives():
    world = 2
    # all-gather output, reduce-scatter input, all-reduce, broadcast, then the same all-gather and reduce-scatter
    payload = 4 * 100_000 * (world + world + 1 + 1 + world + world)
    assert run_distributed(count_shared_memory_collectives, world_size=world) == [(payload, 6)] * world


def test_comm_counter_restores_the_collectives():
    import torch.distributed

    import tensorplay.distributed as dist
    from lm_report import CommCounter

    original = dist.all_reduce
    counter = CommCounter()
    with counter.counting():
        assert dist.all_reduce is not original and torch.distributed.all_reduce is not original
    assert dist.all_reduce is original and torch.distributed.all_reduce is original
