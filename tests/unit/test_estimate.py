"""The memory estimator without a process group: the ZeRO paper's model-state formulas, bad input, plan, CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tensorplay.distributed as dist
from tensorplay.distributed import estimate as est
from tensorplay.distributed.estimate import BatchSpec, estimate_memory, plan
from tensorplay.distributed.estimate.__main__ import main as cli_main

WIDTH, DEPTH = 64, 8
PSI = WIDTH * WIDTH * DEPTH  # parameters; dims and the tensor count divide by 2, 4 and 8: nothing padded


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


BATCH = BatchSpec((8, WIDTH))


def _states(strategy: str, world: int) -> tuple[int, int]:
    """(model-state bytes of rank 0, parameter tensors rank 0's Adam keeps a 4-byte step for)."""
    estimate = estimate_memory(Stack, BATCH, world_size=world, strategy=strategy, optimizer_class=torch.optim.Adam,
                               param_dtype=torch.bfloat16, reduce_dtype=torch.float32, compare=False)
    rank0 = estimate.ranks[0]
    return rank0.model_states, _step_tensors(strategy, world)


def _step_tensors(strategy: str, world: int) -> int:
    if strategy == "fully_shard":
        return DEPTH  # one sharded DTensor per parameter
    if strategy == "fsdp_full_shard":
        return DEPTH  # one flat parameter per unit
    return DEPTH // world  # ZeRO: equal whole tensors, spread evenly


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zero_paper_model_state_formulas(world: int) -> None:
    """Mixed-precision Adam (bf16 compute, fp32 master weights), per rank, Psi parameters, N ranks:
    stage 1 (optimizer states partitioned: ``zero`` over a bf16 model) 4Psi + 12Psi/N; stage 3 (everything
    partitioned: ``fully_shard`` and classic FULL_SHARD, whose fp32 shard is the master copy) 16Psi/N.
    Adam's step counter adds 4 bytes per parameter tensor it updates."""
    states, steps = _states("zero", world)
    assert states - 4 * steps == 4 * PSI + 12 * PSI // world
    for strategy in ("fully_shard", "fsdp_full_shard"):
        states, steps = _states(strategy, world)
        assert states - 4 * steps == 16 * PSI // world


def _stage_two(world: int, low_precision_grads: bool = True) -> est.RankMemory:
    return estimate_memory(Stack, BATCH, world_size=world, strategy="fsdp_shard_grad_op",
                           optimizer_class=torch.optim.Adam, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                           keep_low_precision_grads=low_precision_grads, compare=False).ranks[0]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zero_paper_stage_two_formula(world: int) -> None:
    """Stage 2 (optimizer states and gradients partitioned), 2Psi + 14Psi/N: classic SHARD_GRAD_OP with
    ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, keep_low_precision_grads=True)``. Its bf16 parameters
    are gathered whole from forward to the end of backward (2Psi at once, the paper's replicated fp16 copy);
    the gradient shard stays bf16 (2Psi/N); the fp32 shard is the master copy next to Adam's m and v (12Psi/N).
    Without keep_low_precision_grads our FSDP keeps fp32 gradient shards: 2Psi + 16Psi/N."""
    stage_two = _stage_two(world)
    steps = 4 * DEPTH  # Adam's step counter per flat parameter
    assert stage_two.gathered_params == 2 * PSI
    assert stage_two.gathered_params + stage_two.model_states - steps == 2 * PSI + 14 * PSI // world
    fp32_grads = _stage_two(world, low_precision_grads=False)
    assert fp32_grads.gathered_params + fp32_grads.model_states - steps == 2 * PSI + 16 * PSI // world


def test_fp32_replicated_states_are_sixteen_bytes_a_parameter() -> None:
    estimate = estimate_memory(Stack, BATCH, world_size=4, strategy="ddp", optimizer_class=torch.optim.Adam,
                               compare=False)
    assert estimate.ranks[0].model_states == 16 * PSI + 4 * DEPTH


def test_padding_follows_the_sharding_layout() -> None:
    """A 3-row parameter over 2 ranks: each rank's shard is 2 rows (one padded), for fully_shard."""
    model = nn.Sequential(nn.Linear(5, 3, bias=False))
    estimate = estimate_memory(model, BatchSpec((2, 5)), world_size=2, strategy="fully_shard",
                               optimizer_class=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, compare=False)
    assert estimate.ranks[0].params == 2 * 5 * 4


def test_the_table_lists_every_strategy() -> None:
    estimate = estimate_memory(Stack, BATCH, world_size=2)
    table = estimate.table()
    for strategy in est.STRATEGIES:
        assert f"| {strategy} " in table
    assert "fully_shard reshard=False" in table
    sharded, replicated = estimate.ranks[0], estimate.others["ddp"][0]
    assert sharded.model_states < replicated.model_states


class MLPs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_activation_checkpointing_lowers_the_activation_peak() -> None:
    plain = estimate_memory(MLPs, BatchSpec((512, WIDTH)), world_size=2, compare=False)
    recomputed = estimate_memory(MLPs, BatchSpec((512, WIDTH)), world_size=2, compare=False,
                                 activation_checkpointing=True)
    assert recomputed.peak < 0.7 * plain.peak
    assert recomputed.ranks[0].model_states == plain.ranks[0].model_states


def test_exported_from_the_distributed_package() -> None:
    assert dist.estimate_memory is estimate_memory


# ---- bad input ---------------------------------------------------------------------------------------------

def test_a_real_model_too_large_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(est, "MAX_REAL_MODEL_BYTES", 1024)
    with pytest.raises(ValueError, match=r"model: .* on cpu.*build it on the meta device"):
        estimate_memory(Stack(), BATCH, world_size=2)


def test_a_small_real_model_is_copied_to_meta() -> None:
    model = Stack()
    estimate = estimate_memory(model, BATCH, world_size=2, compare=False)
    assert estimate.ranks[0].params == PSI * 4 // 2
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_an_unknown_strategy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"strategy 'fsdp3' is not one the estimator knows; choose one of "
                                         r"fully_shard, hsdp, .*ddp"):
        estimate_memory(Stack, BATCH, world_size=2, strategy="fsdp3")


