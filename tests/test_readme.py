"""The README's promises: its Python example runs, and CI runs its test command."""

from __future__ import annotations

import re

from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_python_example_runs(tmp_path, monkeypatch, capsys):
    (example,) = code_blocks("python")
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
    assert re.search(r"test accuracy 0\.\d+ \(best validation epoch \d+\)", capsys.readouterr().out)


def test_ci_runs_the_readme_test_command():
    commands = [line for block in code_blocks("bash") for line in block.splitlines() if "pytest" in line]
    assert len(commands) == 1
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert commands[0] in ci
