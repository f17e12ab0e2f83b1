"""Drill tasks with planted bugs and known pad dependences (``--allow-factory planted_tasks``), shipped with
``planted.yaml`` for the README's drill transcript: the drill's shrinking and the padding contract
(tests/unit/drill/test_shrink.py) must find them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel, ConfigDict

from graphbuf import StaticBuffers, Step
from graphbuf.spec.factories import declare_options

#: The spec of ``planted.yaml`` beside this file, without its task (tests plant the task they need).
PLANTED_SPEC: dict[str, Any] = {
    k: v
    for k, v in yaml.safe_load((Path(__file__).with_name("planted.yaml")).read_text()).items()
    if k != "tasks"
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
