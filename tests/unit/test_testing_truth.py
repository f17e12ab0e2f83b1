"""Issue 21 §4: strategies that never lie.

Over ≥ 300 specs drawn from :func:`graphbuf.testing.specs`, every :class:`Batch` that
:func:`graphbuf.testing.batches` yields is accepted by ``refresh(*batch, **batch.kwargs)`` exactly as drawn
(``kwargs`` holds ``num_reqs`` only where no buffer's rows carry the live count), returning its ``num_reqs``;
every :class:`Rejected` raises exactly its error class, and no byte of the slab changes. The spec count scales
with the Hypothesis profile (``ci``: 300; ``deep``: 3000).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import strategies as st

import graphbuf
from graphbuf.testing import Batch, Rejected, batches, examples, sample, specs

PER_SPEC = 3  # valid and rejected batches drawn per spec


def _slab(buffers: graphbuf.StaticBuffers) -> torch.Tensor:
    return buffers.slab.clone()


def _check_spec(doc: dict[str, Any], seed: int) -> tuple[int, int]:
    buffers = graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(doc))
    carriers = [b for b in buffers.plan.buffers if b.rows.names & {"tokens", "requests"}]
    draws = st.tuples(
        st.lists(batches(buffers), min_size=PER_SPEC, max_size=PER_SPEC),
        st.lists(batches(buffers, rejected=True), min_size=PER_SPEC, max_size=PER_SPEC),
    )
    valid, rejected = sample(draws, seed=seed)[0]
    for batch in valid:
        assert isinstance(batch, Batch)
        assert batch.kwargs == ({} if carriers else {"num_reqs": batch.num_reqs}), (doc, batch)
        assert buffers.refresh(*batch, **batch.kwargs) == batch.num_reqs, (doc, batch)
    for bad in rejected:
        assert isinstance(bad, Rejected)
        before = _slab(buffers)
        with pytest.raises(bad.error) as info:
            buffers.refresh(*bad, **bad.kwargs)
        assert type(info.value) is bad.error, (doc, bad, info.value)
        assert torch.equal(_slab(buffers), before), (doc, bad)
    return len(valid), len(rejected)


def test_every_drawn_batch_is_true_for_300_drawn_specs() -> None:
    docs = sample(specs(), seed=21, count=examples(300))
    assert len(docs) >= examples(300)
    no_carrier = 0
    counted = [0, 0]
    for i, doc in enumerate(docs):
        rows = [b["rows"] for b in doc["buffers"].values()]
        no_carrier += not any("requests" in r or "tokens" in r for r in rows)
        v, r = _check_spec(doc, seed=i)
        counted[0] += v
        counted[1] += r
    assert counted == [PER_SPEC * len(docs)] * 2
    assert no_carrier > 0  # the case the issue found: specs whose refresh needs num_reqs= are among them
