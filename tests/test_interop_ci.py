"""CI really runs the DGL interop tests: the README command deselects them, `.ci/run` runs them through `.ci/dgl` in
the DGL environment, and run where DGL is missing they skip, unless under CI, where they fail."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_ci_runs_the_dgl_tests_in_the_dgl_environment():
    assert "bash .ci/dgl" in (REPO / ".ci" / "run").read_text().splitlines()
    script = (REPO / ".ci" / "dgl").read_text()
    assert 'BETTY_DGL_ENV=1 "$VENV/bin/python" -m pytest -p no:cacheprovider -m dgl tests/test_interop_dgl.py' in script
    assert "set -euo pipefail" in script  # a failed build, install or test run fails CI (pytest's 5: none ran)


def run_dgl_tests(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "BETTY_DGL_ENV")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args,
                           "tests/test_interop_dgl.py"], cwd=REPO, env={**clean, **env}, capture_output=True, text=True)


@pytest.mark.skipif(importlib.util.find_spec("dgl") is not None, reason="checks the environment without DGL")
def test_without_dgl_the_dgl_tests_are_deselected_skipped_or_failed_under_ci():
    deselected = run_dgl_tests()  # the README command: none of them runs
    assert deselected.returncode == 5 and re.search(r"^(\d+) deselected", deselected.stdout, re.M)
    count = re.search(r"^(\d+) deselected", deselected.stdout, re.M).group(1)
    skipped = run_dgl_tests("-m", "dgl")
    assert skipped.returncode == 0 and re.search(rf"^{count} skipped in", skipped.stdout, re.M)
    for env in ({"CI": "1"}, {"BETTY_DGL_ENV": "1"}):
        failed = run_dgl_tests("-m", "dgl", **env)
        assert failed.returncode == 1 and re.search(rf"^{count} errors in", failed.stdout, re.M)
        assert "bash .ci/dgl" in failed.stdout
