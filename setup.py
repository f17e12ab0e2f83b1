"""Build of the optional native refresh kernel; everything else is declared in pyproject.toml.

``graphbuf.refresh._native`` is optional: without a C compiler the install still succeeds and refresh
takes its numpy path (``graphbuf.refresh.native.KERNEL`` is None).
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "graphbuf.refresh._native",
            ["graphbuf/refresh/_native.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
