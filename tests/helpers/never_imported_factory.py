"""A module a spec names as a factory without registering or allowing it: it must never be imported."""

raise AssertionError("graphbuf imported an unregistered, unallowed task factory module")
