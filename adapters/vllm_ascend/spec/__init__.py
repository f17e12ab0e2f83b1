"""Spec metadata of the adapter's tasks: their options, costs and batch strategies (pydantic and
arithmetic only). Imports nothing itself."""
