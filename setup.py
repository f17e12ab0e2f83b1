"""Build of the optional native refresh kernel; everything else is declared in pyproject.toml.

``graphbuf.buffers._native`` is optional: without a C compiler the install still succeeds and refresh
takes its numpy path (``graphbuf.buffers.native.KERNEL`` is None).
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "graphbuf.buffers._native",
            ["graphbuf/buffers/_native.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
