"""The process-wide settings ``import betty_trainer`` makes (betty_trainer/process.py), each in a fresh interpreter:
the OpenMP wait policy, and huge pages for torch's CPU allocator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from betty_trainer.process import HUGE_PAGES, WAIT_POLICY

_PAGE_FAULTS = """
import resource, sys
import torch
if sys.argv[1] == "betty":
    import betty_trainer  # noqa: F401
import os
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(2**23).fill_(1.0)  # 32 MiB, written and freed: what a step does with its large tensors
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(env: dict, importing: str) -> tuple[str, int]:
    result = subprocess.run([sys.executable, "-c", _PAGE_FAULTS, importing], env=env, capture_output=True, text=True,
                            check=True)
    setting, faults = result.stdout.split()
    return setting, int(faults)


def test_importing_betty_trainer_asks_torch_for_huge_pages_unless_the_user_chose():
    env = {key: value for key, value in os.environ.items() if key != HUGE_PAGES}
    setting, faults = _page_faults(env, "betty")
    assert setting == "1"
    kept, default_faults = _page_faults({**env, HUGE_PAGES: "0"}, "betty")
    assert kept == "0", "the user's setting is kept"
    _, plain_faults = _page_faults(env, "torch only")
    # 10 × 32 MiB in 4 KiB pages is 81,920 faults; in 2 MiB pages 160 (the kernel may fall back to small pages
    # for a few). Where the kernel offers no transparent huge pages the setting can change nothing.
    assert plain_faults >= 10 * 8192 and default_faults >= 10 * 8192
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" not in thp.read_text():
        assert faults < plain_faults / 10, (faults, plain_faults)


_WAIT_POLICY = """
import logging, sys
if sys.argv[1] == "torch first":
    import torch  # noqa: F401
import os
import betty_trainer
from betty_trainer.process import warn_spinning_openmp
logging.basicConfig(level=logging.WARNING, format="%(message)s")
warn_spinning_openmp()
warn_spinning_openmp()  # once per process
print(os.environ.get("OMP_WAIT_POLICY"))
"""


def _wait_policy(env: dict, order: str) -> tuple[str, str]:
    result = subprocess.run([sys.executable, "-c", _WAIT_POLICY, order], env=env, capture_output=True, text=True,
                            check=True)
    return result.stdout.strip(), result.stderr


def test_importing_betty_trainer_first_lets_openmp_threads_sleep_and_torch_first_is_warned_once():
    env = {key: value for key, value in os.environ.items() if key != WAIT_POLICY}
    policy, warned = _wait_policy(env, "betty first")
    assert policy == "PASSIVE" and "OMP_WAIT_POLICY" not in warned
    policy, warned = _wait_policy(env, "torch first")
    assert policy == "PASSIVE"  # for numba's runtime, which loads later; torch's loaded with the default
    assert warned.count("torch was imported before betty_trainer") == 1, warned
    policy, warned = _wait_policy({**env, WAIT_POLICY: "ACTIVE"}, "torch first")
    assert policy == "ACTIVE", "the user's setting is kept"
    assert "torch was imported before betty_trainer" not in warned, "a chosen policy is not warned about"
