"""Shared by the device test files: a random paged-KV case and an independent CPU FP32 SDPA reference over
each query's visible prefix (keys ``0 .. seq_len - q_len + i``)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

TOL = {"rtol": 0.015, "atol": 0.015}
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, WIDTH, BLOCKS = 16, 2, 512, 128, 4, 40


def make_case(seq_lens, q_len, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kc = torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    vc = torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    query = torch.randn(len(seq_lens) * q_len, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    ids = rng.sample(range(BLOCKS), BLOCKS)
    table = torch.empty(len(seq_lens), WIDTH, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        needed = -(-n // BLOCK)
        row = [ids.pop() for _ in range(needed)] + [rng.choice([-1, BLOCKS + 3, 2**31 - 1])] * (
            WIDTH - needed
        )
        table[r] = torch.tensor(row, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (query, kc, vc, table, lens)]


def sdpa_reference(query, key_cache, value_cache, block_table, seq_lens, q_len, scale):
    """CPU FP32 SDPA over each query's visible prefix (keys 0 .. seq_len - q_len + i); no prefix -> zeros."""
    q, k, v = (t.detach().float().cpu() for t in (query, key_cache, value_cache))
    table, lens = block_table.cpu().tolist(), seq_lens.cpu().tolist()
    out = torch.zeros_like(q)
    for r in range(len(lens)):
        for i in range(q_len):
            n = lens[r] - q_len + i + 1
            if n <= 0:
                continue
            blocks = torch.tensor([table[r][p // BLOCK] for p in range(n)])
            slots = torch.arange(n) % BLOCK
            keys = k[blocks, slots].permute(1, 0, 2).unsqueeze(0)
            values = v[blocks, slots].permute(1, 0, 2).unsqueeze(0)
            row = q[r * q_len + i].unsqueeze(0).unsqueeze(2)
            out[r * q_len + i] = F.scaled_dot_product_attention(
                row, keys, values, scale=scale, enable_gqa=True
            )[0, :, 0]
    return out
