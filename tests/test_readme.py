"""The README's promises that a test can hold it to."""
import re

from conftest import ROOT


def readme_commands():
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command():
    test_command = next(c.strip() for c in readme_commands() if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_readme_flags_exist():
    from generate import build_parser
    flags = {a for action in build_parser()._actions for a in action.option_strings}
    used = set(re.findall(r"python generate\.py[^\n]*", (ROOT / "README.md").read_text()))
    for line in used:
        for flag in re.findall(r"(--\w+)", line):
            assert flag in flags, flag


LIBRARY = ("cli", "checkpoint", "model", "mx", "quantize", "tp", "ranks", "speculative", "tokenizer", "backend", "loading",
           "decoding", "chat", "cpu", "cpu.kernels", "cpu.huge_pages", "gpu")  # gpu_kernels: imported where Triton is
PROJECT = LIBRARY + ("generate",)


def project_imports(module: str):
    """(top-level imports, imports inside functions) of a project module, as project module names."""
    import ast
    path = ROOT / (module.replace(".", "/") + ("/__init__.py" if module == "cpu" else ".py"))
    top, inner = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found = {n for n in names if n in PROJECT or n in (p.stem for p in (ROOT / "scripts").glob("*.py"))}
            (top if node.col_offset == 0 else inner).update(found)
    return top, inner


def test_imports_run_one_way():
    """Library modules never import generate.py (the CLI) or a script, no project module is imported inside a
    function (as done once to dodge a cycle), and the imports between project modules have no cycle."""
    graph = {}
    for module in PROJECT:
        top, inner = project_imports(module)
        assert not inner, (module, inner)
        assert module == "generate" or not top & ({"generate"} | {p.stem for p in (ROOT / "scripts").glob("*.py")}), \
            (module, top)
        graph[module] = top - {module}
    done, path = set(), []

    def visit(node):
        assert node not in path, path + [node]
        if node not in done:
            path.append(node)
            for other in graph.get(node, ()):
                visit(other)
            path.pop()
            done.add(node)
    for module in graph:
        visit(module)


def test_only_the_cli_s_own_tests_import_the_cli():
    """generate.py is the CLI: library modules, scripts and tests import the library (loading, decoding, ...); only
    the tests of the CLI itself (its flags, errors and output) import it."""
    importers = []
    for path in [*ROOT.glob("*.py"), *ROOT.glob("cpu/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("tests/*.py")]:
        if re.search(r"^\s*(import generate\b|from generate import)", path.read_text(), re.M):
            importers.append(path.relative_to(ROOT).as_posix())
    assert sorted(importers) == ["tests/test_chat.py", "tests/test_cli.py", "tests/test_generate.py",
                                 "tests/test_readme.py"], importers


def test_model_py_imports_torch_and_the_standard_library_only():
    import ast
    import sys
    tree = ast.parse((ROOT / "model.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert all(r == "torch" or r in sys.stdlib_module_names for r in roots), roots


# What the backends keep in their modules; outside them, callers read backend.report(model).
BACKEND_INTERNALS = {"layout", "factors", "table", "packed", "RowsLinear", "TinyGemmInt4Linear", "served_ops"}


def test_callers_read_the_backend_s_report_not_its_attributes():
    """The loop, the loader, the drafter, tensor parallelism, the CLI and the scripts learn what a backend did from
    its report (backend.Report), never by probing its modules: no attribute, name or string of a backend's internals
    in their code (comments and docstrings aside), and no hasattr / getattr on a model or a drafter."""
    import ast
    for name in ("decoding.py", "loading.py", "speculative.py", "tp.py", "generate.py", "backend.py", "model.py",
                 "scripts/bench.py", "scripts/bench_load.py", "scripts/eval_ppl.py"):
        found = []
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            words = {getattr(node, "attr", None), getattr(node, "id", None)}
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr"):
                target = node.args[0]
                words.add(getattr(target, "id", None) in ("model", "m", "drafter", "transformer") and "probe")
                words.update(a.value for a in node.args[1:] if isinstance(a, ast.Constant))
            found += sorted(w for w in words & (BACKEND_INTERNALS | {"probe"}))
        assert not found, (name, found)


def test_the_longest_verify_is_defined_once():
    """backend.LONGEST_VERIFY is the one definition of the longest verify (K + 1 tokens a row): no other module of
    the project assigns a verify limit, a largest K or a number of rows to check from a number of its own."""
    import ast
    limits = re.compile(r"(verify|k_max|most_rows|max_k|longest)", re.IGNORECASE)
    found = []
    for path in sorted(ROOT.glob("*.py")) + sorted(ROOT.glob("cpu/*.py")) + sorted(ROOT.glob("scripts/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if limits.search(name) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int) \
                        and not isinstance(node.value.value, bool):
                    found.append(f"{path.relative_to(ROOT)}: {name} = {node.value.value}")
    assert found == ["backend.py: LONGEST_VERIFY = 17"], found


def test_a_format_is_its_record_its_kernels_and_its_tests():
    """A weight format is declared once, by its record in quantize.py (Format: its mode, the code the kernels switch on,
    its module with the reference forward, its MX elements from mx.py). Adding one touches quantize.py, its CPU kernel
    and layout (cpu/few_rows/) and its Triton kernel (gpu_kernels.py), and its tests: no other module of the library
    names a format's class or mode, nor switches on a format code but through the record."""
    import ast
    classes = {"Int8Linear", "Int4Linear", "Int4kLinear", "MXLinear", "MX_MODES", "INT8", "INT4", "INT4K", "MX"}
    modes = {"int8", "int4", "int4k", "mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4", "mxint8"}
    formats = {"quantize.py", "mx.py", "gpu_kernels.py"}
    found = []
    for path in sorted(ROOT.glob("*.py")) + sorted(ROOT.glob("cpu/*.py")):
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            words = {getattr(node, "attr", None), getattr(node, "id", None)} & classes if name not in formats else set()
            if isinstance(node, ast.Constant) and node.value in modes and name not in formats:
                words.add(node.value)
            found += [f"{name}: {w}" for w in sorted(words)]
    # a draft's default form: int4 where a backend serves it; tinygemm serves int4 alone on CUDA (--backend aten)
    assert found == ["gpu.py: Int4Linear", "gpu.py: Int4Linear", "loading.py: int4"], found
