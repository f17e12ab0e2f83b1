"""Code generation: the recorded calls compiled into one replay function (transients are its locals)."""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from graphbuf.graphs.emulator.shortcuts import TENSOR_COPY
from graphbuf.graphs.emulator.slots import Seq, Slot, materialize, slots_in

# --------------------------------------------------------------------------------------------------------
# Code generation: the replay function
# --------------------------------------------------------------------------------------------------------


class Call:
    """One call of the generated replay function: ``fn(*pos, **kw)`` over slots and constants. Its returns
    (``results``, shaped like the node's) bind transient slots; slots in ``copies`` are static results the
    returned tensors are copied into."""

    __slots__ = (
        "arg_slots", "consts", "copies", "fn", "kw", "op", "pos", "result_slots", "results", "single", "text",
    )  # fmt: skip

    def __init__(
        self,
        fn: Callable[..., Any],
        pos: Sequence[Any],
        kw: Mapping[str, Any],
        results: tuple[Any, ...] | None = None,
        single: bool = True,
        copies: frozenset[int] = frozenset(),
        op: str = "",
    ) -> None:
        self.fn = fn
        self.op = op or getattr(fn, "__name__", type(fn).__name__)  # named in a replay's errors
        self.pos = list(pos)
        self.kw = dict(kw)
        self.results = results
        self.single = single
        self.copies = copies
        # Found once: a recording is compiled again after every task update, mostly of unchanged calls.
        self.arg_slots = slots_in(self.pos) + slots_in(self.kw)
        self.result_slots = slots_in(results)
        self.text = ""  # the call expression, once rendered (see render)
        self.consts: dict[str, Any] = {}

    def render(self) -> tuple[str, dict[str, Any]]:
        """``fn(args)`` as source text and the constants it names. Rendered once: a constant is named
        ``k<id>`` of the object, which this call holds, so the name stays unique while the call lives."""
        if not self.text:
            consts = self.consts

            def const(obj: Any) -> str:
                name = f"k{id(obj)}"
                consts[name] = obj
                return name

            parts = [_expr(a, const) for a in self.pos]
            odd = {}
            for name, value in self.kw.items():
                if name.isidentifier() and not keyword.iskeyword(name):
                    parts.append(f"{name}={_expr(value, const)}")
                else:
                    odd[name] = value
            if odd:
                parts.append("**{" + ", ".join(f"{n!r}: {_expr(v, const)}" for n, v in odd.items()) + "}")
            self.text = f"{const(self.fn)}({', '.join(parts)})"
        return self.text, self.consts

    def reads(self) -> list[int]:
        """Indices of the transient slots this call reads."""
        return [s.index for s in self.arg_slots if s.transient]

    def returns(self) -> list[tuple[str, Slot]]:
        """(subscript into the call's return value, slot) for every slot it returns."""
        found: list[tuple[str, Slot]] = []
        for i, value in enumerate(self.results or ()):
            base = "" if self.single else f"[{i}]"
            if isinstance(value, Slot):
                found.append((base, value))
            elif isinstance(value, list):
                found.extend((f"{base}[{j}]", s) for j, s in enumerate(value) if s is not None)
        return found


def _expr(value: Any, const: Callable[[Any], str]) -> str:
    """Source text of one argument: input slots are parameters, transient slots locals, everything else
    (static tensors, callables, host values) a constant named by ``const``."""
    if isinstance(value, Slot):
        if value.input:
            return f"a{value.index}"
        return f"v{value.index}" if value.transient else const(value.tensor)
    if isinstance(value, (Seq, list, tuple)):
        items = value.items if isinstance(value, Seq) else value
        is_tuple = value.is_tuple if isinstance(value, Seq) else isinstance(value, tuple)
        if not any(isinstance(v, (Slot, Seq)) for v in items):
            return const(value)
        if all(s.tensor is not None and not s.input for s in slots_in(value)):
            return const(materialize(value))
        inner = ", ".join(_expr(v, const) for v in items)
        return f"({inner},)" if is_tuple else f"[{inner}]"
    if value is None or type(value) in (bool, int):
        return repr(value)
    return const(value)


#: What :func:`generate` keeps of one compilation for the next: per segment, its source and its function.
Compiled = list[tuple[str, Callable[..., None]]]


