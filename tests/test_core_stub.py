"""``_core.pyi`` against the built extension: the stub may not drift from the bindings.

Every public class, function, method, property and attribute of ``ferrokv._core`` must be in the
stub and vice versa, with the same kind (method vs attribute), the same exception bases, and the
same signatures: parameter names, kinds (positional / keyword-only) and defaults wherever the
binding's ``__text_signature__`` states one. Module-level assignments in the stub (``TokenIds =
...``) are type aliases, which exist only for the type checker.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ferrokv import _core

STUB = Path(__file__).parent.parent / "python" / "ferrokv" / "_core.pyi"

NO_DEFAULT = "<required>"
UNSTATED = "<not stated>"  # a default the signature does not spell out (``...``)


@dataclass(slots=True, frozen=True)
class Param:
    name: str
    kind: str  # "positional" | "keyword_only" | "var_positional" | "var_keyword"
    default: Any


@dataclass(slots=True)
class Member:
    kind: str  # "method" | "attribute"
    params: list[Param] | None = None  # methods only, without self


@dataclass(slots=True)
class Class:
    bases: list[str]
    init: list[Param] | None  # constructor parameters; None = not constructible from Python
    members: dict[str, Member]


# ------------------------------------------------------------------------------------------------
# The stub, read with ast.


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return NO_DEFAULT
    value = ast.literal_eval(node)
    return UNSTATED if value is Ellipsis else value


def _stub_params(fn: ast.FunctionDef, is_method: bool) -> list[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [Param(p.arg, "positional", _default(d)) for p, d in zip(positional, defaults)]
    if a.vararg:
        params.append(Param(a.vararg.arg, "var_positional", NO_DEFAULT))
    params += [Param(p.arg, "keyword_only", _default(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "var_keyword", NO_DEFAULT))
    return params[1:] if is_method else params


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def _stub_class(node: ast.ClassDef) -> Class:
    members: dict[str, Member] = {}
    init = None
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            init = _stub_params(item, is_method=True)
        elif isinstance(item, ast.FunctionDef):
            members[item.name] = Member("attribute") if _is_property(item) else Member(
                "method", _stub_params(item, is_method=True))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members[item.target.id] = Member("attribute")
    return Class([ast.unparse(b) for b in node.bases], init, members)


def _read_stub(path: Path) -> tuple[dict[str, Class], dict[str, Member]]:
    classes: dict[str, Class] = {}
    others: dict[str, Member] = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = _stub_class(node)
        elif isinstance(node, ast.FunctionDef):
            others[node.name] = Member("method", _stub_params(node, is_method=False))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            others[node.target.id] = Member("attribute")
    return classes, others


# ------------------------------------------------------------------------------------------------
# The extension module, read by introspection.

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def _runtime_params(obj: Any, is_method: bool) -> list[Param]:
    params = []
    for p in inspect.signature(obj).parameters.values():
        if p.default is inspect.Parameter.empty:
            default = NO_DEFAULT
        else:
            default = UNSTATED if p.default is Ellipsis else p.default
        params.append(Param(p.name, _KINDS[p.kind], default))
    return params[1:] if is_method else params


def _runtime_class(cls: type) -> Class:
    members: dict[str, Member] = {}
    for name, value in vars(cls).items():
        if name.startswith("__"):
            continue
        if inspect.ismethoddescriptor(value) and not inspect.isdatadescriptor(value):
            members[name] = Member("method", _runtime_params(getattr(cls, name), is_method=True))
        else:  # getters, #[pyo3(get)] fields, plain class attributes
            members[name] = Member("attribute")
    is_exception = issubclass(cls, BaseException)
    text_signature = None if is_exception else cls.__text_signature__
    init = _runtime_params(cls, is_method=False) if text_signature else None
    return Class([b.__name__ for b in cls.__bases__ if b is not object], init, members)


def _read_module() -> tuple[dict[str, Class], dict[str, Member]]:
    classes: dict[str, Class] = {}
    others: dict[str, Member] = {}
    for name in dir(_core):
        if name.startswith("_") and name != "__version__":
            continue
        value = getattr(_core, name)
        if isinstance(value, type):
            classes[name] = _runtime_class(value)
        elif callable(value):
            others[name] = Member("method", _runtime_params(value, is_method=False))
        else:
            others[name] = Member("attribute")
    return classes, others


# ------------------------------------------------------------------------------------------------
# The comparison.


def _param_diffs(where: str, stub: list[Param], real: list[Param]) -> list[str]:
    names = ([p.name for p in stub], [p.name for p in real])
    if names[0] != names[1]:
        return [f"{where}: parameters {names[0]} in the stub, {names[1]} in the module"]
    out = []
    for s, r in zip(stub, real):
        if s.kind != r.kind:
            out.append(f"{where}({s.name}): {s.kind} in the stub, {r.kind} in the module")
        if UNSTATED not in (s.default, r.default) and s.default != r.default:
            out.append(f"{where}({s.name}): default {s.default!r} in the stub, {r.default!r} in the module")
    return out


def _member_diffs(where: str, stub: dict[str, Member], real: dict[str, Member]) -> list[str]:
    out = [f"{where}{n}: in the module, not in the stub" for n in sorted(real.keys() - stub.keys())]
    out += [f"{where}{n}: in the stub, not in the module" for n in sorted(stub.keys() - real.keys())]
    for name in sorted(stub.keys() & real.keys()):
        s, r = stub[name], real[name]
        if s.kind != r.kind:
            out.append(f"{where}{name}: a {s.kind} in the stub, a {r.kind} in the module")
        elif s.kind == "method":
            out += _param_diffs(f"{where}{name}", s.params, r.params)
    return out


def stub_diffs(stub: Path = STUB) -> list[str]:
    stub_classes, stub_others = _read_stub(stub)
    real_classes, real_others = _read_module()
    out = _member_diffs("", stub_others, real_others)
    out += [f"class {n}: in the module, not in the stub" for n in sorted(real_classes.keys() - stub_classes.keys())]
    out += [f"class {n}: in the stub, not in the module" for n in sorted(stub_classes.keys() - real_classes.keys())]
    for name in sorted(stub_classes.keys() & real_classes.keys()):
        s, r = stub_classes[name], real_classes[name]
        if s.bases != r.bases:
            out.append(f"class {name}: bases {s.bases} in the stub, {r.bases} in the module")
        if (s.init is None) != (r.init is None):
            out.append(f"class {name}: constructor {'only in the stub' if r.init is None else 'missing in the stub'}")
        elif s.init is not None:
            out += _param_diffs(f"{name}.__init__", s.init, r.init)
        out += _member_diffs(f"{name}.", s.members, r.members)
    return out


def test_stub_matches_the_extension_module():
    diffs = stub_diffs()
    assert not diffs, "python/ferrokv/_core.pyi differs from the bindings:\n" + "\n".join(diffs)


def test_the_comparison_sees_every_kind_of_member():
    """Guards the test itself: both readers find each kind of thing, so an empty diff means something."""
    stub_classes, stub_others = _read_stub(STUB)
    real_classes, real_others = _read_module()
    for classes, others in ((stub_classes, stub_others), (real_classes, real_others)):
        assert {"Scheduler", "SchedulerOutput", "FinishedSequence", "InvalidArgumentError"} <= classes.keys()
        assert others["validate_scheduler_config"].kind == "method" and others["__version__"].kind == "attribute"
        sched = classes["Scheduler"]
        assert sched.init and sched.init[0] == Param("num_blocks", "positional", NO_DEFAULT)
        assert sched.members["add_request"].kind == "method" and sched.members["num_free_blocks"].kind == "attribute"
        assert classes["SchedulerOutput"].members["step_id"].kind == "attribute"
        assert classes["InvalidArgumentError"].bases == ["FerrokvError", "ValueError"]
    add = real_classes["Scheduler"].members["add_request"].params
    assert Param("n", "keyword_only", 1) in add, add  # defaults are introspected, not skipped


@pytest.mark.parametrize(
    "old, new, diff",
    [
        ("def seq_tokens(self,", "def seq_tokenz(self,", "Scheduler.seq_tokens: in the module, not in the stub"),
        ("def seq_tokens(self,", "def seq_tokenz(self,", "Scheduler.seq_tokenz: in the stub, not in the module"),
        ("        n: int = 1,", "        n: int = 2,", "Scheduler.add_request(n): default 2 in the stub, 1 in the module"),
        ("    def abort(self, request_id: int)", "    def abort(self, req_id: int)", "Scheduler.abort: parameters"),
        ("    @property\n    def num_waiting(self) -> int: ...", "    num_waiting: int", None),  # a property is an attribute
        ("    num_tokens: int\n", "", "SchedulerOutput.num_tokens: in the module, not in the stub"),
    ],
)
def test_a_stub_edit_is_caught(tmp_path, old, new, diff):
    """Edits of a copy of the stub show up; a binding renamed without its stub fails the same way
    (checked by renaming ``seq_tokens`` in lib.rs once)."""
    text = STUB.read_text()
    assert text.count(old) == 1, old
    edited = tmp_path / "_core.pyi"
    edited.write_text(text.replace(old, new))
    diffs = stub_diffs(edited)
    if diff is None:
        assert not diffs, diffs
    else:
        assert any(d.startswith(diff) for d in diffs), diffs
