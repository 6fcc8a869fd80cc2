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
