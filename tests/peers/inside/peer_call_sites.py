"""Every call a peer's own source makes to a function fastppo replaces, bound to the drop-in.

A peer's trainer calls its helpers in ways a hand-written reference can miss: by keyword, with a
dict splatted in (verl's ``**config.global_batch_info``), through a registry (verl's
``policy_loss_fn = get_policy_loss_fn(mode)``), on a loss object (OpenRLHF's
``self.actor_loss_fn = PolicyLoss(...)``), unpacking a fixed number of results. This module reads
the peer's package with ``ast`` and, for each such call, binds its arguments to the peer's own
signature and to the drop-in's (both for the release followed): a call the peer accepts must bind
to the drop-in, and an assignment that unpacks the peer's results must unpack the drop-in's.

Names are resolved through each file's imports, so a ``masked_mean`` imported from elsewhere is
not taken for the replaced one. A ``**`` argument is resolved to its keys where the source shows
them (a dict built in the same function, or an attribute whose keys are assigned somewhere in the
package); otherwise the call is bound partially and counted as such.
"""

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class Target:
    """A replaced callable: where the peer defines it, its signature there and fastppo's, and how
    many values each returns (None when not a tuple). ``registry_names`` are local variables the
    peer calls it through; ``instance`` marks a class whose objects are called (``forward``)."""

    module: str
    name: str
    peer: inspect.Signature
    ours: inspect.Signature
    peer_returns: Optional[int] = None
    our_returns: Optional[int] = None
    registry_names: tuple = ()
    instance: Optional["Target"] = None  # for a class: the call of its objects, or of ``class_method``
    class_method: Optional[str] = None  # a class called through a method of its own (``Function.apply``)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, module: str, is_package: bool) -> dict:
    """Local name -> dotted origin (``"verl.utils.torch_functional"`` or ``"pkg.mod.name"``)."""
    origins = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # "import a.b" binds a; "import a.b as c" binds c to a.b
                top = alias.name.split(".")[0]
                origins[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                origins[alias.asname or alias.name] = f"{base}.{alias.name}"
    return origins


def _attribute_keys(trees: list) -> dict:
    """Attribute name -> keys assigned into it anywhere (``x.global_batch_info["dp_size"] = ...``)."""
    keys = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Attribute)
                        and isinstance(target.slice, ast.Constant)
                        and isinstance(target.slice.value, str)
                    ):
                        keys.setdefault(target.value.attr, set()).add(target.slice.value)
                    if isinstance(target, ast.Attribute) and isinstance(node.value, ast.Dict):
                        keys.setdefault(target.attr, set()).update(
                            k.value for k in node.value.keys if isinstance(k, ast.Constant)
                        )
    return keys


def _local_dict_keys(function: ast.AST, name: str) -> Optional[set]:
    """The keys a dict variable ``name`` gets in ``function``, or None if it is not built there."""
    keys, built = set(), False
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == name:
                    if isinstance(node.value, ast.Dict) and None not in node.value.keys:
                        built = True
                        keys.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
                    elif (
                        isinstance(node.value, ast.Call)
                        and getattr(node.value.func, "id", None) == "dict"
                        and not node.value.args
                    ):
                        built = True
                        keys.update(k.arg for k in node.value.keywords if k.arg)
                    else:
                        return None
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == name
                    and isinstance(target.slice, ast.Constant)
                ):
                    keys.add(target.slice.value)
    return keys if built else None


class _Placeholder:
    def __repr__(self):
        return "<arg>"


def _binds(signature: inspect.Signature, positional: int, keywords: set, complete: bool) -> Optional[str]:
    args, kwargs = [_Placeholder()] * positional, {key: _Placeholder() for key in keywords}
    try:
        (signature.bind if complete else signature.bind_partial)(*args, **kwargs)
        return None
    except TypeError as error:
        return str(error)


def _unpacked(parents: dict, call: ast.Call) -> Optional[tuple]:
    """``(n, exact)`` when the call's result is unpacked into n names (at least n - 1 with a star)."""
    parent = parents.get(call)
    if isinstance(parent, ast.Assign) and parent.value is call and len(parent.targets) == 1:
        target = parent.targets[0]
        if isinstance(target, (ast.Tuple, ast.List)):
            starred = any(isinstance(e, ast.Starred) for e in target.elts)
            return len(target.elts) - starred, not starred
    return None


