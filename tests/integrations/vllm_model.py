"""The one thing the vLLM harness emulates: the model's forward pass.

A worker's "forward" does what attention does to the KV cache: it reads every slot of
each scheduled request's context (checked byte for byte against the pattern those
tokens must have produced, whoever wrote it: this engine, the prefix cache or a KV
load) and writes the slots of the tokens it computes. The KV of position ``p`` depends
on the tokens up to ``p`` (as a real model's does, so prefix caching stays correct),
on the layer and on the global head; the next token depends on every token so far,
and a request whose context read back wrong samples POISON instead, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = 1000
POISON = VOCAB + 7  # sampled instead of the next token when the context read back wrong
_MOD = 2_147_483_647


def prefix_hashes(tokens: list[int]) -> list[int]:
    """A rolling hash of tokens[: p + 1] for each position p."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h)
    return out


def next_token(tokens: list[int]) -> int:
    return (prefix_hashes(tokens)[-1] * 7 + len(tokens)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    """The n tokens one engine would generate for ``prompt``."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def pattern(hashes: list[int], layer: int, heads: list[int], content: int) -> torch.Tensor:
    """[positions, heads, content] float16 values (small integers: exact in fp16)."""
    base = torch.tensor([h % 2039 for h in hashes], dtype=torch.int64)[:, None, None]
    head = torch.tensor(heads, dtype=torch.int64)[None, :, None] * 17
    col = torch.arange(content, dtype=torch.int64)[None, None, :]
    return ((base + head + col + 31 * layer) % 2048).to(torch.float16)


@dataclass
class _Req:
    tokens: list[int]
    blocks: list[list[int]] = field(default_factory=list)  # per KV cache group


@dataclass(frozen=True)
class Layer:
    """One layer of this worker as the emulated forward sees it: its global index, its
    KV cache group, its sliding window (0: full attention), or a state layer (Mamba:
    vLLM's view of it holds a block's state bytes)."""

    index: int
    name: str
    group: int
    window: int = 0
    state: bool = False


class Model:
    """One worker's emulated forward over the caches vLLM allocated: its layers (global
    indices: a pipeline stage holds some) and its global KV heads. Attention layers
    read every slot they attend (a sliding window's: the window's) and write their
    tokens' slots; a state layer (Mamba) reads the state the tokens so far leave and
    writes the one its step leaves, a pattern of those tokens."""

    def __init__(
        self,
        kv_caches: dict[str, Any],
        layers: list[int],
        block_size: int,
        heads: list[int],
        specs: list[Layer] | None = None,
    ):
        self.specs = specs or [Layer(i, f"model.layers.{i}.self_attn.attn", 0) for i in layers]
        self.layers = [s.index for s in self.specs if not s.state]
        self.attn = [s for s in self.specs if not s.state]
        self.caches = [kv_caches[s.name] for s in self.attn]
        self.states = [(s, kv_caches[s.name]) for s in self.specs if s.state]
        self.block_size = block_size
        assert self.caches[0].shape[1] == len(heads), (self.caches[0].shape, heads)
        self.heads = heads
        self.content = self.caches[0].shape[-1]
        self.reqs: dict[str, _Req] = {}
        self.bytes_verified = 0
        self.mismatches: list[str] = []

    def _slots(self, blocks: list[int], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(lo, hi)
        ids = torch.tensor(blocks, dtype=torch.int64)[pos // self.block_size]
        return ids, pos % self.block_size

    @staticmethod
    def _state(layer: Layer, view: Any, r: _Req) -> torch.Tensor:
        """The layer's state bytes of the request (its group's last block)."""
        return view[r.blocks[layer.group][-1]].reshape(-1).view(torch.uint8)

    @staticmethod
    def _state_pattern(tokens: list[int], layer: int, n: int) -> torch.Tensor:
        h = prefix_hashes(tokens)[-1] if tokens else 0
        return ((torch.arange(n, dtype=torch.int64) * 7 + h + 31 * layer) % 251).to(torch.uint8)

    def _read_ok(self, rid: str, r: _Req, upto: int) -> bool:
        if upto == 0:
            return True
        hashes = prefix_hashes(r.tokens[:upto])
        ok = True
        for spec, cache in zip(self.attn, self.caches, strict=True):
            lo = max(0, upto - spec.window + 1) if spec.window else 0  # token upto's window
            blocks, offs = self._slots(r.blocks[spec.group], lo, upto)
            got = cache[blocks, :, offs, :]
            want = pattern(hashes[lo:], spec.index, self.heads, self.content)
            self.bytes_verified += got.numel() * got.element_size()
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                bad = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
                self.mismatches.append(
                    f"{rid} layer {spec.index}: positions {[lo + b for b in bad[:8]]} of {upto}"
                )
                ok = False
        for spec, buf in self.states:
            got = self._state(spec, buf, r)
            want = self._state_pattern(r.tokens[:upto], spec.index, got.numel())
            self.bytes_verified += got.numel()
            if not torch.equal(got, want):
                self.mismatches.append(f"{rid} layer {spec.index}: state after {upto} tokens")
                ok = False
        return ok

    def _write(self, r: _Req, lo: int, hi: int) -> None:
        hashes = prefix_hashes(r.tokens[:hi])[lo:]
        for spec, cache in zip(self.attn, self.caches, strict=True):
            blocks, offs = self._slots(r.blocks[spec.group], lo, hi)
            cache[blocks, :, offs, :] = pattern(hashes, spec.index, self.heads, self.content)
        for spec, buf in self.states:
            state = self._state(spec, buf, r)
            state.copy_(self._state_pattern(r.tokens[:hi], spec.index, state.numel()))

    def forward(self, so: Any, all_ok: Any) -> tuple[list[str], list[list[int]]]:
        """Run one scheduler output; ``all_ok(flags)`` agrees the per-request read
        checks across TP ranks. Returns (req_ids, sampled token ids)."""
        for rid in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            self.reqs.pop(rid, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            tokens = list(new.prefill_token_ids or new.prompt_token_ids or [])
            self.reqs[new.req_id] = _Req(tokens, [list(b) for b in new.block_ids])
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i]:
                for g, ids in enumerate(cached.new_block_ids[i]):
                    self.reqs[rid].blocks[g] += ids
            computed[rid] = cached.num_computed_tokens[i]
        rids = list(so.num_scheduled_tokens)
        flags = []
        for rid in rids:
            r = self.reqs[rid]
            start = computed[rid]
            flags.append(self._read_ok(rid, r, start))
            self._write(r, start, start + so.num_scheduled_tokens[rid])
        flags = all_ok(flags)
        sampled = []
        for rid, ok in zip(rids, flags, strict=True):
            r = self.reqs[rid]
            if computed[rid] + so.num_scheduled_tokens[rid] < len(r.tokens):
                sampled.append([])  # a prefill chunk: no token yet
                continue
            tok = next_token(r.tokens) if ok else POISON
            r.tokens.append(tok)
            sampled.append([tok])
        return rids, sampled
