"""The emulator itself: capture → settle → plan → compile → replay (see :mod:`graphbuf.graphs.emulator`)."""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from graphbuf.errors import CaptureError, GraphbufError, LivenessError, ReplayError
from graphbuf.graphs.emulator.codegen import Call, Compiled, generate, op_at
from graphbuf.graphs.emulator.ops import bind, binding, call_parts
from graphbuf.graphs.emulator.recording import STATE, Recorder, Segment, recording_active
from graphbuf.graphs.emulator.shortcuts import MISSING, RECIPES, Recipe, find_recipe, recipe_calls
from graphbuf.graphs.emulator.slots import Group, Node, Slot, materialize, rebuild, slots_in
from graphbuf.graphs.guards import HostReadGuard, poison
from graphbuf.graphs.watch import Checked, Watch

__all__ = ["Emulator"]

# sys.getrefcount of a tensor referenced only by its slot: the slot's attribute and the call's argument.
_ONLY_THE_SLOT = 2

# --------------------------------------------------------------------------------------------------------
# Emulator
# --------------------------------------------------------------------------------------------------------


class Emulator:
    """A recording of aten ops that replays like a device graph (see the module docstring).

    Invariants: ``captured`` is true only after a capture ended without an exception; a failed capture or
    task update leaves no mode installed, restores every pre-existing tensor it wrote and keeps the previous
    state. The recording holds strongly only the static tensors, views of inputs made during capture, and
    constants made outside the dispatcher; the tensors that existed before capture are held weakly and
    checked before every replay (freed: LivenessError; moved: AddressChangedError); outputs hold poison
    until the first replay; transient intermediates live only during capture and during each replay.
    Replay runs under ``torch.inference_mode()`` (so tensors captured under inference mode, as vLLM does,
    can be rewritten; autograd never records replay).

    ``restore_inputs=False`` skips the snapshot/restore of pre-existing tensors written during capture
    (faster for very large written tensors, e.g. a KV cache; capture then applies its writes once).
    """

    def __init__(self, *, restore_inputs: bool = True) -> None:
        self._restore = restore_inputs
        self._segments: list[Segment] = []
        self.by_id: dict[int, Slot] = {}  # id(tensor) -> slot, checked against the slot's reference
        self.by_sid: dict[int, Group] = {}  # storage _cdata -> group, checked against its weak reference
        self.next_index = 0
        self._replay: Callable[..., None] | None = None
        self._watch = Watch()
        self._names: dict[str, weakref.ref[torch.Tensor]] = {}
        self._num_steps = 0
        self._source = ""
        self._compiled: Compiled | None = None  # per segment: source and function, reused when unchanged
        self._deferred: list[Segment] | None = None  # inside updating(): the groups replaced so far
        self._stale = False  # a group was replaced and the replay function not compiled since
        self._captured = False
        self._recorder: Recorder | None = None

    @property
    def captured(self) -> bool:
        """True once a capture has completed and until :meth:`reset`."""
        return self._captured

    @property
    def capturing(self) -> bool:
        """True while inside :meth:`capture`."""
        return self._recorder is not None

    @property
    def num_steps(self) -> int:
        """Number of op calls one replay makes."""
        return self._num_steps

    @property
    def stats(self) -> dict[str, int]:
        """Recorded ops by replay strategy: ``transient`` (functional op producing transient results),
        ``view`` (view of a transient tensor, re-run), ``out`` (out= overload into the static result),
        ``direct`` (copy_ / copy_ + in-place op into the static result), ``copy`` (the op, then a copy into
        its static results), ``as_recorded`` (in-place / out= op), ``skipped`` (views of static tensors,
        metadata-only and uninitialized ops)."""
        total: Counter[str] = Counter()
        for seg in self._segments:
            total.update(seg.kinds)
        return dict(total)

    @property
    def slots(self) -> dict[str, int]:
        """Tensors the recorded ops refer to: ``static`` (created during capture and still reachable when it
        ended: held, rewritten in place by replay), ``transient`` (created during capture and dropped by
        then: not held, re-created by each replay and freed after their last use), ``external`` (existed
        before capture, or came from outside the dispatcher: held); ``static_bytes`` / ``transient_bytes``:
        the sizes of their distinct storages. Only ``static_bytes`` stays allocated between replays."""
        counts: Counter[str] = Counter()
        groups: dict[int, Group] = {}
        seen: set[int] = set()
        for seg in self._segments:
            for node in seg.nodes:
                for slot in slots_in(node.args) + slots_in(node.kwargs) + slots_in(node.results):
                    if slot.index in seen:
                        continue
                    seen.add(slot.index)
                    group = slot.group
                    if not group.created:
                        counts["external"] += 1
                        continue
                    counts["static" if group.static else "transient"] += 1
                    groups[id(group)] = group
        static_bytes = transient_bytes = 0
        for group in groups.values():
            storage = group.storage() if group.static else None
            if storage is not None:
                static_bytes += storage.nbytes()
            else:
                transient_bytes += group.nbytes
        return {
            "static": counts["static"],
            "transient": counts["transient"],
            "external": counts["external"],
            "static_bytes": static_bytes,
            "transient_bytes": transient_bytes,
        }

    def reset(self) -> None:
        """Drop the recording; the emulator can capture again."""
        if self.capturing:
            raise CaptureError("Emulator.reset() inside capture(); leave the capture block first")
        self._clear()

    def _clear(self) -> None:
        self._segments = []
        self.by_id = {}
        self.by_sid = {}
        self._replay = None
        self._num_steps = 0
        self._source = ""
        self._compiled = None
        self._stale = False
        self._captured = False
        self._watch = Watch()
        self._names = {}

    @contextmanager
    def capture(self, *, dry: bool = False) -> Iterator[None]:
        """Record every aten op run in the body, under the capture guards (strict about ``.cpu()``).
        ``dry``: without computing (see :class:`Recorder`; not without ``restore_inputs``, whose capture
        applies its writes)."""
        if self.capturing:
            raise CaptureError("capture() is already active on this emulator")
        if self._captured:
            raise CaptureError("this emulator already holds a capture; call reset() before capturing again")
        if recording_active():
            raise CaptureError("nested capture: another graph is capturing on this thread")
        self._clear()
        recorder = Recorder(self, Segment(None), self._restore, dry=dry and self._restore)
        self._segments = [recorder.segment]
        self._recorder = recorder
        STATE.recording = True
        ok = False
        try:
            with HostReadGuard(strict_cpu=True), recorder:
                yield
            ok = True
        finally:
            STATE.recording = False
            self._recorder = None
            recorder.restore()
            if ok:
                try:
                    self._settle(recorder, self._segments)
                    self._compile()
                except BaseException:
                    self._clear()
                    raise
                # Like a device graph's outputs (no kernel runs at capture): poison until the first replay.
                poison(s.tensor for s in recorder.slots if s.group.created and s.tensor is not None)
                self._captured = True
            else:
                self._clear()

    def begin_group(self, label: str) -> int:
        """Start a task group inside capture; returns its id (for end_group / rerecord_group)."""
        recorder = self._recorder
        if recorder is None:
            raise CaptureError("begin_group() outside capture()")
        if recorder.segment.group is not None:
            raise CaptureError(
                f"task {label!r} started inside task {recorder.segment.label!r}; task groups do not nest"
            )
        seg = Segment(len(self._segments), label)
        self._segments.append(seg)
        recorder.segment = seg
        return seg.group  # type: ignore[return-value]

    def end_group(self, group: int) -> None:
        """End the task group ``group``; ops after it are recorded into the main recording again."""
        recorder = self._recorder
        if recorder is None or recorder.segment.group != group:
            raise CaptureError(f"end_group({group}) does not match the open task group")
        after = Segment(None)
        self._segments.append(after)
        recorder.segment = after

    def rerecord_group(self, group: int, run: Callable[[], object]) -> None:
        """Replace task group ``group`` with the ops ``run()`` issues now (fresh host arguments).

        Runs after capture, under the same guards. On error the previous group is kept. Every tensor that
        existed before is restored afterwards, so the update takes effect at the next replay.
        """
        if self.capturing:
            raise CaptureError("a task can be re-issued only after capture() has ended")
        if not self._captured:
            raise CaptureError("no capture to update: the graph was reset or never captured")
        if recording_active():
            raise CaptureError("cannot re-issue a task while another graph is capturing on this thread")
        old = self._segments[group]
        if old.group != group:
            raise CaptureError(f"{group} is not a task group of this capture")
        # Recorded dry (nothing computed, as a device records a task update); an op that fails on the
        # uninitialized values that leaves sends the whole update back to a recording that computes. Not
        # without restore_inputs: there the update's writes to earlier tensors are kept, so they must run.
        for dry in (True, False) if self._restore else (False,):
            seg = Segment(group, old.label)
            recorder = Recorder(self, seg, self._restore, dry=dry)
            STATE.recording = True
            ok = False
            try:
                with HostReadGuard(strict_cpu=True), recorder:
                    run()
                ok = True
            except Exception:
                if not dry:
                    raise
            finally:
                STATE.recording = False
                recorder.restore()
                if not ok:
                    recorder.discard()
            if ok:
                break
        try:
            self._settle(recorder, [seg])
            self._segments[group] = seg
            if self._deferred is None:
                self._compile()
        except BaseException:
            self._segments[group] = old
            recorder.discard()
            if self._deferred is None:
                self._compile()
            raise
        if self._deferred is not None:
            self._deferred.append(old)
            self._stale = True
            return
        self.forget(old.slots, old.groups)

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Re-issue several task groups (:meth:`rerecord_group`) with one compilation, on leaving. A
        compilation that fails then (a tensor the recording reads was freed) is tried again, and raises
        again, at the next replay."""
        if self._deferred is not None:  # nested: the outer one compiles
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            replaced, self._deferred = self._deferred, None
            try:
                if self._stale:
                    self._compile()
            finally:
                for old in replaced:
                    self.forget(old.slots, old.groups)

    def task_label(self, group: int) -> str:
        """The label of task group ``group``."""
        return self._segments[group].label

    def forget(self, slots: Iterable[Slot], groups: Iterable[Group]) -> None:
        """Drop registry entries that still point at ``slots`` / ``groups``."""
        for slot in slots:
            if self.by_id.get(slot.key) is slot:
                del self.by_id[slot.key]
        for group in groups:
            if self.by_sid.get(group.sid) is group:
                del self.by_sid[group.sid]

    def _settle(self, recorder: Recorder, segments: Sequence[Segment]) -> None:
        """End a recording session: decide which created storages are static (still alive), hold their
        tensors (rebuilding dead views of them from the storage), forget the transient ones, and plan how
        replay runs each node of ``segments``."""
        alive = []
        for group in recorder.groups:
            if group.created:
                storage = group.storage()
                group.static = storage is not None
                if storage is not None:
                    alive.append(storage)  # held while its slots are settled
        for slot in recorder.slots:
            # An "input" that nothing outside the recording holds was made during capture outside the
            # dispatcher (a wrapped scalar): a constant of the recording, held like a static tensor.
            if slot.input and sys.getrefcount(slot.tensor) <= _ONLY_THE_SLOT:
                slot.input = False
        with torch.inference_mode():
            for slot in recorder.slots:
                if slot.tensor is None and slot.group.static:
                    t = slot.ref() if slot.ref is not None else None
                    slot.tensor = t if t is not None else rebuild(slot.meta, slot.group.storage())  # type: ignore[arg-type]
                slot.ref = None
            self.forget(
                [s for s in recorder.slots if s.tensor is None], [g for g in recorder.groups if not g.static]
            )
            for seg in segments:
                seg.kinds.clear()
                for node in seg.nodes:
                    seg.kinds[self._plan(node)] += 1
        del alive

    def _plan(self, node: Node) -> str:
        """Set ``node.calls`` (how replay runs it) and return the strategy's name (see :attr:`stats`)."""
        info = node.info
        results = slots_in(node.results)
        local = any(s.transient for s in results)
        static_new = frozenset(s.index for s in results if s.index in node.new and s.tensor is not None)
        if info.inplace_view or (info.uninitialized and not local):
            node.calls = ()
            return "skipped"
        if static_new:
            if node.all_new and not info.writes and len(static_new) == len(results):
                recipe = self._recipe(node)
                calls = recipe_calls(recipe, node.bound(), node.results) if recipe is not None else None
                if calls is not None:
                    node.calls = tuple(Call(fn, pos, kw, op=str(node.func)) for fn, pos, kw in calls)
                    return recipe.kind  # type: ignore[union-attr]
            node.calls = (self._as_recorded(node, static_new),)
            return "copy"
        if local:
            node.calls = (self._as_recorded(node),)
            if any(s.index in node.new for s in results):
                return "transient"
            return "as_recorded" if info.writes or not info.returns_alias else "view"
        if info.writes or not info.returns_alias:
            node.calls = (self._as_recorded(node),)
            return "as_recorded"
        node.calls = ()
        return "skipped"

    def _as_recorded(self, node: Node, copies: frozenset[int] = frozenset()) -> Call:
        """The node's own call (its generated binding where proven equivalent, else ``OpOverload._op``)."""
        func = node.func
        if node.binding:
            parts = call_parts(func._schema, node.bound(), binding=True)
            if parts is not None:
                fn = binding(func.overloadpacket.__name__)
                return Call(fn, parts[0], parts[1], node.results, node.single, copies, str(func))  # type: ignore[arg-type]
        return Call(func._op, node.args, node.kwargs, node.results, node.single, copies, str(func))

    def _recipe(self, node: Node) -> Recipe | None:
        """A validated recipe for a functional node whose results are all static: the cached verdict for
        its signature, else one checked now on its inputs if they are all held, else None (copy)."""
        key = node.recipe_key()
        recipe = RECIPES.get(key, MISSING)
        if recipe is not MISSING:
            return recipe  # type: ignore[return-value]
        if any(s.transient for s in slots_in(node.args) + slots_in(node.kwargs)):
            return None
        args = [materialize(a) for a in node.args]
        kwargs = {k: materialize(v) for k, v in node.kwargs.items()}
        results = [materialize(r) for r in node.results]
        reference = None
        if not node.info.seeded:
            try:
                ref = node.func._op(*args, **kwargs)
            except Exception:
                return None
            reference = (ref,) if node.single else tuple(ref)
        recipe = RECIPES[key] = find_recipe(
            node.func, node.info, bind(node.info, args, kwargs), results, reference
        )
        return recipe

    def _compile(self) -> None:
        segments = [[call for node in seg.nodes for call in node.calls] for seg in self._segments]
        calls = [call for seg in segments for call in seg]
        inputs: dict[int, Slot] = {}
        for call in calls:
            for slot in call.arg_slots + call.result_slots:
                if slot.input:
                    inputs.setdefault(slot.index, slot)
        ordered = [inputs[i] for i in sorted(inputs)]
        entries = []
        for k, slot in enumerate(ordered):
            t = slot.held()
            if t is None:
                raise LivenessError(
                    f"capture input #{k} (shape {list(slot.meta[0])}) was freed before the recording was "
                    "compiled"
                )
            entries.append((f"capture input #{k} ({str(t.dtype).removeprefix('torch.')} {list(t.shape)})", t))
        names = {label: t for label, ref in self._names.items() if (t := ref()) is not None}
        watch = Watch(entries).named(names) if names else Watch(entries)
        self._replay, self._source, self._compiled = generate(segments, ordered, self._compiled)
        self._stale = False
        self._watch = watch
        self._num_steps = len(calls)
        for slot in ordered:
            slot.release()

    @property
    def watch(self) -> Watch:
        """The tensors from before capture that the recording reads or writes (held weakly), in the order
        replay passes them; each is checked before every replay."""
        return self._watch

    def name_inputs(self, names: Mapping[str, torch.Tensor]) -> None:
        """After capture: call these tensors by their keys in errors (and watch any the recording does not
        use)."""
        self._names.update((label, weakref.ref(t)) for label, t in names.items())
        self._watch = self._watch.named(names)

    def replay(self, checked: Checked | None = None) -> None:
        """Run the recorded ops once, in order; static tensors are rewritten in place.

        ``checked``: what ``watch.check()`` returned just before, if nothing since could have moved a
        tensor (it is used only if the watch is still the one that checked it; else the check runs here).

        Raises :class:`~graphbuf.errors.LivenessError` if a tensor the capture used was freed and
        :class:`~graphbuf.errors.AddressChangedError` if one was rebound, resized or restrided (a device
        graph would read its old memory)."""
        if not self._captured or self._replay is None:
            raise CaptureError("replay() before a completed capture")
        if self._stale:
            self._compile()
        live = checked
        if live is None or live.watch is not self._watch:
            live = self._watch.check("replay")
        try:
            if torch.is_inference_mode_enabled():
                self._replay(*live)
                return
            with torch.inference_mode():
                self._replay(*live)
        except GraphbufError:
            raise
        except Exception as exc:
            op = op_at(exc.__traceback__) or "an op"
            raise ReplayError(
                f"replay: {op} failed: {type(exc).__name__}: {exc}. The emulator runs each recorded op as a "
                "device runs its kernel; this one failed on the values it read (a device would fault or "
                "assert here): check the values the graph reads (bound them in the spec: min/max)."
            ) from exc