def _arity_problem(unpack, returns) -> Optional[str]:
    if unpack is None:
        return None
    n, exact = unpack
    count = 1 if returns is None else returns
    if (count == n) if exact else (count >= n):
        return None
    return f"unpacks {'' if exact else 'at least '}{n} values, gets {count}"


def scan(root: Path, package: str, targets: list) -> dict:
    """Bind every call site under ``root/package``; ``{"bound": n, "partial": n, "failures": [...]}``."""
    files = sorted((root / package).rglob("*.py"))
    trees = {}
    for path in files:
        try:
            trees[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError:
            continue
    attribute_keys = _attribute_keys(list(trees.values()))
    report = {"bound": 0, "partial": 0, "sites": {}, "failures": []}
    for path, tree in trees.items():
        module = _module_name(root, path)
        _scan_file(path.relative_to(root), tree, module, path.name == "__init__.py", targets, attribute_keys, report)
    return report


def _origin_matches(origin: str, target: Target) -> bool:
    """Whether an imported dotted name is the target (or its module, re-exported by a parent)."""
    module, _, name = origin.rpartition(".")
    if name != target.name:
        return False
    return module == target.module or target.module.startswith(module + ".")


def _scan_file(
    relative: Path, tree, module: str, is_package: bool, targets: list, attribute_keys: dict, report: dict
) -> None:
    origins = _imports(tree, module, is_package)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    functions = {}  # each node -> its enclosing function
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                functions.setdefault(inner, node)

    def callee(call: ast.Call) -> list:
        """The targets this call reaches (several for a registry variable)."""
        f = call.func
        found = []
        for target in targets:
            objects = instances.get(target.name, ())
            if isinstance(f, ast.Name):
                if (
                    f.id in target.registry_names
                    or f.id == target.name
                    and _origin_matches(origins.get(f.id, f"{module}.{f.id}"), target)
                ):
                    found.append(target)
                elif target.instance is not None and f.id in objects:
                    found.append(target.instance)
            elif isinstance(f, ast.Attribute):
                owner = f.value
                if f.attr == target.name and isinstance(owner, ast.Name) and origins.get(owner.id) == target.module:
                    found.append(target)
                elif isinstance(owner, ast.Name) and owner.id == "self" and f.attr in target.registry_names:
                    found.append(target)
                elif (
                    target.class_method == f.attr
                    and isinstance(owner, ast.Name)
                    and _origin_matches(origins.get(owner.id, f"{module}.{owner.id}"), target)
                ):
                    found.append(target.instance)
                elif target.instance is not None and f.attr in objects:
                    found.append(target.instance)
        return found

    # Objects of a replaced class: the names (variables or attributes) they are assigned to.
    instances = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            for target in targets:
                if target.instance is None or target.class_method:
                    continue
                f = node.value.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name != target.name:
                    continue
                for assigned in node.targets:
                    label = (
                        assigned.id
                        if isinstance(assigned, ast.Name)
                        else assigned.attr
                        if isinstance(assigned, ast.Attribute)
                        else None
                    )
                    if label:
                        instances.setdefault(target.name, set()).add(label)

    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        for target in callee(call):
            positional = len([a for a in call.args if not isinstance(a, ast.Starred)])
            complete = not any(isinstance(a, ast.Starred) for a in call.args)
            keywords = set()
            for keyword in call.keywords:
                if keyword.arg is not None:
                    keywords.add(keyword.arg)
                    continue
                value, keys = keyword.value, None
                if isinstance(value, ast.Name) and call in functions:
                    keys = _local_dict_keys(functions[call], value.id)
                elif isinstance(value, ast.Attribute):
                    keys = attribute_keys.get(value.attr)
                if keys is None:
                    complete = False
                else:
                    keywords |= keys
            site = f"{relative}:{call.lineno}"
            label = f"{target.module}.{target.name}"
            report["sites"].setdefault(label, 0)
            report["sites"][label] += 1
            if _binds(target.peer, positional, keywords, complete) is not None:
                continue  # the peer's own function does not take this call either (another branch's callee)
            problem = _binds(target.ours, positional, keywords, complete)
            unpack = _unpacked(parents, call)
            if problem is None and _arity_problem(unpack, target.peer_returns) is None:
                problem = _arity_problem(unpack, target.our_returns)  # what the peer's result fits, ours must
            if problem is not None:
                report["failures"].append(f"{site}: {label}: {problem}")
            report["bound" if complete else "partial"] += 1
