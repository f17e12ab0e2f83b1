"""The small paged-attention spec the runner, fault and thread tests share: a block table and sequence
lengths, capture sizes 2, 4 and 8 (one token per request); at size 8 the block table is square (8 x 8)."""

from __future__ import annotations

from typing import Any

SIZES = (2, 4, 8)
WIDTH = 8  # cdiv(max_model_len, block_size)
PAGED_SPEC: dict[str, Any] = {
    "version": 1,
    "name": "paged",
    "constants": {"max_num_seqs": 8, "block_size": 4, "max_model_len": 32, "num_blocks": 16},
    "capture": {"tokens_per_request": 1, "sizes": list(SIZES)},
    "buffers": {
        "block_table": {
            "dtype": "int32",
            "rows": "requests",
            "cols": "cdiv(max_model_len, block_size)",
            "min": 0,
            "max": "num_blocks - 1",
        },
        "seq_lens": {"dtype": "int32", "rows": "requests", "min": 0, "max": "max_model_len"},
    },
}
