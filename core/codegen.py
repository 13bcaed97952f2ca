"""Fast forms generated at import time from the one source: rules inlined into the
driver's hot functions, and tables compiled into functions.

**Inlining.** A rule is written once, as a plain function (``core/liveness.py``, the driver's own
timers); the driver calls it on every step, and a Python call costs about as much
as a small rule's body. :func:`inline` makes, at import time, a copy of a caller in
which each call to one of the named rules is replaced by the rule's body: the fast
form is generated from the one source, never written by hand.

What is inlined: a statement ``target = rule(args)`` or ``return rule(args)``, and
the test of an ``if`` that is a bare ``rule(args)`` call, in the caller and,
recursively, in the inlined bodies. Each argument is evaluated once, in order, into
a fresh local (a missing one from the rule's default); the rule's locals are renamed
apart; in an assignment, a ``return`` becomes an assignment to the target, and the
statements after an ``if`` that returns move into its other branch. The generated
function runs in the caller's module, whose namespace gains the globals the rules
read that it lacked (under the same names, for the same objects).

Patching a rule at run time (a test's planted bug) does not reach a caller that
inlined it: patch the caller, or the rule where it is called plainly.

**Compiled tables.** A rule written as a table (the join table, the phase's parts)
runs as Python source generated from it (:func:`run_source`).
:class:`CompiledForms` holds the form of the table in force and compiles it again
whenever the table is another object (an edited table, a checker's planted bug), so
what runs is always the table; :func:`current_form` is the lookup a hot path
inlines.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import itertools
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

__all__ = ["CompiledForms", "current_form", "inline", "inlining", "renamed", "run_source"]

_F = TypeVar("_F", bound=Callable[..., Any])
_Table = TypeVar("_Table")
_Form = TypeVar("_Form")


def run_source(source: str, filename: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """``namespace`` with the definitions of ``source`` (generated from a table;
    ``filename`` names the table in tracebacks) executed into it."""
    exec(compile(source, filename, "exec"), namespace)
    return namespace


class CompiledForms(Generic[_Table, _Form]):
    """The compiled form of a table in force: made by ``compile_table`` from the
    table it is asked for, and made again whenever that is another object."""

    def __init__(self, compile_table: Callable[[_Table], _Form]) -> None:
        self._compile = compile_table
        #: the table last compiled (None: none yet), and its form
        self.table: _Table | None = None
        self.form: _Form = cast(_Form, None)

    def of(self, table: _Table) -> _Form:
        """The form of ``table``, compiled now if it is not the table last compiled."""
        if table is not self.table:
            self.form = self._compile(table)
            self.table = table
        return self.form


def renamed(expression: str, names: dict[str, str]) -> str:
    """The source of ``expression`` with each name of ``names`` replaced by its
    value (a table's part read from another variable)."""
    direct: dict[str, ast.expr] = {old: ast.Name(new, ast.Load()) for old, new in names.items()}
    return ast.unparse(_Renamed(set(), "", direct).visit(ast.parse(expression, mode="eval")))


def current_form(forms: CompiledForms[_Table, _Form], table: _Table) -> _Form:
    """``forms.of(table)`` with no call while ``table`` is the one last compiled:
    the lookup a hot path inlines (:func:`inline`)."""
    if table is forms.table:
        return forms.form
    return forms.of(table)


def inlining(*rules: Callable[..., Any]) -> Callable[[_F], _F]:
    """A decorator: the function it decorates, with ``rules`` inlined (:func:`inline`)."""
    return lambda caller: inline(caller, *rules)


def inline(caller: _F, *rules: Callable[..., Any]) -> _F:
    """``caller`` with its calls to ``rules`` compiled in (see the module docstring).

    Raises:
        ValueError: a rule reads a global that the caller's module binds to another
            object, or a call passes keyword or starred arguments.
    """
    by_name = {rule.__name__: rule for rule in rules}
    tree = ast.parse(textwrap.dedent(inspect.getsource(caller)))
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef), caller
    definition.decorator_list = []
    fresh = itertools.count()
    definition.body = _inline_block(definition.body, by_name, fresh)
    namespace = caller.__globals__
    for rule in rules:
        for name in _globals_read(rule):
            if name not in rule.__globals__:
                continue  # a builtin
            value = rule.__globals__[name]
            if namespace.setdefault(name, value) is not value:
                raise ValueError(
                    f"cannot inline {rule.__name__} into {caller.__name__}: the global "
                    f"{name!r} names another object in {caller.__module__}"
                )
    ast.increment_lineno(tree, caller.__code__.co_firstlineno - 1)
    code = compile(ast.fix_missing_locations(tree), caller.__code__.co_filename, "exec")
    scope: dict[str, Any] = {}
    exec(code, namespace, scope)
    made = scope[caller.__name__]
    functools.update_wrapper(made, caller)
    return made  # type: ignore[no-any-return]


