"""Tensor-parallel layers: each rank holds a slice of a layer's weight and the ranks combine their partial results.

A decoder splits cleanly into two patterns. A column-parallel linear (qkv_proj, gate_up_proj) splits its output
features: each rank computes its own attention heads or its own slice of the MLP, with no communication. A
row-parallel linear (o_proj, down_proj) splits its input features to match, so each rank's product is a partial
sum of the full output and one all-reduce completes it. The embedding and the LM head split the vocabulary: an
all-reduce assembles the embedded rows, an all-gather the logits. Everything else (norms, rotary) is replicated.

Attention heads are split by key/value head, each rank taking its KV heads together with the query heads that
share them. When the KV heads do not divide evenly the ranks differ by one KV head (SmolLM2-135M's 3 KV heads run
as 1 + 2 on two ranks), which is still exact; a rank needs at least one.

With one rank (TensorParallel(), the default) every layer here has its plain layer's shape and the collectives
are skipped, so the single-process model runs exactly as before. Each layer's `load` copies its own slice of a
full checkpoint tensor, so a rank never keeps more than its shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from petrel.model.layers import Linear


class TensorParallel:
    """This process's place in a tensor-parallel group (rank, size) and the two collectives the layers need, over
    torch.distributed's default process group (joined by petrel.distributed.group.join_group)."""

    def __init__(self, rank: int = 0, size: int = 1, expert_parallel: bool = False):
        self.rank, self.size = rank, size
        self.expert_parallel = expert_parallel  # mixtures of experts: whole experts per rank (petrel/model/moe.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (rank order)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"


SINGLE = TensorParallel()


def partition(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `total` units are cut into `parts` contiguous parts (sizes differ by one
    at most)."""
    return total * index // parts, total * (index + 1) // parts


def check_tensor_parallel(cfg, size: int, expert_parallel: bool = False) -> None:
    """ValueError unless the model can be split over `size` ranks (each needs a KV head and a slice of the MLP; of a
    mixture of experts, an expert with expert_parallel, else a slice of every expert)."""
    if getattr(cfg, "kv_lora_rank", 0) and size > 1:
        raise ValueError(
            f"tensor_parallel_size={size}: multi-head latent attention ({cfg.architecture}) runs on one rank "
            f"(use tensor_parallel_size=1)"
        )
    if size > cfg.num_key_value_heads:
        raise ValueError(
            f"tensor_parallel_size={size} is larger than the model's {cfg.num_key_value_heads} key/value "
            f"heads: every rank needs at least one (use tensor_parallel_size <= {cfg.num_key_value_heads})"
        )
    experts = getattr(cfg, "num_experts", 0)
    if size > cfg.intermediate_size and (not experts or cfg.dense_layers):  # a mixture of experts: its dense layers'
        raise ValueError(f"tensor_parallel_size={size} is larger than the model's MLP width {cfg.intermediate_size}")
    if experts and expert_parallel and size > experts:
        raise ValueError(
            f"tensor_parallel_size={size} with enable_expert_parallel is larger than the model's {experts} experts: "
            f"every rank needs one"
        )
    if experts and not expert_parallel and size > cfg.moe_intermediate_size:
        raise ValueError(
            f"tensor_parallel_size={size} is larger than the model's expert width {cfg.moe_intermediate_size}"
        )


class AttentionHeads:
    """The attention heads one rank computes: a contiguous range of KV heads and the query heads grouped on them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel):
        group = num_heads // num_kv_heads
        self.kv_start, self.kv_stop = partition(num_kv_heads, tp.size, tp.rank)
        self.num_kv_heads = self.kv_stop - self.kv_start
        self.num_heads = self.num_kv_heads * group
        d = head_dim
        q_rows = (self.kv_start * group * d, self.kv_stop * group * d)
        kv_rows = (self.kv_start * d, self.kv_stop * d)
        self.qkv_pieces = [num_heads * d, num_kv_heads * d, num_kv_heads * d]  # checkpoint q, k, v rows
        self.qkv_shards = [q_rows, kv_rows, kv_rows]  # the rows this rank holds of each
        self.o_columns = q_rows  # o_proj's input columns


def local_kv_heads(num_kv_heads: int, tp: TensorParallel) -> int:
    start, stop = partition(num_kv_heads, tp.size, tp.rank)
    return stop - start


