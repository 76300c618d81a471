"""What a diffusers pipeline's own code says about its call arguments, read at plan time.

Nothing here names a pipeline class: every fact is read from the class's `__call__` signature
and from the source of the methods `__call__` reaches (`self.<method>`, transitively), so a
pipeline diffusers adds tomorrow is judged by the same rules. Where the code does not show a
fact plainly, the answer is the conservative one (keep the argument in the key, refuse nothing).

- accepted arguments: the named parameters, and the names `__call__` takes out of its `**kwargs`
  (`kwargs.pop("callback", None)`: diffusers' deprecated pass-through);
- padded prompts: every tokenizer call that feeds a model pads to `max_length` with truncation,
  so a prompt's text changes tensor values, never shapes (its count stays in: it is the batch);
- predicates: an argument stored as `self._<arg>` and read by a property only as a comparison
  with a constant (`self._guidance_scale > 1`) reaches the graphs as that comparison's outcome,
  provided the argument is never passed to a component directly;
- tuples: arguments the signature declares as tuples (annotation or default): TOML gives lists;
- component uses: which methods of a component the call reaches (`self.vae.decode(...)`).
"""

from __future__ import annotations

import ast
import inspect
import operator
import re
import textwrap
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeGuard

PROMPT_ARG = re.compile(r"^(negative_)?prompt(_\d)?$")
_TOKENIZER = re.compile(r"^tokenizer(_\d+)?$")
_TOKENIZING_METHODS = {"apply_chat_template", "encode", "encode_plus", "batch_encode_plus", "__call__"}
_COMPARE: Mapping[type, Callable[[Any, Any], bool]] = {
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Lt: operator.lt, ast.LtE: operator.le,
}  # fmt: skip  # a table: its rows packed, not one item a line
_SYMBOL: Mapping[type, str] = {ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<="}
# Helpers that take a module only to read where or in which dtype its parameters are.
_READS_ONLY = re.compile(r"(device|dtype)$")
WHOLE = "*"  # a component used as a value (passed, aliased): any of its methods may run
FORWARD = "forward"


@dataclass(frozen=True)
class Predicate:
    """`<argument> <op> <constant>`: the only thing of the argument the graphs depend on."""

    op: str
    constant: float
    source: str  # the property that compares it, e.g. do_classifier_free_guidance

    def holds(self, value: Any) -> bool | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        compare = next(f for k, f in _COMPARE.items() if _SYMBOL[k] == self.op)
        return compare(value, self.constant)

    @property
    def label(self) -> str:
        return f"{self.op} {self.constant:g}"


@dataclass(frozen=True)
class CallFacts:
    parameters: tuple[str, ...]  # named parameters of __call__ (no self, no **kwargs)
    pass_through: tuple[str, ...] = ()  # names __call__ takes out of its **kwargs
    padded_prompts: frozenset[str] = frozenset()
    predicates: Mapping[str, Predicate] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    tuples: Mapping[str, int | None] = field(default_factory=dict)  # argument -> its fixed length, if declared
    uses: Mapping[str, frozenset[str]] = field(default_factory=dict)  # component -> methods reached (FORWARD, WHOLE)

    @property
    def accepted(self) -> tuple[str, ...]:
        return (*self.parameters, *self.pass_through)


@lru_cache(maxsize=32)
def call_facts(cls: type) -> CallFacts:
    signature = inspect.signature(cls.__call__)
    params = [p for n, p in signature.parameters.items() if n != "self"]
    named = tuple(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    trees = dict(_reachable(cls))
    call_tree = trees.get("__call__")
    pass_through = tuple(sorted(_popped(call_tree, var_kw))) if var_kw and call_tree else ()
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    uses = _component_uses(trees.values())
    return CallFacts(
        parameters=named,
        pass_through=tuple(n for n in pass_through if n not in named),
        padded_prompts=frozenset(n for n in named if PROMPT_ARG.match(n)) if _pads_prompts(trees) else frozenset(),
        predicates=_predicates(cls, trees, set(named), uses),
        defaults=defaults,
        tuples={p.name: n for p in params if (n := _tuple_length(p)) != -1},
        uses=uses,
    )


def _reachable(cls: type) -> Iterator[tuple[str, ast.AST]]:
    """(name, parsed source) of __call__ and every method or property it reaches via self."""
    seen: set[str] = set()
    todo = ["__call__"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        member = inspect.getattr_static(cls, name, None)
        func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not inspect.isfunction(func) or not (func.__module__ or "").startswith("diffusers"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError, SyntaxError):
            continue
        yield name, tree
        todo.extend(node.attr for node in ast.walk(tree) if _is_self_attr(node))


def _is_self_attr(node: ast.AST) -> TypeGuard[ast.Attribute]:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _popped(tree: ast.AST, var_kw: str) -> set[str]:
    """Names read out of **kwargs: kwargs.pop("x"), kwargs.get("x"), kwargs["x"]."""
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "get")
            and isinstance(node.func.value, ast.Name) and node.func.value.id == var_kw
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
        ):  # fmt: skip  # arguments packed by meaning, not one a line
            names.add(node.args[0].value)
        elif (
            isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == var_kw
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
        ):  # fmt: skip  # arguments packed by meaning, not one a line
            names.add(node.slice.value)
    return names


def _pads_prompts(trees: Mapping[str, ast.AST]) -> bool:
    """True if there is a tokenization and every one that feeds a model pads to max_length with
    truncation (the padding="longest" calls whose result is only compared, for a truncation
    warning, are assigned to `untruncated_*` and do not count)."""
    found = False
    for tree in trees.values():
        skipped = {
            id(call)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and any("untruncated" in ast.unparse(t) for t in node.targets)
            for call in ast.walk(node.value)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in skipped or not _tokenizes(node):
                continue
            found = True
            keywords = {k.arg: k.value for k in node.keywords}
            padding, truncation = keywords.get("padding"), keywords.get("truncation")
            if not (_constant(padding) == "max_length" and _constant(truncation) is True):
                return False
    return found


def _tokenizes(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return bool(_TOKENIZER.match(func.id))
    if not isinstance(func, ast.Attribute):
        return False
    if _TOKENIZER.match(func.attr):  # self.tokenizer(...), self.tokenizer_2(...)
        return True
    owner = func.value.attr if isinstance(func.value, ast.Attribute) else getattr(func.value, "id", "")
    if not (_TOKENIZER.match(owner or "") and func.attr in _TOKENIZING_METHODS):
        return False
    tokenize = next((k.value for k in call.keywords if k.arg == "tokenize"), None)
    return _constant(tokenize) is not False  # apply_chat_template(tokenize=False) renders text only


def _constant(node: ast.AST | None) -> Any:
    return node.value if isinstance(node, ast.Constant) else None


def _component_uses(trees: Any) -> dict[str, frozenset[str]]:
    """Per `self.<name>` the call reaches: the methods called on it, FORWARD when it is called
    itself, WHOLE when it is handed on as a value (then any method may run)."""
    uses: dict[str, set[str]] = {}
    for tree in trees:
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not _is_self_attr(node):
                continue
            parent = parents.get(id(node))
            if isinstance(parent, ast.Assign) and node in parent.targets:
                continue  # self.vae = self.vae.to(...): rebinding, not a use
            found = uses.setdefault(node.attr, set())
            if isinstance(parent, ast.Call) and parent.func is node:
                found.add(FORWARD)
            elif isinstance(parent, ast.Call) and _READS_ONLY.search(_callee(parent)):
                found.add(".device")  # get_module_execution_device(self.vae): reads its parameters
            elif isinstance(parent, ast.Attribute):
                grand = parents.get(id(parent))
                if isinstance(grand, ast.Call) and grand.func is parent:
                    found.add(parent.attr)
                else:
                    found.add("." + parent.attr)  # an attribute read (config, dtype) or a method taken as a value
            else:
                found.add(WHOLE)
    return {k: frozenset(v) for k, v in uses.items()}


def _predicates(
    cls: type, trees: Mapping[str, ast.AST], named: set[str], uses: Mapping[str, frozenset[str]]
) -> dict[str, Predicate]:
    """Arguments whose every use by a property is one comparison with a constant, stored as
    self._<arg> in __call__ and never handed to a component by name."""
    call_tree = trees.get("__call__")
    if call_tree is None:
        return {}
    stored = {
        node.targets[0].attr[1:]: node
        for node in ast.walk(call_tree)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_self_attr(node.targets[0])
        and node.targets[0].attr.startswith("_") and isinstance(node.value, ast.Name) and node.value.id == node.targets[0].attr[1:]
    }  # fmt: skip  # arguments packed by meaning, not one a line
    found: dict[str, Predicate] = {}
    for arg in sorted(set(stored) & named):
        compared: list[Predicate] = []
        plain = True
        for name, tree in trees.items():
            if not isinstance(inspect.getattr_static(cls, name, None), property):
                continue
            for node in ast.walk(tree):
                if _is_self_attr(node) and node.attr == f"_{arg}":
                    compare = _comparison_of(tree, node)
                    if compare is None:
                        plain = name == arg  # the plain getter (`def guidance_scale: return self._guidance_scale`)
                        if not plain:
                            break
                    else:
                        compared.append(Predicate(compare[0], compare[1], name))
            if not plain:
                break
        if plain and len({(p.op, p.constant) for p in compared}) == 1 and not _passed_to_components(trees, arg, uses):
            found[arg] = compared[0]
    return found


def _comparison_of(tree: ast.AST, attr: ast.Attribute) -> tuple[str, float] | None:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Compare) and node.left is attr and len(node.ops) == 1 and type(node.ops[0]) in _SYMBOL
            and isinstance(node.comparators[0], ast.Constant) and isinstance(node.comparators[0].value, (int, float))
        ):  # fmt: skip  # arguments packed by meaning, not one a line
            return _SYMBOL[type(node.ops[0])], float(node.comparators[0].value)
    return None


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _passed_to_components(
    trees: Mapping[str, ast.AST], arg: str, uses: Mapping[str, frozenset[str]], depth: int = 0
) -> bool:
    """Does any call on a component (self.unet(...), self.vae.decode(...)) name the argument
    (`guidance_scale`, `self.guidance_scale`, `self._guidance_scale`) in its arguments? A call
    of the pipeline's own method (`self.check_inputs(guidance_scale=...)`) counts only where
    that method, followed by the name of its parameter, hands it on or stores it on self."""
    names = {arg, f"_{arg}"}
    for tree in trees.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            owner = func.value if isinstance(func, ast.Attribute) and _is_self_attr(func.value) else func
            if not (_is_self_attr(owner) and owner.attr in uses and owner.attr not in names):
                continue
            method = trees.get(owner.attr) if owner is func else None
            for position, value in [*enumerate(node.args), *((k.arg, k.value) for k in node.keywords)]:
                if not any(
                    (isinstance(inner, ast.Name) and inner.id in names)
                    or (_is_self_attr(inner) and inner.attr in names)
                    for inner in ast.walk(value)
                ):
                    continue
                param = _parameter(method, position) if method is not None and depth < 4 else None
                if param is None or method is None or _stores(method, param) or _passed_to_components(
                    {owner.attr: method}, param, uses, depth + 1
                ):  # fmt: skip  # arguments packed by meaning, not one a line
                    return True
    return False


def _parameter(method: ast.AST | None, position: int | str | None) -> str | None:
    """The name of method's parameter that receives a positional (int) or keyword (str) argument."""
    func = next((n for n in ast.walk(method) if isinstance(n, ast.FunctionDef)), None) if method else None
    if func is None or position is None:
        return None
    params = [a.arg for a in (*func.args.posonlyargs, *func.args.args)][1:]  # without self
    if isinstance(position, int):
        return params[position] if position < len(params) else None
    return position if position in params or position in [a.arg for a in func.args.kwonlyargs] else None


def _stores(method: ast.AST, param: str) -> bool:
    """Does method assign something holding param to an attribute of self?"""
    for node in ast.walk(method):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) for target in node.targets for t in ast.walk(target))
            and any(isinstance(n, ast.Name) and n.id == param for n in ast.walk(node.value))
        ):
            return True
    return False


def _tuple_length(param: inspect.Parameter) -> int:
    """-1: not a tuple; None: a tuple of any length; n: the length its annotation fixes (2+ items)."""
    annotation = param.annotation
    if isinstance(annotation, str):
        match = re.search(r"\btuple\[([^\[\]]*)\]", annotation, re.IGNORECASE)
        if match:
            items = [i for i in match.group(1).split(",") if i.strip()]
            return len(items) if len(items) >= 2 and "..." not in match.group(1) else None  # type: ignore[return-value]
        return None if isinstance(param.default, tuple) else -1  # type: ignore[return-value]
    for candidate in _union_members(annotation):
        if typing.get_origin(candidate) is tuple or candidate is tuple:
            members = typing.get_args(candidate)
            return len(members) if len(members) >= 2 and Ellipsis not in members else None  # type: ignore[return-value]
    return None if isinstance(param.default, tuple) else -1  # type: ignore[return-value]


def _union_members(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [m for a in args for m in _union_members(a)]
    return [annotation]
