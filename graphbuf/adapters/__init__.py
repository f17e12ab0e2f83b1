"""Adapters that bind graphbuf to serving engines (installed sub-packages)."""
