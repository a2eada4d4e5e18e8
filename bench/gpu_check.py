"""``make gpu-check``: every CUDA-only check in one command, one table and one JSON file (bench/out/gpu_check.json).

On a machine with CUDA it runs, within about eight minutes on one H200:

1. the CUDA-only tests (:data:`CUDA_TESTS`): NCCL at world size 1 for fully_shard (fp32, bf16), HSDP on a 1x1
   mesh, classic FSDP (fp32, bf16) and ZeRO, each bitwise against PyTorch's under deterministic algorithms;
   pinned-memory CPU offload (bitwise, and the shards in pinned host memory); the prefetch overlap (the
   all-gather of unit i+1 starts, on the all-gather stream, before unit i's compute ends on the compute
   stream, read from CUDA events); the memory planner against ``torch.cuda.max_memory_allocated``; and the
   CUDA-only tests elsewhere in the suite;
2. the step-time benchmark: ours and PyTorch's fully_shard on a Llama-like model of about 1B parameters
   (:data:`LLAMA_1B`), bf16 parameters and fp32 reduction, AdamW, NCCL world size 1, steps alternating between
   the two, median step time (CUDA-synchronized wall clock) and the host CPU time per step.

Without CUDA it prints what it would run and exits 0.

    .venv/bin/python bench/gpu_check.py [--steps 10] [--no-tests] [--no-bench]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).parent
ROOT = HERE.parent
OUT = HERE / "out"
CUDA_TESTS = (
    "tests/gpu/test_cuda_parity.py",
    "tests/parity/test_sharded_grad_scaler.py::test_cuda_and_cpu_offloaded_gradients_share_one_decision",
)
TEST_TIMEOUT_S = 300


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 2048
    layers: int = 16
    heads: int = 16
    ffn: int = 5632
    vocab: int = 32000
    seq: int = 2048
    batch: int = 2


LLAMA_1B = LlamaConfig()


# ---- the model ------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm attention and SwiGLU feed-forward, as in Llama (no rotary embedding: it does not change the
    sharding or the host work)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(config.dim), nn.RMSNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        self.gate_up = nn.Linear(config.dim, 2 * config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parameter_count(config: LlamaConfig) -> int:
    per_block = 4 * config.dim ** 2 + 3 * config.dim * config.ffn + 2 * config.dim
    return config.layers * per_block + 2 * config.vocab * config.dim + config.dim


# ---- the step-time benchmark ----------------------------------------------------------------------
def _sharded_llama(ours: bool, config: LlamaConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    if ours:
        from tensorplay.distributed import fsdp
    else:
        from torch.distributed import fsdp  # type: ignore[no-redef]
    torch.manual_seed(0)
    model = Llama(config).cuda()
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp.fully_shard(block, mp_policy=policy)
    fsdp.fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    """One step: (CUDA-synchronized wall ms, host CPU ms)."""
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    cpu = time.process_time() - cpu
    torch.cuda.synchronize()
    return (time.perf_counter() - wall) * 1e3, cpu * 1e3


def step_time_benchmark(config: LlamaConfig, steps: int, warmup: int = 3) -> dict[str, Any]:
    """Ours and PyTorch's fully_shard on ``config``, NCCL world size 1, steps alternating."""
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = {"ours": _sharded_llama(True, config), "pytorch": _sharded_llama(False, config)}
        torch.manual_seed(1)
        tokens = torch.randint(0, config.vocab, (config.batch, config.seq + 1), device="cuda")
        samples: dict[str, list[tuple[float, float]]] = {key: [] for key in runs}
        for i in range(warmup + steps):
            for key in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                sample = _step(*runs[key], tokens)
                if i >= warmup:
                    samples[key].append(sample)
        result: dict[str, Any] = {"params": parameter_count(config), "steps": steps, "config": config.__dict__}
        for key, values in samples.items():
            result[key] = {"step_ms": statistics.median(v[0] for v in values),
                           "host_cpu_ms": min(v[1] for v in values)}
        result["ratio"] = result["ours"]["step_ms"] / result["pytorch"]["step_ms"]
        return result
    finally:
        dist.destroy_process_group()