def generate(
    segments: Sequence[Sequence[Call]], inputs: Sequence[Slot], previous: Compiled | None = None
) -> tuple[Callable[..., None], str, Compiled]:
    """Compile ``segments`` (runs of calls, in order) into one replay function. ``inputs`` (input slots) are
    its parameters, in order (extra arguments are ignored); transient slots are locals of the segment that
    makes them, deleted after their last use, and pass to later segments through one dict; static slots,
    callables and host values are globals of each segment's namespace. Each segment is compiled on its
    own, and one whose source equals its source in ``previous`` keeps its compiled function: re-issuing a
    task recompiles only what changed. Returns the replay function, its source and what to pass as
    ``previous`` next time."""
    flat = [call for seg in segments for call in seg]
    reads = [call.reads() for call in flat]
    last: dict[int, int] = {}
    for i, used in enumerate(reads):
        for index in used:
            last[index] = i
    compiled: Compiled = []
    defined: dict[int, int] = {}  # transient slot -> segment that binds it
    at = 0
    for number, seg in enumerate(segments):
        text, namespace = _segment(seg, at, number, reads, last, defined)
        if previous is not None and number < len(previous) and previous[number][0] == text:
            compiled.append(previous[number])
        else:
            exec(compile(text, f"<graphbuf replay, segment {number}>", "exec"), namespace)
            compiled.append((text, namespace["_segment"]))
        at += len(seg)
    indices = tuple(slot.index for slot in inputs)
    functions = tuple(fn for _, fn in compiled)

    def _replay(*live: Any) -> None:
        named = dict(zip(indices, live))
        passed: dict[int, Any] = {}
        for fn in functions:
            fn(passed, named)

    return _replay, "\n".join(text for text, _ in compiled), compiled


def _segment(
    calls: Sequence[Call],
    at: int,
    number: int,
    reads: Sequence[list[int]],
    last: Mapping[int, int],
    defined: dict[int, int],
) -> tuple[str, dict[str, Any]]:
    """Source and namespace of one segment: calls ``at .. at + len(calls) - 1`` of the recording.
    ``defined`` (transient slot -> the segment binding it) is updated with the slots this one binds. The
    namespace's ``OPS`` maps each source line to the op it calls (see :func:`op_at`)."""
    namespace: dict[str, Any] = {"__builtins__": {}}

    def const(obj: Any) -> str:
        name = f"k{id(obj)}"
        namespace[name] = obj
        return name

    stop = at + len(calls)
    copy = const(TENSOR_COPY)
    head: list[str] = []
    local: set[int] = set()
    params: set[int] = set()
    lines: list[str] = []
    ops: list[tuple[int, str]] = []  # (index in lines, op) of each call's lines
    for i, call in enumerate(calls, start=at):
        for index in reads[i]:
            if index in local:
                continue
            if index not in defined:
                raise RuntimeError(
                    f"graphbuf emulator: replay would read transient slots {[index]} before they exist"
                )
            # Bound by an earlier segment: taken from the dict (removed there at its last use).
            head.append(f"v{index} = _t.pop({index})" if last[index] < stop else f"v{index} = _t[{index}]")
            local.add(index)
        for slot in call.arg_slots:
            if slot.input and slot.index not in params:
                params.add(slot.index)
                head.append(f"a{slot.index} = _a[{slot.index}]")
        text, consts = call.render()
        namespace.update(consts)
        first = len(lines)
        binds: list[tuple[str, str]] = []
        copies: list[tuple[str, str]] = []
        for sub, slot in call.returns():
            if slot.transient:
                if last.get(slot.index, -1) > i:
                    binds.append((sub, f"v{slot.index}"))
                    local.add(slot.index)
                    defined[slot.index] = number
            elif slot.index in call.copies:
                copies.append((sub, const(slot.tensor)))
        if not binds and not copies:
            lines.append(text)
        elif len(binds) + len(copies) == 1 and (binds or copies)[0][0] == "":
            lines.append(f"{binds[0][1]} = {text}" if binds else f"{copy}({copies[0][1]}, {text})")
        else:
            lines.append(f"_r = {text}")
            lines.extend(f"{name} = _r{sub}" for sub, name in binds)
            lines.extend(f"{copy}({name}, _r{sub})" for sub, name in copies)
            lines.append("del _r")
        ops.extend((j, call.op) for j in range(first, len(lines)))
        dead = sorted({index for index in reads[i] if last[index] == i})
        if dead:
            lines.append("del " + ", ".join(f"v{index}" for index in dead))
    # Bound here, read by a later segment: handed on through the dict.
    tail = [
        f"_t[{index}] = v{index}"
        for index in sorted(local)
        if defined.get(index) == number and last[index] >= stop
    ]
    body = "\n".join(f"    {line}" for line in head + lines + tail) or "    pass"
    namespace[OPS] = {2 + len(head) + j: op for j, op in ops}  # line 1 is the def
    return f"def _segment(_t, _a):\n{body}\n", namespace


#: The name of each segment's line -> op map in its namespace.
OPS = "_graphbuf_ops"


def op_at(tb: TracebackType | None) -> str | None:
    """The op the innermost replay segment in traceback ``tb`` was calling, or None."""
    found = None
    while tb is not None:
        ops = tb.tb_frame.f_globals.get(OPS)
        if ops is not None and tb.tb_frame.f_code.co_filename.startswith("<graphbuf replay"):
            found = ops.get(tb.tb_lineno, found)
        tb = tb.tb_next
    return found
