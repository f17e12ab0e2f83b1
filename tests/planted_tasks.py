"""Drill tasks with planted bugs and known pad dependences (``--allow-factory planted_tasks``): the drill's
shrinking (test_drill_shrink) and the padding contract (test_padding_contract) must find them."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from graphbuf import StaticBuffers, Step
from graphbuf.factories import declare_options

#: tokens_per_request 1; sizes hold 1 and 4 requests, so 2 and 3 requests replay with padded rows.
PLANTED_SPEC: dict[str, Any] = {
    "version": 1,
    "name": "planted",
    "constants": {"max_num_seqs": 4},
    "capture": {"tokens_per_request": 1, "sizes": [1, 4]},
    "groups": ["default"],
    "buffers": {
        "lens": {"dtype": "int32", "rows": "requests", "pad": 7, "min": 0, "max": 50},
        "scale": {"dtype": "int32", "rows": "requests", "pad": 0, "min": 0, "max": 9},
        "table": {"dtype": "int32", "rows": "requests", "cols": 3, "pad": 0, "min": 0, "max": 9},
    },
}


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Task:
    output_rows = "requests"

    def __init__(self, name: str) -> None:
        self.name = name

    def bind(self, buffers: StaticBuffers, generator: torch.Generator) -> None:
        pass

    def randomize(self, live_requests: int, generator: torch.Generator) -> None:
        pass


class ReadsOnePastTheBatch(_Task):
    """Planted bug: request r reads ``lens[r + 1]`` as well, so the last live request reads the row past
    the live batch (a padded row in a replay; nothing, read as 0, in the raw batch)."""

    def __call__(self, step: Step) -> torch.Tensor:
        lens = step.views["lens"].float()
        ahead = torch.cat([lens[1:], torch.zeros(1)])
        return lens + ahead


class DependsOnScalePad(_Task):
    """Reads every captured row of ``scale`` (a sum over the padded rows too), ``lens`` row by row and
    never ``table``: its live outputs depend on ``scale``'s pad only."""

    def __call__(self, step: Step) -> torch.Tensor:
        return step.views["lens"].float() + step.views["scale"].float().sum()


@declare_options(NoOptions)
def reads_one_past(name: str, **options: Any) -> ReadsOnePastTheBatch:
    return ReadsOnePastTheBatch(name)


@declare_options(NoOptions)
def depends_on_scale_pad(name: str, **options: Any) -> DependsOnScalePad:
    return DependsOnScalePad(name)


class FaultsOnJunkTable(_Task):
    """Faults, as a device kernel's bounds check would, when a padded row of ``table`` holds a nonzero id
    (an eager-only task: the check reads the device values on the host)."""

    def __call__(self, step: Step) -> torch.Tensor:
        if bool((step.views["table"][step.requests :] != 0).any()):
            raise RuntimeError("block id out of range in a padded row")
        return step.views["lens"].float()


@declare_options(NoOptions)
def faults_on_junk_table(name: str, **options: Any) -> FaultsOnJunkTable:
    return FaultsOnJunkTable(name)
