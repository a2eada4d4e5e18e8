"""Classic FullyShardedDataParallel state dicts of a model with tied weights, ours and PyTorch's.

A T5-like model shares one embedding between ``shared``, ``encoder.embed_tokens``,
``decoder.embed_tokens`` and ``lm_head`` (the root unit holds it once, under four
names). Under every ``StateDictType`` a state dict saved from one model loads into
a differently initialised one: ours into ours, PyTorch's into ours, ours into
PyTorch's (in memory; sharded ones also through ``torch.distributed.checkpoint``
files). After loading, the full state dicts are bitwise equal and the four names
still hold one tensor.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import tensorplay.distributed as dist
from tensorplay.testing.distributed import run_distributed

from tests.parity.classic_fsdp_cases import fsdp_api

VOCAB, WIDTH = 11, 8
TIED = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")


class Stack(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.block = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(tokens)
        return self.norm(self.block(hidden if context is None else hidden + context))


class TiedSeq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, WIDTH)
        self.encoder = Stack(self.shared)
        self.decoder = Stack(self.shared)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.decoder(tokens, self.encoder(tokens)))


def build(impl: str, config: dict[str, Any], seed: int) -> nn.Module:
    api, wrap = fsdp_api(impl)
    torch.manual_seed(seed)
    policy = functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={nn.TransformerEncoderLayer})
    return api.FullyShardedDataParallel(TiedSeq2Seq(), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                        sharding_strategy=getattr(api.ShardingStrategy, config["strategy"]),
                                        use_orig_params=config["orig"])


def full_state(impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    api, _ = fsdp_api(impl)
    with api.FullyShardedDataParallel.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        return {key: value.clone() for key, value in model.state_dict().items()}


def shared_dir() -> str:
    holder = [tempfile.mkdtemp(prefix="tied_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, group_src=0)
    return holder[0]


def save_and_load(src: str, dst: str, config: dict[str, Any], kind: str, via_files: bool) -> dict[str, Any]:
    """Save ``kind`` from a ``src`` model, load it into a ``dst`` model with other values; compare in full."""
    source, target = build(src, config, seed=0), build(dst, config, seed=1)
    src_api, _ = fsdp_api(src)
    dst_api, _ = fsdp_api(dst)
    with src_api.FullyShardedDataParallel.state_dict_type(source, getattr(src_api.StateDictType, kind)):
        saved = source.state_dict()
    with dst_api.FullyShardedDataParallel.state_dict_type(target, getattr(dst_api.StateDictType, kind)):
        if via_files:
            path = shared_dir()
            dcp.save(saved, checkpoint_id=path)
            saved = target.state_dict()
            dcp.load(saved, checkpoint_id=path)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path)
        target.load_state_dict(saved)
    expected, loaded = full_state(src, source), full_state(dst, target)
    return {"keys": list(saved), "expected": expected, "loaded": loaded}


# (source, target, through DCP files) per state-dict type.
DIRECTIONS = {
    "FULL_STATE_DICT": [("ours", "ours", False), ("torch", "ours", False), ("ours", "torch", False)],
    # ShardedTensors on both sides (PyTorch's default); also through DCP files.
    "SHARDED_STATE_DICT": [("ours", "ours", False), ("torch", "ours", False), ("ours", "torch", False),
                           ("ours", "torch", True), ("torch", "ours", True)],
    "LOCAL_STATE_DICT": [("ours", "ours", False), ("torch", "ours", False), ("ours", "torch", False)],
}
CONFIGS = [dict(strategy="FULL_SHARD", orig=False), dict(strategy="FULL_SHARD", orig=True),
           dict(strategy="SHARD_GRAD_OP", orig=False), dict(strategy="NO_SHARD", orig=False)]


def cases() -> list[tuple[str, str, dict[str, Any], str, bool]]:
    found = []
    for kind, directions in DIRECTIONS.items():
        for config in CONFIGS:
            for src, dst, via_files in directions:
                # With use_orig_params=True PyTorch's local state dict holds the original parameters'
                # local pieces (and its flat layout aligns them), so only ours round-trips there.
                if kind == "LOCAL_STATE_DICT" and config["orig"] and "torch" in (src, dst):
                    continue
                found.append((src, dst, config, kind, via_files))
    return found


def run_cases(all_cases: list[tuple[str, str, dict[str, Any], str, bool]]) -> list[dict[str, Any]]:
    return [save_and_load(*case) for case in all_cases]


def test_tied_weights_round_trip_every_state_dict_type_across_ours_and_pytorch():
    all_cases = cases()
    for rank_results in run_distributed(run_cases, all_cases):
        for case, result in zip(all_cases, rank_results, strict=True):
            expected, loaded = result["expected"], result["loaded"]
            assert list(loaded) == list(expected), case
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), (case, key)
            assert not torch.equal(expected["shared.weight"], build_plain(1).shared.weight.detach()), case
            for key in TIED[1:]:
                assert torch.equal(loaded[key], loaded["shared.weight"]), (case, key)
            if case[3] == "LOCAL_STATE_DICT" and case[2]["strategy"] != "NO_SHARD":
                assert all(key.endswith("_flat_param") for key in result["keys"]), case


def build_plain(seed: int) -> TiedSeq2Seq:
    torch.manual_seed(seed)
    return TiedSeq2Seq()


def tied_training_after_load(kind: str) -> list[float]:
    """After a sharded/local load, the four names still share one parameter: training keeps them tied."""
    api, _ = fsdp_api("ours")
    config = dict(strategy="FULL_SHARD", orig=True)
    source, target = build("ours", config, seed=0), build("ours", config, seed=1)
    with api.FullyShardedDataParallel.state_dict_type(source, getattr(api.StateDictType, kind)):
        saved = source.state_dict()
    with api.FullyShardedDataParallel.state_dict_type(target, getattr(api.StateDictType, kind)):
        target.load_state_dict(saved)
    losses = []
    for model in (source, target):
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(step))
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    state = full_state("ours", target)
    assert all(torch.equal(state[key], state["shared.weight"]) for key in TIED)
    return losses


def test_loaded_tied_model_trains_like_the_source():
    for kind in ("SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        for losses in run_distributed(tied_training_after_load, kind):
            assert losses[:2] == losses[2:], kind
