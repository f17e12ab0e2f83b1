"""Kept for imports written before the refresh package: :class:`BoundSources` lives in
:mod:`graphbuf.refresh.bound`."""

from graphbuf.refresh.bound import BoundSources

__all__ = ["BoundSources"]