def test_a_bad_world_size_is_named() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        estimate_memory(Stack, BATCH, world_size=0)


def test_a_budget_below_one_layer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"budget_bytes 1000 is smaller than one layer: unit layers.0 alone holds "
                                         r"16384 bytes"):
        plan(Stack, BATCH, 2, 1000)


@pytest.mark.parametrize(("options", "message"), [
    ({"strategy": "zero", "optim_in_backward": True}, "optim_in_backward is not supported with strategy 'zero'"),
    ({"clip_mode": "exact"}, "clip_mode 'exact' is the clipping of an optimizer applied in backward; set "
                             "optim_in_backward=True"),
    ({"optim_in_backward": True, "clip_mode": "global"}, "clip_mode must be one of exact, previous or None"),
    ({"keep_low_precision_grads": True}, "keep_low_precision_grads is classic FSDP's option"),
])
def test_bad_in_backward_and_gradient_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate_memory(Stack, BATCH, world_size=2, **options)


def test_cpu_offload_needs_a_sharded_strategy() -> None:
    with pytest.raises(ValueError, match="cpu_offload needs a sharded strategy"):
        estimate_memory(Stack, BATCH, world_size=2, strategy="ddp", cpu_offload=True)


# ---- plan and command line ---------------------------------------------------------------------------------

