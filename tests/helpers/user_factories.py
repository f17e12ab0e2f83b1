"""Task factories a user writes and allows with ``--allow-factory user_factories`` (test_factories)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from graphbuf.spec.factories import declare_options


class WidgetOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    width: int
    mode: str = "fast"


@declare_options(WidgetOptions)
def widget_task(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, **options}


def undeclared_task(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, **options}
