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


LIBRARY = ("cli", "checkpoint", "model", "mx", "sampling", "quantize", "tp", "speculative", "tokenizer", "cpu",
           "cpu.kernels", "cpu.modules", "cpu.threads", "gpu")
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
