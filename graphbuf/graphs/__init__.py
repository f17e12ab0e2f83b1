"""Graph capture and replay: :mod:`~graphbuf.graphs.graph` (``Graph``), :mod:`~graphbuf.graphs.guards` (what
no device graph can record), :mod:`~graphbuf.graphs.tasks` (tasks re-issued with host arguments),
:mod:`~graphbuf.graphs.watch` (tensors a capture uses that can move or die),
:mod:`~graphbuf.graphs.emulator` (the cpu device-graph emulator) and :mod:`~graphbuf.graphs.runner`
(``GraphRunner``). Import public names from ``graphbuf``.
"""
