"""A partial evaluator for Triton kernel source: fix some constexpr switches, keep the code they pick.

Stage C's ``tl`` kernel carries every optimization behind a constexpr (``if USE_TMA: ... else:
...``). A learner who wants to read *one* step should not have to run that branching in their
head. :func:`resolve_functions` takes the kernel's source and the values one step gives its
switches, and writes the source that step compiles:

* an ``if`` whose test the switches decide keeps only the branch taken (``elif`` chains included);
  a test they only simplify is rewritten (``if CAUSAL and CAUSAL_SKIP:`` with ``CAUSAL_SKIP=True``
  becomes ``if CAUSAL:``);
* assignments nothing reads any more are dropped (the pointer arithmetic of a path not taken);
* parameters nothing reads any more are dropped, and so are the arguments a caller passed for them
  (a helper's ``USE_TMA`` and the kernel's ``q_desc`` are gone once TMA is decided).

It edits the text at the positions Python's ``ast`` gives, instead of printing the tree with
``ast.unparse``, because the kernel's comments are half of the lesson and ``ast`` drops comments. The
output is parsed again after every pass, so each pass sees valid code.
"""

from __future__ import annotations

import ast
import re

#: calls with a side effect: an assignment whose value makes one is kept even when nothing reads it
_EFFECTS = re.compile(r"\b(store|atomic_\w+|device_print|static_print|device_assert|static_assert|debug_barrier)\b")
WIDTH = 120  # the repository's line length, for call arguments that are wrapped again


