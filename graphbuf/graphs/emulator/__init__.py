"""A CPU emulator of a device graph.

The emulator records a function at the dispatcher level (below autograd, one entry per aten op) and replays
the recorded ops the way a CUDA or NPU graph replays kernels on fixed addresses:

- in-place updates to captured tensors between replays are seen by replay; rebinding a Python name is not;
- Python scalars and host lists used during capture are baked into the recording;
- tensors produced during capture that are still reachable when capture ends (returned, held by the caller,
  or sharing storage with such a tensor) are static: each replay rewrites them in place (same ``data_ptr``);
- every other tensor produced during capture is transient: the recording holds no reference to it, so it is
  freed as soon as the captured function drops it, and each replay produces it afresh and drops it after
  its last use (a device graph's private memory pool likewise holds intermediates only while they are live);
- replay runs no Python of the captured function: it is one generated function of pre-resolved op calls;
- like a device graph, capture does not change anything that existed before it: every tensor that existed
  before capture and was written during capture is restored when capture ends (tensors created during
  capture keep their capture-time values until the first replay rewrites them);
- like a device graph, a dry capture (``capture(dry=True)``) and a task update compute nothing: functional
  ops over more than 64 KiB get uninitialized results shaped by their meta kernels and writes are skipped;
  an op that fails on such values fails the capture (a task update is then recorded again, computing). What
  a device raises at capture is raised at capture: each op signature runs for real once (the checks a kernel
  makes beyond its meta kernel), and so do writes whose target overlaps and ops indexing by a tensor from
  before capture; an op that fails at replay on the values it reads raises :class:`~graphbuf.ReplayError`;
- a tensor made during capture and re-strided in place (``t_``, ``transpose_``, ``as_strided_``, a resize)
  is seen by each recorded op with the geometry it had when that op ran, as a device kernel bakes it in; a
  tensor from before capture re-strided after the capture used it is a :class:`~graphbuf.CaptureError`.

Tensors are told apart by a registry of slots keyed by ``id`` and checked against a weak reference (so a
reused ``id`` is never mistaken for a dead tensor); tensors that existed before capture (inputs) are held
weakly and checked before every replay (alive, same address, shape, stride and dtype:
:mod:`graphbuf.graphs.watch`); tensors that reach the recorder without being produced by a recorded op and
that nothing else holds (ATen's wrapped scalars) are held strongly, as constants. Whether a storage created
during capture is static is decided when capture ends: static if the storage is still alive.

Each op is resolved into the cheapest call that reproduces it: views of static tensors are skipped (the
static view already aliases its static base) and views of transient ones re-run; in-place and out= ops run as
recorded; functional ops with transient results run as recorded; functional ops with static results write
into them through a native out= overload, or ``copy_`` (+ an in-place twin), falling back to
``static.copy_(op(...))``. A shortcut is used only after it reproduced the recorded op on scratch tensors;
verdicts are cached per op and argument signature (dtypes, ranks, contiguity), and ops whose results are
large are checked only if they turn out static. Calls go through torch's generated bindings where those
provably dispatch to the recorded op with the recorded arguments. Composite ops that reach the recorder
whole (under ``inference_mode``) are recorded as what they decompose into.

Modules: :mod:`.ops` (op analysis), :mod:`.slots` (what a recording refers to), :mod:`.recording` (the
recorder), :mod:`.shortcuts` (validated out=/copy recipes), :mod:`.codegen` (the replay function),
:mod:`.replay` (:class:`Emulator`).

The recorder applies the capture guards of :mod:`graphbuf.graphs.guards` (host read-back, data-dependent
shapes) op by op.
"""

from graphbuf.graphs.emulator.replay import Emulator

__all__ = ["Emulator"]
