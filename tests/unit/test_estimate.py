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


def test_command_line_prints_the_table_and_draws_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_file = tmp_path / "model.py"
    model_file.write_text("from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self):\n"
                          "        super().__init__()\n        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in "
                          "range(3))\n\n    def forward(self, x):\n        for layer in self.layers:\n"
                          "            x = layer(x)\n        return x\n")
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