def function_sources(module_source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The source of each top-level function ``names`` of a module: its decorators and the ``#``
    comment block right above them included, dedented to column 0."""
    lines = module_source.splitlines()
    tree = ast.parse(module_source)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            while start > 1 and lines[start - 2].lstrip().startswith("#"):
                start -= 1
            out[node.name] = "\n".join(lines[start - 1:node.end_lineno]) + "\n"
    missing = [n for n in names if n not in out]
    if missing:
        raise LookupError(f"no top-level function {', '.join(missing)} in the module")
    return out


# --------------------------------------------------------------------------------------------------
# Expressions: substitute the fixed switches, fold what becomes constant.
# --------------------------------------------------------------------------------------------------

def partial_eval(node: ast.expr, env: dict[str, bool]) -> ast.expr:
    """``node`` with the names of ``env`` replaced by their values and ``and``/``or``/``not`` folded;
    an ``ast.Constant`` when the switches decide it."""
    if isinstance(node, ast.Name) and node.id in env:
        return ast.Constant(env[node.id])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = partial_eval(node.operand, env)
        return ast.Constant(not inner.value) if isinstance(inner, ast.Constant) else ast.UnaryOp(ast.Not(), inner)
    if isinstance(node, ast.BoolOp):
        absorbing = isinstance(node.op, ast.Or)  # True absorbs an `or`, False an `and`
        kept = []
        for value in (partial_eval(v, env) for v in node.values):
            if isinstance(value, ast.Constant):
                if bool(value.value) == absorbing:
                    return ast.Constant(absorbing)
                continue  # the neutral element
            kept.append(value)
        if not kept:
            return ast.Constant(not absorbing)
        return kept[0] if len(kept) == 1 else ast.BoolOp(node.op, kept)
    if _names(node) & env.keys():
        # Anything else that reads a switch (a comparison, a call): substitute, and fold it when it
        # is then made of constants only.
        substituted = _Substitute(env).visit(ast.parse(ast.unparse(node), mode="eval").body)
        if not _names(substituted):
            try:
                return ast.Constant(eval(compile(ast.Expression(substituted), "<switch>", "eval"), {}))
            except Exception:  # noqa: BLE001  (a call, an attribute: leave it to the compiler)
                pass
        return substituted
    return node


class _Substitute(ast.NodeTransformer):
    def __init__(self, env):
        self.env = env

    def visit_Name(self, node):
        return ast.copy_location(ast.Constant(self.env[node.id]), node) if node.id in self.env else node


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


# --------------------------------------------------------------------------------------------------
# Statements: keep the branch a decided `if` takes, at the indentation of the `if`.
# --------------------------------------------------------------------------------------------------

def _dedent(lines: list[str], columns: int) -> list[str]:
    out = []
    for line in lines:
        if line.strip() and not line[:columns].isspace() and columns:
            raise ValueError(f"cannot dedent {line!r} by {columns}")
        out.append(line[columns:] if line.strip() else "")
    return out


class _Branches:
    """One pass over a function's text: every ``if`` the switches decide is replaced by its branch."""

    def __init__(self, source: str, env: dict[str, bool]):
        self.lines = source.splitlines()
        self.env = env
        self.tree = ast.parse(source)

    def run(self) -> str:
        return "\n".join(self.block(self.tree.body, 1, len(self.lines))) + "\n"

    def block(self, stmts: list[ast.stmt], start: int, end: int) -> list[str]:
        """Lines ``start``..``end`` (1-based, inclusive), the statements among them rewritten and the
        lines between them (comments, blank lines) kept as they are."""
        out, cur = [], start
        for s in stmts:
            first = min([s.lineno] + [d.lineno for d in getattr(s, "decorator_list", [])])
            out += self.lines[cur - 1:first - 1]
            out += self.stmt(s)
            cur = s.end_lineno + 1
        out += self.lines[cur - 1:end]
        return out

    def _header_end(self, s: ast.stmt) -> int:
        """The last line of a compound statement's header: the first line, from the end of its
        header expressions on, whose code ends with the colon (comments after it are body)."""
        if isinstance(s, (ast.If, ast.While)):
            last = s.test.end_lineno
        elif isinstance(s, ast.For):
            last = max(s.target.end_lineno, s.iter.end_lineno)
        elif isinstance(s, ast.With):
            last = max(i.context_expr.end_lineno for i in s.items)
        else:  # a def: its parameters and return annotation
            last = max([s.lineno] + [a.end_lineno for a in s.args.args] + ([s.returns.end_lineno] if s.returns else []))
        for n in range(last, s.body[0].lineno):
            if self.lines[n - 1].split("#", 1)[0].rstrip().endswith(":"):
                return n
        raise ValueError(f"no end of the header of the statement at line {s.lineno}")

    def _else_line(self, s: ast.If) -> int:
        """The line of the ``else:`` of an ``if`` with a plain ``else`` block."""
        for n in range(s.orelse[0].lineno - 1, s.body[-1].end_lineno, -1):
            text = self.lines[n - 1]
            if text.strip().startswith("else") and len(text) - len(text.lstrip()) == s.col_offset:
                return n
        raise ValueError(f"no else: line for the if at line {s.lineno}")

    def _is_elif(self, s: ast.If) -> bool:
        return (len(s.orelse) == 1 and isinstance(s.orelse[0], ast.If)
                and self.lines[s.orelse[0].lineno - 1].lstrip().startswith("elif"))

    def stmt(self, s: ast.stmt, keyword: str | None = None) -> list[str]:
        if isinstance(s, ast.If):
            return self.if_stmt(s, keyword)
        if isinstance(s, (ast.For, ast.While, ast.With, ast.FunctionDef)) and not getattr(s, "orelse", None):
            # header as it is (decorators included), body rewritten
            first = min([s.lineno] + [d.lineno for d in getattr(s, "decorator_list", [])])
            header_end = self._header_end(s)
            return self.lines[first - 1:header_end] + self.block(s.body, header_end + 1, s.end_lineno)
        return self.lines[s.lineno - 1:s.end_lineno]

    def if_stmt(self, s: ast.If, keyword: str | None) -> list[str]:
        test = partial_eval(s.test, self.env)
        header_end = self._header_end(s)
        elif_ = self._is_elif(s)
        body_end = (s.orelse[0].lineno - 1 if elif_ else self._else_line(s) - 1) if s.orelse else s.end_lineno
        if isinstance(test, ast.Constant):
            if test.value:
                kept = self.block(s.body, header_end + 1, body_end)
                return _dedent(kept, s.body[0].col_offset - s.col_offset)
            if not s.orelse:
                return []
            if elif_:  # the elif becomes the if, at the same indentation
                return self.stmt(s.orelse[0], keyword="if")
            else_line = self._else_line(s)
            kept = self.block(s.orelse, else_line + 1, s.end_lineno)
            return _dedent(kept, s.orelse[0].col_offset - s.col_offset)
        header = self.lines[s.lineno - 1:header_end]
        if ast.dump(test) != ast.dump(s.test):
            if s.test.end_lineno != s.test.lineno:
                raise ValueError(f"a switch test spanning lines ({s.lineno}) is not supported")
            line = header[0]
            header = [line[:s.test.col_offset] + ast.unparse(test) + line[s.test.end_col_offset:]] + header[1:]
        if keyword is not None:
            indent = len(header[0]) - len(header[0].lstrip())
            word = header[0].lstrip().split(None, 1)[0]
            header[0] = header[0][:indent] + keyword + header[0][indent + len(word):]
        out = header + self.block(s.body, header_end + 1, body_end)
        if s.orelse:
            if elif_:
                out += self.stmt(s.orelse[0], keyword="elif")
            else:
                else_line = self._else_line(s)
                out += self.lines[body_end:else_line]
                out += self.block(s.orelse, else_line + 1, s.end_lineno)
        return out


def resolve_branches(source: str, env: dict[str, bool]) -> str:
    """``source`` with every ``if`` that the switches ``env`` decide replaced by the branch taken."""
    return _Branches(source, env).run()


# --------------------------------------------------------------------------------------------------
# Dead code: assignments nothing reads, parameters nothing reads, the arguments passed for them.
# --------------------------------------------------------------------------------------------------

def _function(tree: ast.Module) -> ast.FunctionDef:
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    return fn


def _loaded(fn: ast.FunctionDef) -> set[str]:
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _target_names(target: ast.expr) -> list[str] | None:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
        return [e.id for e in target.elts]
    return None


def drop_dead_assignments(source: str) -> str:
    """Remove assignments (of values without side effects) to names the function never reads, until
    none is left."""
    while True:
        tree = ast.parse(source)
        fn = _function(tree)
        loaded = _loaded(fn)
        lines = source.splitlines()
        dead = []
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            names = [n for t in node.targets for n in (_target_names(t) or ["<complex>"])]
            if "<complex>" in names or set(names) & loaded:
                continue
            if _EFFECTS.search(ast.get_source_segment(source, node.value) or ""):
                continue
            dead.append(node)
        if not dead:
            return source
        for node in sorted(dead, key=lambda n: -n.lineno):
            text = lines[node.lineno - 1]
            if text[:node.col_offset].strip() or lines[node.end_lineno - 1][node.end_col_offset:].split("#")[0].strip():
                raise ValueError(f"line {node.lineno} holds more than the dead assignment")
            del lines[node.lineno - 1:node.end_lineno]
        source = "\n".join(lines) + "\n"


def unused_parameters(source: str) -> list[str]:
    """Parameters of the function that its body never reads (decorator arguments do not count)."""
    fn = _function(ast.parse(source))
    body_names = set()
    for stmt in fn.body:
        body_names |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    return [a.arg for a in fn.args.args if a.arg not in body_names]


def drop_parameters(source: str, names: list[str]) -> str:
    """Remove parameters ``names`` from the function's signature, keeping its line layout (a line
    left without parameters goes)."""
    tree = ast.parse(source)
    fn = _function(tree)
    lines = source.splitlines()
    for arg in sorted((a for a in fn.args.args if a.arg in names), key=lambda a: (-a.lineno, -a.col_offset)):
        if arg.end_lineno != arg.lineno:
            raise ValueError(f"parameter {arg.arg} spans lines")
        line = lines[arg.lineno - 1]
        rest = line[arg.end_col_offset:]
        m = re.match(r"\s*,\s*", rest)
        if m:
            end = arg.end_col_offset + m.end()
            start = arg.col_offset
        else:  # the last parameter, without a trailing comma: take the comma before it
            start = len(line[:arg.col_offset].rstrip().rstrip(","))
            end = arg.end_col_offset
        lines[arg.lineno - 1] = (line[:start] + line[end:]).rstrip()
    signature = range(fn.lineno - 1, fn.body[0].lineno - 1)
    lines = [ln for i, ln in enumerate(lines) if not (i in signature and not ln.strip())]
    return "\n".join(lines) + "\n"


def drop_call_arguments(source: str, callee: str, positions: set[int]) -> str:
    """Remove the positional arguments at ``positions`` of every call of ``callee`` in ``source``,
    wrapping the remaining arguments again at the call's opening parenthesis."""
    if not positions:
        return source
    tree = ast.parse(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == callee]
    lines = source.splitlines()
    for call in sorted(calls, key=lambda c: -c.lineno):
        if call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
            raise ValueError(f"the call of {callee} at line {call.lineno} is not a plain positional call")
        args = [ast.get_source_segment(source, a) for i, a in enumerate(call.args) if i not in positions]
        first = lines[call.lineno - 1]
        prefix = first[:call.func.end_col_offset] + "("
        suffix = lines[call.end_lineno - 1][call.end_col_offset - 1:]  # the ")" and what follows
        lines[call.lineno - 1:call.end_lineno] = _wrap(prefix, args, suffix)
    return "\n".join(lines) + "\n"


def _wrap(prefix: str, args: list[str], suffix: str) -> list[str]:
    indent = " " * len(prefix)
    out, line = [], prefix
    for i, arg in enumerate(args):
        piece = arg + ("," if i < len(args) - 1 else "")
        tail = suffix if i == len(args) - 1 else ""
        candidate = (line if line.endswith(("(", " ")) or line == indent else line + " ") + piece
        if len(candidate + tail) > WIDTH and line.strip() and line != prefix:
            out.append(line.rstrip())
            candidate = indent + piece
        line = candidate
    out.append(line + suffix)
    return out


def _substitute_leftovers(source: str, env: dict[str, bool]) -> str:
    """Any read of a fixed switch that no branch or argument took away becomes its literal value."""
    tree = ast.parse(source)
    fn = _function(tree)
    params = {a.arg for a in fn.args.args}
    hits = [n for stmt in fn.body for n in ast.walk(stmt)
            if isinstance(n, ast.Name) and n.id in env and n.id in params and isinstance(n.ctx, ast.Load)]
    lines = source.splitlines()
    for n in sorted(hits, key=lambda n: (-n.lineno, -n.col_offset)):
        line = lines[n.lineno - 1]
        lines[n.lineno - 1] = line[:n.col_offset] + repr(env[n.id]) + line[n.end_col_offset:]
    return "\n".join(lines) + "\n"


def resolve_functions(module_source: str, functions: tuple[str, ...], env: dict[str, bool]) -> str:
    """The source of ``functions`` (helpers first, each called only by the later ones) with the
    constexpr switches ``env`` fixed: branches resolved, dead assignments, parameters and the
    arguments passed for them removed. A function's switch parameters are the names of ``env``
    among its parameters; a caller must pass each of them the same-named switch, so the helper
    sees the caller's value (checked)."""
    sources = function_sources(module_source, functions)
    done: dict[str, tuple[str, list[str]]] = {}  # name -> (resolved source, original parameter names)
    for name in functions:
        text = sources[name]
        original = [a.arg for a in _function(ast.parse(text)).args.args]
        for helper, (_, helper_params) in done.items():
            _check_switch_arguments(text, helper, helper_params, env)
        text = resolve_branches(text, env)
        for helper, (helper_text, helper_params) in done.items():
            kept = {a.arg for a in _function(ast.parse(helper_text)).args.args}
            text = drop_call_arguments(text, helper, {i for i, p in enumerate(helper_params) if p not in kept})
        while True:
            text = drop_dead_assignments(text)
            unused = unused_parameters(text)
            if not unused:
                break
            text = drop_parameters(text, unused)
        text = _substitute_leftovers(text, env)
        done[name] = (text, original)
    return "\n\n".join(done[name][0] for name in functions)


def _check_switch_arguments(source: str, helper: str, helper_params: list[str], env: dict) -> None:
    for call in ast.walk(ast.parse(source)):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == helper):
            continue
        for i, p in enumerate(helper_params):
            if p in env:
                arg = call.args[i] if i < len(call.args) else None
                if not (isinstance(arg, ast.Name) and arg.id == p):
                    raise ValueError(f"{helper}'s switch {p} is passed {ast.unparse(arg) if arg else 'nothing'} at "
                                     f"line {call.lineno}: a step can only fix switches passed by name")


__all__ = ["function_sources", "partial_eval", "resolve_branches", "resolve_functions", "drop_dead_assignments",
           "unused_parameters", "drop_parameters", "drop_call_arguments"]
