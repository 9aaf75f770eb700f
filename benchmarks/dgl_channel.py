"""The JSON-lines channel between a benchmark (betty's environment) and its DGL side (DGL's environment).

DGL needs torch ≤ 2.2, so its side runs as a subprocess with DGL's own Python. The driver sends one
``{"op": ..., **arguments}`` line per command; the side answers ``{"ok": true, **result}`` or
``{"ok": false, "error": "..."}``; ``{"op": "quit"}`` ends it and ``{"op": "hello"}`` returns the versions
and thread count. Imports only the standard library, torch and ``common`` (this folder; the standard library at
its top), so both environments can load it.
"""

from __future__ import annotations

from common import REPO_ROOT  # this folder

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# The DGL environment `.ci/dgl` builds or reuses (torch 2.2.1, dgl 2.1.0): every benchmark's --dgl-python default.
DGL_VENV = Path(os.environ.get("BETTY_DGL_VENV", Path.home() / ".cache" / "betty-trainer" / "dgl-venv"))
DEFAULT_DGL_PYTHON = DGL_VENV / "bin" / "python"


def serve(side) -> None:
    """Answer commands from stdin with ``side``'s methods (``side.dgl`` is the imported DGL module). What DGL
    or the profiler prints goes to stderr, not into the answers."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    threads = int(os.environ.get("BENCH_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        try:
            if op == "hello":
                result = {"dgl": side.dgl.__version__, "torch": torch.__version__, "threads": torch.get_num_threads()}
            else:
                result = getattr(side, op)(**command)
            reply = {"ok": True, **result}
        except Exception as error:  # noqa: BLE001 - reported to the driver, which stops with it
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()


class DGLProcess:
    """A benchmark's DGL side, started as ``python script *arguments`` in DGL's environment and driven
    over JSON lines; its stderr goes to ``log``."""

    def __init__(self, python: str, script: Path, arguments: list[str], threads: int, log: Path):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "BENCH_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
        env.pop("PYTHONPATH", None)
        self.log = log
        self.process = subprocess.Popen([python, str(script), *arguments], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=REPO_ROOT)

    def __call__(self, op: str, **arguments) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the DGL side exited during {op!r}; its stderr ends with:\n{self.log.read_text()[-2000:]}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise SystemExit(f"the DGL side failed in {op!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)