def max_local_kv_heads(num_kv_heads: int, size: int) -> int:
    """The most KV heads any rank holds (what sizes a cache block on every rank)."""
    return -(-num_kv_heads // size)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


class ColumnParallelLinear(Linear):
    """Output features split across ranks, no communication. The output may be several pieces side by side (q, k,
    v; gate, up), each split on its own: a rank's weight is [its q rows; its k rows; its v rows]."""

    def __init__(self, in_features: int, pieces: list[int], shards: list[tuple[int, int]], bias: bool):
        super().__init__(in_features, sum(stop - start for start, stop in shards), bias=bias)
        self.pieces, self.shards = pieces, shards

    @classmethod
    def even(cls, in_features: int, pieces: list[int], tp: TensorParallel, bias: bool) -> ColumnParallelLinear:
        """Each piece cut into near-equal contiguous slices, one per rank."""
        return cls(in_features, pieces, [partition(p, tp.size, tp.rank) for p in pieces], bias)

    def load(self, kind: str, tensor: torch.Tensor, piece: int | None, name: str) -> list[int]:
        """Copy this rank's rows of a checkpoint tensor: one piece (q_proj), or all of them fused (Phi-3's qkv_proj).
        Returns the pieces loaded."""
        which = list(range(len(self.pieces))) if piece is None else [piece]
        rows = sum(self.pieces[i] for i in which)
        _check_shape(name, tensor, (rows, self.in_features) if kind == "weight" else (rows,))
        param = getattr(self, kind).data
        offset_of = [0]
        for start, stop in self.shards:
            offset_of.append(offset_of[-1] + stop - start)
        for i, part in zip(which, tensor.split([self.pieces[i] for i in which])):
            start, stop = self.shards[i]
            param[offset_of[i] : offset_of[i + 1]].copy_(part[start:stop])
        return which


class RowParallelLinear(Linear):
    """Input features split across ranks (matching the column-parallel layer before it); the partial products are
    summed by an all-reduce. The bias is added once: rank 0 holds it, the other ranks hold zeros."""

    def __init__(self, in_features: int, columns: tuple[int, int], out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(columns[1] - columns[0], out_features, bias=bias)
        self.full_in_features, self.columns, self.tp = in_features, columns, tp

    @classmethod
    def even(cls, in_features: int, out_features: int, tp: TensorParallel, bias: bool) -> RowParallelLinear:
        return cls(in_features, partition(in_features, tp.size, tp.rank), out_features, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def load(self, kind: str, tensor: torch.Tensor, piece: int | None, name: str) -> None:
        if kind == "weight":
            _check_shape(name, tensor, (self.out_features, self.full_in_features))
            self.weight.data.copy_(tensor[:, self.columns[0] : self.columns[1]])
        else:
            _check_shape(name, tensor, (self.out_features,))
            self.bias.data.copy_(tensor if self.tp.rank == 0 else torch.zeros_like(tensor))


class VocabParallelEmbedding(nn.Embedding):
    """Vocabulary rows split across ranks (padded to a multiple of the rank count); a token's row comes from the
    rank that holds it, the others contribute zeros to an all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        self.vocab_size, self.tp = vocab_size, tp
        self.rows = -(-vocab_size // tp.size)
        self.first = tp.rank * self.rows
        super().__init__(self.rows, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def load(self, kind: str, tensor: torch.Tensor, piece: int | None, name: str) -> None:
        load_vocab_rows(self.weight, tensor, self.first, self.vocab_size, name)


class ParallelLMHead(Linear):
    """The LM head with its vocabulary rows split as VocabParallelEmbedding splits them (so a tied head shares the
    embedding's shard); every rank's logits are gathered into the full vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel):
        self.vocab_size, self.tp = vocab_size, tp
        rows = -(-vocab_size // tp.size)
        self.first = tp.rank * rows
        super().__init__(hidden_size, rows, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.tp.size == 1 else self.tp.all_gather(out)[..., : self.vocab_size]

    def load(self, kind: str, tensor: torch.Tensor, piece: int | None, name: str) -> None:
        load_vocab_rows(self.weight, tensor, self.first, self.vocab_size, name)


def load_vocab_rows(weight: nn.Parameter, tensor: torch.Tensor, first: int, vocab_size: int, name: str) -> None:
    _check_shape(name, tensor, (vocab_size, weight.shape[1]))
    rows = tensor[first : first + weight.shape[0]]
    weight.data[: rows.shape[0]].copy_(rows)
    weight.data[rows.shape[0] :].zero_()  # padding past the vocabulary: never looked up, its logits cut off


SHARDED_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)
