"""Code generation: the recorded calls compiled into one replay function (transients are its locals)."""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping, Sequence
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
        "arg_slots", "consts", "copies", "fn", "kw", "pos", "result_slots", "results", "single", "text",
    )  # fmt: skip

    def __init__(
        self,
        fn: Callable[..., Any],
        pos: Sequence[Any],
        kw: Mapping[str, Any],
        results: tuple[Any, ...] | None = None,
        single: bool = True,
        copies: frozenset[int] = frozenset(),
    ) -> None:
        self.fn = fn
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


def generate(calls: Sequence[Call], inputs: Sequence[Slot]) -> tuple[Callable[..., None], str]:
    """Compile ``calls`` into one function. ``inputs`` (input slots) are its parameters, in order (extra
    arguments are ignored); transient slots are its locals, deleted after their last use; static slots,
    callables and host values are globals of its namespace."""
    namespace: dict[str, Any] = {"__builtins__": {}}

    def const(obj: Any) -> str:
        name = f"k{id(obj)}"
        namespace[name] = obj
        return name

    reads = [call.reads() for call in calls]
    last: dict[int, int] = {}
    for i, used in enumerate(reads):
        for index in used:
            last[index] = i
    copy = const(TENSOR_COPY)
    defined: set[int] = set()
    lines: list[str] = []
    for i, call in enumerate(calls):
        missing = [index for index in reads[i] if index not in defined]
        if missing:
            raise RuntimeError(
                f"graphbuf emulator: replay would read transient slots {missing} before they exist"
            )
        text, consts = call.render()
        namespace.update(consts)
        binds: list[tuple[str, str]] = []
        copies: list[tuple[str, str]] = []
        for sub, slot in call.returns():
            if slot.transient:
                if last.get(slot.index, -1) > i:
                    binds.append((sub, f"v{slot.index}"))
                    defined.add(slot.index)
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
        dead = sorted({index for index in reads[i] if last[index] == i})
        if dead:
            lines.append("del " + ", ".join(f"v{index}" for index in dead))
    body = "\n".join(f"    {line}" for line in lines) or "    pass"
    params = "".join(f"a{slot.index}, " for slot in inputs)
    source = f"def _replay({params}*_):\n{body}\n"
    exec(compile(source, "<graphbuf replay>", "exec"), namespace)
    return namespace["_replay"], source