def test_plan_keeps_what_fits_least_communication_first() -> None:
    everything = plan(Stack, BATCH, 4, 1 << 30)
    assert {e.layout.strategy for e in everything} >= set(est.STRATEGIES)
    assert [e.comm_bytes for e in everything] == sorted(e.comm_bytes for e in everything)
    ddp = next(e for e in everything if e.layout.strategy == "ddp")
    budget = ddp.peak - 1  # ddp (and its twin fsdp_no_shard) no longer fit; the sharded ones do
    tight = plan(Stack, BATCH, 4, budget)
    assert "ddp" not in {e.layout.strategy for e in tight}
    assert "fully_shard" in {e.layout.strategy for e in tight}
    assert all(e.peak <= budget and e.max_batch >= BATCH.shape[0] for e in tight)


def _model_file(tmp_path: Path) -> Path:
    """A model file the command line builds from defaults."""
    model_file = tmp_path / "model.py"
    model_file.write_text("from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self):\n"
                          "        super().__init__()\n        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in "
                          "range(3))\n\n    def forward(self, x):\n        for layer in self.layers:\n"
                          "            x = layer(x)\n        return x\n")
    return model_file


def test_command_line_prints_the_table_and_draws_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_file = _model_file(tmp_path)
    png = tmp_path / "bars.png"
    cli_main([str(model_file), "--world-size", "4", "--budget", "1GiB", "--batch", "8x32", "--plot", str(png)])
    out = capsys.readouterr().out
    assert "| fully_shard |" in out and "plan for 1.0 GiB per rank" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_command_line_rejects_a_bad_budget(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["x.py", "--world-size", "2", "--budget", "80 parsecs"])
    assert exit_info.value.code == 2
    assert "--budget '80 parsecs': a number of bytes with an optional unit" in capsys.readouterr().err


def test_cpu_offload_moves_the_model_states_to_the_host() -> None:
    on_device = estimate_memory(Stack, BATCH, world_size=2, compare=False).ranks[0]
    offloaded = estimate_memory(Stack, BATCH, world_size=2, compare=False, cpu_offload=True).ranks[0]
    assert offloaded.offloaded == on_device.model_states
    assert offloaded.peak < on_device.peak


# ---- optimizer in backward (the measured side: tests/parity/test_estimate_measured.py) ----------------------

def _ranks(**options: object) -> est.RankMemory:
    return estimate_memory(MLPs, BatchSpec((16, WIDTH)), world_size=2, compare=False, device="cpu",
                           **options).ranks[0]  # type: ignore[arg-type]


def test_in_backward_has_no_optimizer_step_and_keeps_no_gradient() -> None:
    """DDP's peak is its optimizer step (gradients, buckets, state and temporaries at once); stepped per bucket
    in backward it is lower, named there, and no gradient is left."""
    after, during = _ranks(strategy="ddp"), _ranks(strategy="ddp", optim_in_backward=True)
    assert after.where == "optimizer step" and after.grads > 0
    assert "optimizer step" not in during.phase_peaks and during.grads == 0
    assert "optimizer step in backward (bucket 0)" in during.where
    assert during.peak < after.peak
    assert during.model_states == after.model_states - after.grads


def test_exact_clipping_keeps_the_sharded_gradients_to_the_end_of_backward() -> None:
    """fully_shard frees each group's gradient as it steps; "exact" holds them all until the clipped step."""
    at_once = _ranks(optim_in_backward=True)
    exact = _ranks(optim_in_backward=True, clip_mode="exact")
    assert exact.phase_peaks["backward"] > at_once.phase_peaks["backward"]
    assert exact.grads == at_once.grads == 0


def test_command_line_takes_the_optimizer_in_backward(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_file = _model_file(tmp_path)
    cli_main([str(model_file), "--world-size", "2", "--batch", "8x32", "--optim-in-backward", "exact"])
    out = capsys.readouterr().out
    assert "| fully_shard in-backward exact clip |" in out and "| zero |" in out
    with pytest.raises(SystemExit):
        cli_main([str(model_file), "--world-size", "2", "--strategy", "zero", "--optim-in-backward"])
    assert "optim_in_backward is not supported with strategy 'zero'" in capsys.readouterr().err
