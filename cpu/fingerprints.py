"""Fingerprints of a function's math, the same under every CPython (3.10 to 3.14): what the CPU backend's gate
compares with the math its kernels were written against. Standard library only, so that a test can compute them
under interpreters that have no torch (tests/test_cpu.py).

    fingerprint(function)                     # from its source, as the gate reads it
    fingerprint_in_file("model.py", "Attention.attend")  # the same, from a file, without importing it
"""
import ast
import hashlib
import inspect
import textwrap


def fingerprint(function) -> str:
    """A hash of a function's body as math: its docstring, comments, layout and the names of its locals do not
    count, nor does an alias (`D = hd`) or a tuple assignment split in two (normalized)."""
    return of_tree(ast.parse(textwrap.dedent(inspect.getsource(function))).body[0])


def source_hash(function) -> str:
    """A hash of a function's source text as written: equal to the shipped one's, the source is the shipped one."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(function)).encode()).hexdigest()[:8]


def fingerprint_in_file(path, qualname: str) -> str:
    """fingerprint of the function `qualname` ("Class.method" or "function") defined in the Python file `path`."""
    with open(path, encoding="utf-8") as f:
        node = ast.parse(f.read())
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return of_tree(node)


def of_tree(function: ast.FunctionDef) -> str:
    return hashlib.sha256(canonical(normalized(function)).encode()).hexdigest()[:16]


def canonical(node) -> str:
    """A syntax tree as text that no interpreter's layout changes, where ast.dump's does (3.13 leaves out empty
    fields, 3.12 added type_params): each node's type and its fields by name, sorted, without the empty ones (None,
    []) and without positions."""
    if isinstance(node, ast.AST):
        fields = ((name, getattr(node, name, None)) for name in sorted(node._fields))
        return f"{type(node).__name__}(" + ", ".join(f"{name}={canonical(value)}" for name, value in fields
                                                     if value is not None and value != []) + ")"
    if isinstance(node, list):
        return "[" + ", ".join(canonical(item) for item in node) + "]"
    return repr(node)


def normalized(function: ast.FunctionDef) -> ast.Module:
    """The function's body with `a, b = x, y` split into `a = x; b = y` (where no target is read on the right),
    aliases of one local by another inlined, and locals renamed by order of appearance."""
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    params = [a.arg for a in function.args.posonlyargs + function.args.args + function.args.kwonlyargs]
    split = []
    for node in body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Tuple) and len(node.targets[0].elts) == len(node.value.elts)
                and all(isinstance(t, ast.Name) for t in node.targets[0].elts)
                and not {t.id for t in node.targets[0].elts} & {n.id for n in ast.walk(node.value)
                                                                   if isinstance(n, ast.Name)}):
            split += [ast.Assign(targets=[t], value=v) for t, v in zip(node.targets[0].elts, node.value.elts)]
        else:
            split.append(node)
    tree = ast.Module(body=split, type_ignores=[])
    stores = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            stores[n.id] = stores.get(n.id, 0) + 1
    aliases = {}
    for node in list(tree.body):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Name) and stores[node.targets[0].id] == 1
                and stores.get(node.value.id, 0) <= (0 if node.value.id in params else 1)
                and (node.value.id in params or node.value.id in stores)):
            aliases[node.targets[0].id] = node.value.id
            tree.body.remove(node)
    names = {}
    for name in params:
        names.setdefault(name, f"_{len(names)}")
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            n.id = aliases.get(n.id, n.id)
            if n.id in stores:
                names.setdefault(n.id, f"_{len(names)}")
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id in names:
            n.id = names[n.id]
    return tree