# ---- the tests ------------------------------------------------------------------------------------
def run_tests() -> list[dict[str, Any]]:
    """The CUDA-only tests through pytest, one result per test from its JUnit report."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={report}",
                   *CUDA_TESTS]
        try:
            subprocess.run(command, cwd=ROOT, timeout=TEST_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return [{"check": "CUDA-only tests", "result": "timeout", "detail": f"over {TEST_TIMEOUT_S} s"}]
        if not report.exists():
            return [{"check": "CUDA-only tests", "result": "error", "detail": "pytest wrote no report"}]
        return [_case_row(case) for case in ET.parse(report).getroot().iter("testcase")]


def _case_row(case: ET.Element) -> dict[str, Any]:
    outcome, detail = "passed", f"{float(case.get('time', 0)):.1f} s"
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
            detail = (found.get("message") or "").splitlines()[0][:100] if found.get("message") else tag
    return {"check": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}", "result": outcome,
            "detail": detail}


def bench_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    ours, theirs = result["ours"], result["pytorch"]
    label = f"fully_shard step, Llama-like {result['params'] / 1e9:.2f}B bf16, NCCL W=1"
    return [{"check": label, "result": f"{result['ratio']:.2f}x PyTorch's",
             "detail": f"ours {ours['step_ms']:.1f} ms, PyTorch's {theirs['step_ms']:.1f} ms (median of "
                       f"{result['steps']})"},
            {"check": "fully_shard host CPU per step, same run", "result":
             f"{ours['host_cpu_ms'] / theirs['host_cpu_ms']:.2f}x PyTorch's",
             "detail": f"ours {ours['host_cpu_ms']:.1f} ms, PyTorch's {theirs['host_cpu_ms']:.1f} ms (cheapest)"}]


def print_plan(steps: int) -> None:
    print("gpu-check: no CUDA device here; with one it would run (and print one table, write bench/out/"
          "gpu_check.json):")
    print("  1. the CUDA-only tests (pytest, NCCL world size 1, one fresh rank each):")
    for target in CUDA_TESTS:
        print(f"       {target}")
    for line in _test_listing():
        print(f"         - {line}")
    config = LLAMA_1B
    print(f"  2. the step-time benchmark: ours vs PyTorch's fully_shard, Llama-like {config.layers} blocks x "
          f"dim {config.dim} (ffn {config.ffn}, vocab {config.vocab}; {parameter_count(config) / 1e9:.2f}B "
          f"parameters), batch {config.batch} x {config.seq} tokens, bf16 parameters / fp32 reduction, fused "
          f"AdamW, {steps} timed steps alternating: median step ms and host CPU ms per step")
    print("gpu-check: nothing run (exit 0)")


def _test_listing() -> list[str]:
    """The test functions in the tests/gpu files (read from the source: collecting would import CUDA code)."""
    names = []
    for target in CUDA_TESTS:
        path = ROOT / target.split("::")[0]
        if "::" in target:
            continue
        for line in path.read_text().splitlines():
            if line.startswith("def test_"):
                names.append(line[4:line.index("(")])
    return names


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| check | result | detail |\n|---|---|---|")
    for row in rows:
        print(f"| {row['check']} | {row['result']} | {row['detail']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print_plan(args.steps)
        return 0
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    started = time.perf_counter()
    rows = [] if args.no_tests else run_tests()
    result = None if args.no_bench else step_time_benchmark(LLAMA_1B, args.steps)
    if result is not None:
        rows += bench_rows(result)
    print(f"\n## gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{math.ceil(time.perf_counter() - started)} s\n")
    print_table(rows)
    OUT.mkdir(exist_ok=True)
    path = OUT / "gpu_check.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows, "bench": result}, indent=1))
    print(f"\njson: {path.relative_to(ROOT)}")
    failed = [row for row in rows if row["result"] in ("FAILED", "ERROR", "timeout", "error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
