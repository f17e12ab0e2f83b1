"""Bindings of the large-head attention to graphbuf buffers and tasks. Imports nothing itself."""
