"""Constant resolution time against the number of constants (issue 21 §2: linear, in any order).

Times ``GraphSpec.constants_with`` on chains ``c0 = 1, c{i} = c{i-1} + 1`` of 2,500 … 20,000 constants,
declared in dependency order and in reverse, and prints seconds and seconds per 1,000 constants (flat when
linear). Nothing here asserts a timing. Usage: ``python bench/bench_constants.py [--sizes N ...]``.
"""

from __future__ import annotations

import argparse
import time

from graphbuf.spec.models import GraphSpec

__all__ = ["main"]


def _spec(n: int, reverse: bool) -> GraphSpec:
    items = [("c0", 1), *((f"c{i}", f"c{i - 1} + 1") for i in range(1, n))]
    return GraphSpec.model_validate(
        {
            "version": 1,
            "name": "chain",
            "constants": dict(reversed(items) if reverse else items),
            "capture": {"sizes": [1]},
            "buffers": {"a": {"dtype": "int32", "rows": "tokens"}},
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2500, 5000, 10000, 20000])
    args = parser.parse_args()
    print(f"{'constants':>10} {'order':>10} {'seconds':>9} {'s/1000':>8}")
    for n in args.sizes:
        for reverse in (False, True):
            spec = _spec(n, reverse)
            start = time.perf_counter()
            spec.constants_with()
            took = time.perf_counter() - start
            print(f"{n:>10} {'reverse' if reverse else 'forward':>10} {took:>9.3f} {took / n * 1000:>8.4f}")


if __name__ == "__main__":
    main()
