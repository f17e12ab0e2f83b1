"""Build of the optional native backend; everything else is declared in pyproject.toml.

``graphbuf.buffers._native`` (the refresh kernel, ``_native.c``, and staged writes, ``_staged.c``: one
extension) is optional: without a C compiler the install still succeeds and refresh and staged writes take
their Python/numpy paths (``graphbuf.buffers.native.KERNEL`` and ``STAGED`` are None).
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "graphbuf.buffers._native",
            ["graphbuf/buffers/_native.c", "graphbuf/buffers/_staged.c"],
            depends=["graphbuf/buffers/_kinds.h"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
    ]
)