def _globals_read(rule: Callable[..., Any]) -> set[str]:
    """The names ``rule`` reads that are not its own locals."""
    definition = ast.parse(textwrap.dedent(inspect.getsource(rule))).body[0]
    assert isinstance(definition, ast.FunctionDef)
    local = {arg.arg for arg in definition.args.args} | {
        node.id
        for node in ast.walk(definition)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    return {
        node.id
        for node in ast.walk(definition)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local
    }


def _rule_call(node: ast.expr | None, rules: dict[str, Callable[..., Any]]) -> ast.Call | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in rules:
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise ValueError(f"inline: call {node.func.id} with plain positional arguments")
        return node
    return None


def _inline_block(
    body: list[ast.stmt], rules: dict[str, Callable[..., Any]], fresh: Iterator[int]
) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for statement in body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            call = _rule_call(statement.value, rules)
            if call is not None:
                out.extend(_expanded(call, statement.targets[0], rules, fresh))
                continue
        if isinstance(statement, ast.Return):
            call = _rule_call(statement.value, rules)
            if call is not None:
                out.extend(_expanded(call, None, rules, fresh))
                continue
        if isinstance(statement, ast.If):
            call = _rule_call(statement.test, rules)
            if call is not None:
                flag = ast.Name(f"_inlined_{next(fresh)}", ast.Store())
                out.extend(_expanded(call, flag, rules, fresh))
                statement.test = ast.Name(flag.id, ast.Load())
        for field in ("body", "orelse", "finalbody"):
            block = getattr(statement, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                setattr(statement, field, _inline_block(block, rules, fresh))
        out.append(statement)
    return out


def _expanded(
    call: ast.Call,
    target: ast.expr | None,
    rules: dict[str, Callable[..., Any]],
    fresh: Iterator[int],
) -> list[ast.stmt]:
    """``target = call`` as the called rule's body (``target`` None: ``return call``,
    the body's returns kept)."""
    assert isinstance(call.func, ast.Name)
    rule = rules[call.func.id]
    tree = ast.parse(textwrap.dedent(inspect.getsource(rule)))
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef)
    params = [arg.arg for arg in definition.args.args]
    defaults = definition.args.defaults
    missing = len(params) - len(call.args)
    if missing < 0 or missing > len(defaults):
        raise ValueError(f"inline: {rule.__name__} called with {len(call.args)} arguments")
    # (A default is an expression over constants and globals, evaluated once per
    # call here rather than once at definition: only immutable defaults are used.)
    arguments = call.args + defaults[len(defaults) - missing :]
    prefix = f"_{rule.__name__.lstrip('_')}_{next(fresh)}_"
    local = set(params) | {
        node.id
        for node in ast.walk(definition)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    assigned = {
        node.id
        for node in ast.walk(definition)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    # A parameter the rule never assigns, passed a name or a constant, is read in
    # place; any other argument is evaluated once into a fresh local.
    direct: dict[str, ast.expr] = {
        param: argument
        for param, argument in zip(params, arguments, strict=True)
        if param not in assigned and isinstance(argument, (ast.Name, ast.Constant))
    }
    renamed = _Renamed(local - direct.keys(), prefix, direct)
    body = [renamed.visit(statement) for statement in definition.body]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    bound: list[ast.stmt] = [
        ast.Assign([ast.Name(prefix + param, ast.Store())], argument)
        for param, argument in zip(params, arguments, strict=True)
        if param not in direct
    ]
    if target is None:
        if not _always_returns(body):
            body.append(ast.Return(ast.Constant(None)))
    else:
        body = _returns_assigned(body, target)
    return _inline_block(bound, rules, fresh) + _inline_block(body, rules, fresh)


class _Renamed(ast.NodeTransformer):
    def __init__(self, names: set[str], prefix: str, direct: dict[str, ast.expr]) -> None:
        self.names, self.prefix, self.direct = names, prefix, direct

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.direct:
            return copy.deepcopy(self.direct[node.id])
        return ast.Name(self.prefix + node.id, node.ctx) if node.id in self.names else node


def _always_returns(body: list[ast.stmt]) -> bool:
    if not body:
        return False
    last = body[-1]
    if isinstance(last, ast.Return):
        return True
    return isinstance(last, ast.If) and _always_returns(last.body) and _always_returns(last.orelse)


def _returns(node: ast.stmt) -> bool:
    return any(isinstance(inner, ast.Return) for inner in ast.walk(node))


def _returns_assigned(body: list[ast.stmt], target: ast.expr) -> list[ast.stmt]:
    """``body`` with each ``return value`` as ``target = value`` and the control
    flow after it kept (what follows an ``if`` that may return goes into the
    branches that do not)."""
    out: list[ast.stmt] = []
    for index, statement in enumerate(body):
        if isinstance(statement, ast.Return):
            value = statement.value if statement.value is not None else ast.Constant(None)
            out.append(ast.Assign([_store(target)], value))
            return out
        if isinstance(statement, ast.If) and _returns(statement):
            rest = body[index + 1 :]
            then = statement.body if _always_returns(statement.body) else statement.body + rest
            other = (
                statement.orelse
                if _always_returns(statement.orelse)
                else statement.orelse + copy.deepcopy(rest)
            )
            statement.body = _returns_assigned(then, target)
            statement.orelse = _returns_assigned(other, target)
            out.append(statement)
            return out
        if _returns(statement):
            raise ValueError("inline: a return inside a loop or a with block")
        out.append(statement)
    out.append(ast.Assign([_store(target)], ast.Constant(None)))
    return out


def _store(target: ast.expr) -> ast.expr:
    made = copy.deepcopy(target)
    for node in ast.walk(made):
        if hasattr(node, "ctx"):
            node.ctx = ast.Load()
    made.ctx = ast.Store()  # type: ignore[attr-defined]
    return made
