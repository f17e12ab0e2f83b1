"""The whole-model drill: ``graphbuf drill gemma4-31b-it-mtp --model tiny`` (see :mod:`.run`).

Needs transformers (``pip install -c constraints.txt -e '.[model]'``); imported only inside this package.
"""

from __future__ import annotations

from .run import ModelDrillReport, run_model_drill, run_model_drill_cli
from .serve import Request, Scenario

__all__ = ["ModelDrillReport", "Request", "Scenario", "run_model_drill", "run_model_drill_cli"]
