"""The call trace of one training run, read against the import-linter layers (issue 20's walk criterion).

Runs ``betty_trainer.train`` on a config (default ``configs/quickstart.yaml``, 2 epochs) under ``sys.setprofile`` and
records every Python call between the project's modules. Each module sits in a layer of ``pyproject.toml``'s
import-linter contracts (``betty_trainer``'s layers top to bottom, then ``partition | estimator`` below them all).
Printed:

- **planner entries**: calls into ``betty_trainer/memory/planner.py`` from another module, as distinct
  ``caller → callee`` function pairs (and how many calls each made);
- **upward calls**: calls from a module to one in a higher layer, which imports never do, so each is a callback
  through an object handed down (a block's accessor, a layer's memory terms), as distinct pairs and calls.

Run:
    python benchmarks/call_trace.py
    python benchmarks/call_trace.py --config configs/cora-labor.yaml --set optim.epochs=1
"""

from __future__ import annotations

from common import REPO_ROOT  # this folder

import argparse
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter's own dependency
    import tomli as tomllib

from betty_trainer import load_config, train


def layers_of(pyproject: Path) -> list[tuple[str, ...]]:
    """Module prefixes (paths under the repository) per layer, top first: ``betty_trainer``'s layers, then the
    packages below it."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    layered = [c["layers"] for c in contracts if c.get("type") == "layers"]
    inner = next(layers for layers in layered if layers[0].startswith("betty_trainer."))
    outer = next(layers for layers in layered if layers[0] == "betty_trainer")
    return [tuple(m.strip().replace(".", "/") for m in layer.split("|")) for layer in [*inner, *outer[1:]]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config overrides, after optim.epochs=2")
    args = parser.parse_args()
    layers = layers_of(REPO_ROOT / "pyproject.toml")
    root = f"{REPO_ROOT}/"

    def layer(path: str) -> int | None:
        if not path.startswith(root):
            return None
        relative = path[len(root):]
        return next((index for index, prefixes in enumerate(layers) if relative.startswith(prefixes)), None)

    upward, planner = Counter(), Counter()

    def on_call(frame, event, _arg) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        above, below = layer(caller), layer(callee)
        if above is None or below is None:
            return
        pair = (f"{caller[len(root):]}:{frame.f_back.f_code.co_name}", f"{callee[len(root):]}:{frame.f_code.co_name}")
        if below < above:
            upward[pair] += 1
        if callee.endswith("memory/planner.py") and not caller.endswith("memory/planner.py"):
            planner[pair] += 1

    run_dir = Path(tempfile.mkdtemp(prefix="call-trace-"))
    config = load_config(args.config, ["optim.epochs=2", *args.overrides, f"train.run_dir={run_dir / 'run'}"])
    sys.setprofile(on_call)
    try:
        train(config)
    finally:
        sys.setprofile(None)
        shutil.rmtree(run_dir, ignore_errors=True)
    for title, counts in (("planner entries", planner), ("upward calls", upward)):
        print(f"{title}: {len(counts)} distinct caller → callee pairs, {sum(counts.values())} calls")
        for (caller, callee), calls in counts.most_common():
            print(f"  {calls:5d}  {caller} → {callee}")


if __name__ == "__main__":
    main()
