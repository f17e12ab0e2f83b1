"""Restricted integer expressions for spec fields (``"cdiv(max_model_len, block_size)"``).

Grammar (no ``eval``; anything else is an :class:`ExprError`)::

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "//" | "%") unary)*
    unary  := "-" unary | atom
    atom   := INT | NAME | NAME "(" expr ("," expr)* ")" | "(" expr ")"

Functions: ``min``, ``max`` (two or more arguments) and ``cdiv(a, b)`` (ceiling division).
Integers only; ``//`` and ``%`` follow Python semantics; division by zero is an error.

Bounds (so a hostile spec can neither crash nor hang the parser): at most :data:`MAX_EXPR_CHARS` characters,
:data:`MAX_EXPR_DEPTH` levels of nesting (a chain of ``+`` counts one level per term), literals of at most
:data:`MAX_LITERAL_DIGITS` digits, and every value during evaluation within ``±MAX_VALUE`` (2**63 - 1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "MAX_EXPR_CHARS",
    "MAX_EXPR_DEPTH",
    "MAX_LITERAL_DIGITS",
    "MAX_VALUE",
    "Expr",
    "ExprError",
    "parse_expr",
]

#: Longest expression text.
MAX_EXPR_CHARS = 1000
#: Deepest expression tree.
MAX_EXPR_DEPTH = 64
#: Longest integer literal (int64 has 19 digits).
MAX_LITERAL_DIGITS = 19
#: Largest magnitude of any literal or intermediate value (int64).
MAX_VALUE = (1 << 63) - 1

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z_0-9]*)|(//|[-+*%(),])|(\S))")
_FUNCTIONS: dict[str, Callable[..., int]] = {
    "min": min,
    "max": max,
    "cdiv": lambda a, b: -(-a // b),
}


class ExprError(ValueError):
    """A malformed expression or an evaluation failure; the message says where and what is allowed."""


@dataclass(frozen=True)
class _Node:
    op: str  # "int", "name", "neg", a binary operator, or "call"
    value: int | str = 0
    args: tuple[_Node, ...] = ()
    depth: int = 1


def _clip(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        for m in _TOKEN.finditer(text):
            num, name, sym, bad = m.groups()
            pos = m.start(m.lastindex or 0)
            if bad is not None:
                raise ExprError(
                    f"unexpected character {bad!r} at position {pos} in {text!r}; allowed: integers, names, "
                    "+ - * // % ( ) , and min/max/cdiv"
                )
            if num is not None:
                if len(num) > MAX_LITERAL_DIGITS:
                    raise ExprError(
                        f"integer literal at position {pos} has {len(num)} digits; at most "
                        f"{MAX_LITERAL_DIGITS} (|value| <= 2**63 - 1)"
                    )
                if int(num) > MAX_VALUE:
                    raise ExprError(
                        f"integer literal {num} at position {pos} is beyond 2**63 - 1 (|value| <= 2**63 - 1)"
                    )
                self.tokens.append(("int", num, pos))
            elif name is not None:
                self.tokens.append(("name", name, pos))
            elif sym is not None:
                self.tokens.append(("sym", sym, pos))
        self.i = 0

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, sym: str | None = None) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            want = f"{sym!r}" if sym else "a value"
            raise ExprError(f"expression {self.text!r} ends early; expected {want}")
        if sym is not None and tok[1] != sym:
            raise ExprError(f"expected {sym!r} at position {tok[2]} in {self.text!r}, found {tok[1]!r}")
        self.i += 1
        return tok

    def parse(self) -> _Node:
        if not self.tokens:
            raise ExprError("empty expression")
        self.depth = 0
        node = self.expr()
        tok = self.peek()
        if tok is not None:
            raise ExprError(f"unexpected {tok[1]!r} at position {tok[2]} in {self.text!r}")
        return node

    def node(self, op: str, value: int | str = 0, args: tuple[_Node, ...] = ()) -> _Node:
        depth = 1 + max((a.depth for a in args), default=0)
        if depth > MAX_EXPR_DEPTH:
            raise ExprError(f"expression {_clip(self.text)} is nested deeper than {MAX_EXPR_DEPTH} levels")
        return _Node(op, value, args, depth)

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_EXPR_DEPTH:
            raise ExprError(f"expression {_clip(self.text)} is nested deeper than {MAX_EXPR_DEPTH} levels")

    def expr(self) -> _Node:
        self.enter()
        node = self.term()
        while (tok := self.peek()) is not None and tok[1] in ("+", "-"):
            self.i += 1
            node = self.node(tok[1], args=(node, self.term()))
        self.depth -= 1
        return node

    def term(self) -> _Node:
        node = self.unary()
        while (tok := self.peek()) is not None and tok[1] in ("*", "//", "%"):
            self.i += 1
            node = self.node(tok[1], args=(node, self.unary()))
        return node

    def unary(self) -> _Node:
        tok = self.peek()
        if tok is not None and tok[1] == "-":
            self.i += 1
            self.enter()
            node = self.node("neg", args=(self.unary(),))
            self.depth -= 1
            return node
        return self.atom()

    def atom(self) -> _Node:
        kind, text, pos = self.take()
        if kind == "int":
            return self.node("int", int(text))
        if kind == "name":
            nxt = self.peek()
            if nxt is not None and nxt[1] == "(":
                if text not in _FUNCTIONS:
                    raise ExprError(
                        f"unknown function {text!r} at position {pos} in {self.text!r}; "
                        f"allowed: {', '.join(sorted(_FUNCTIONS))}"
                    )
                self.take("(")
                args = [self.expr()]
                while (t := self.peek()) is not None and t[1] == ",":
                    self.i += 1
                    args.append(self.expr())
                self.take(")")
                want = 2 if text == "cdiv" else None
                if (want is not None and len(args) != want) or len(args) < 2:
                    raise ExprError(
                        f"{text}() at position {pos} in {self.text!r} takes "
                        f"{'exactly 2' if want else 'at least 2'} arguments, got {len(args)}"
                    )
                return self.node("call", text, tuple(args))
            return self.node("name", text)
        if text == "(":
            node = self.expr()
            self.take(")")
            return node
        raise ExprError(f"unexpected {text!r} at position {pos} in {self.text!r}")


def _evaluate(node: _Node, env: Mapping[str, int], text: str) -> int:
    op = node.op
    if op == "int":
        return node.value  # type: ignore[return-value]
    if op == "name":
        try:
            value = env[node.value]  # type: ignore[index]
        except KeyError:
            raise ExprError(
                f"unknown name {node.value!r} in {text!r}; known: {', '.join(sorted(env)) or '(none)'}"
            ) from None
        if value is None:
            raise ExprError(
                f"{node.value!r} in {_clip(text)} has no value; set it (e.g. --set {node.value}=N)"
            )
        if not -MAX_VALUE <= value <= MAX_VALUE:
            raise ExprError(f"{node.value!r} in {_clip(text)} is beyond ±(2**63 - 1)")
        return value
    args = [_evaluate(a, env, text) for a in node.args]
    if op == "neg":
        return -args[0]
    if op == "call":
        if node.value == "cdiv" and args[1] == 0:
            raise ExprError(f"division by zero in {_clip(text)}")
        return _FUNCTIONS[node.value](*args)  # type: ignore[index]
    a, b = args
    if op == "+":
        out = a + b
    elif op == "-":
        out = a - b
    elif op == "*":
        out = a * b
    elif b == 0:
        raise ExprError(f"division by zero in {_clip(text)}")
    else:
        out = a // b if op == "//" else a % b
    if not -MAX_VALUE <= out <= MAX_VALUE:
        raise ExprError(f"{_clip(text)} overflows: a value exceeds ±(2**63 - 1)")
    return out


def _names(node: _Node) -> frozenset[str]:
    if node.op == "name":
        return frozenset((node.value,))  # type: ignore[arg-type]
    out: frozenset[str] = frozenset()
    for a in node.args:
        out |= _names(a)
    return out


@dataclass(frozen=True)
class Expr:
    """A parsed expression: ``names`` are its free variables; ``eval(env)`` computes it."""

    text: str
    _root: _Node
    names: frozenset[str]

    def eval(self, env: Mapping[str, int | None]) -> int:
        """Evaluate with ``env`` mapping names to integers; a missing or unset name is an ExprError."""
        return _evaluate(self._root, env, self.text)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return self.text


def parse_expr(source: str | int) -> Expr:
    """Parse ``source`` (an int or expression text) into an :class:`Expr`; raise ExprError if malformed."""
    if isinstance(source, bool):
        raise ExprError(f"expected an integer or an expression, got {source!r}")
    if isinstance(source, int):
        if not -MAX_VALUE <= source <= MAX_VALUE:
            raise ExprError(f"integer of {source.bit_length()} bits is beyond ±(2**63 - 1)")
        return Expr(str(source), _Node("int", source), frozenset())
    if not isinstance(source, str):
        raise ExprError(f"expected an integer or an expression string, got {type(source).__name__}")
    if len(source) > MAX_EXPR_CHARS:
        raise ExprError(f"expression {_clip(source)} is longer than {MAX_EXPR_CHARS} characters")
    root = _Parser(source).parse()
    return Expr(source, root, _names(root))
