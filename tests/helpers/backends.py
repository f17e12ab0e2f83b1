"""A pytest plugin (tests/conftest.py loads it): every test under ``tests/unit/buffers`` runs on both
backends, the one choice :class:`graphbuf.StaticBuffers` reads when it is built
(``graphbuf.buffers.native``): ``native`` (the C kernel and host state, where built) and ``numpy``
(the Python path, as with ``GRAPHBUF_NATIVE=0`` or no C compiler). Both must give the same bytes and
errors, so one suite pins both. Modules marked ``backends_compared`` run once: they build both backends
themselves and compare them directly (the differential tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from graphbuf.buffers import native

BACKENDS = ("native", "numpy")
SUITE = Path(__file__).resolve().parents[1] / "unit" / "buffers"  # the tests run on both


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends_compared: the module compares the native and numpy backends itself (run once)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    node = metafunc.definition
    if (
        "backend" in metafunc.fixturenames
        and SUITE in Path(node.path).resolve().parents
        and not node.get_closest_marker("backends_compared")
    ):
        metafunc.parametrize("backend", BACKENDS, indirect=True)


@pytest.fixture(autouse=True)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The backend buffers built in this test get: ``native`` or ``numpy`` (unparametrized: as built)."""
    param = getattr(request, "param", None)
    if param is None:
        yield "native" if native.KERNEL is not None else "numpy"
        return
    if param == "native" and native.KERNEL is None:
        pytest.skip("the native backend is not built here")
    saved = native.KERNEL
    if param == "numpy":
        native.KERNEL = None
    try:
        yield param
    finally:
        native.KERNEL = saved
