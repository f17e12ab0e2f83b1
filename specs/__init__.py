"""Shipped graphbuf specs (YAML), loadable by name: ``graphbuf.load_spec("gemma4-31b-it-mtp")``."""
