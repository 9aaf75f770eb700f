"""The ``betty-train`` command line: ``train``, ``evaluate``, ``predict``, ``plan``, ``validate``, ``datasets``.

Every :class:`~betty_trainer.errors.BettyError` is caught here once and printed as
one line (``error: …``) with exit status 2; no traceback reaches the user. ``logging``
is configured here (``--log-level``): messages of betty-trainer's modules (re-plans,
calibration, warnings) go to stderr as ``level: message`` lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table

from betty_trainer.config import Config, load_config
from betty_trainer.datasets import cache_dir, list_datasets
from betty_trainer.errors import BettyError, ConfigError
from betty_trainer.training.checkpoint import LAST_NAME
from betty_trainer.training.rundir import refuse_run_file, write_text

EXIT_USER_ERROR = 2
LOG_LEVELS = ("debug", "info", "warning", "error")
_PACKAGES = ("betty_trainer", "partition", "estimator")


class _IntermixedParser(argparse.ArgumentParser):
    """A subcommand's parser that takes its positionals (the ``key.path=value`` overrides) between its
    options too (``train --config c.yaml optim.epochs=1 --overwrite train.run_dir=runs/c``): argparse's
    plain parse stops collecting a ``nargs="*"`` positional at the first option after it."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._inner:  # parse_known_intermixed_args calls back here for each of its two passes
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="betty-train",
        description="Train GNNs with memory-fitting micro-batches (REG partitioning, Betty).",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_IntermixedParser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="messages shown on stderr (default warning; info adds planning and calibration)")

    def add_config_args(sub: argparse.ArgumentParser, required: bool) -> None:
        sub.add_argument("--config", type=Path, required=required, help="YAML config file (see configs/)")
        sub.add_argument("overrides", nargs="*", metavar="key.path=value",
                         help="override config keys, e.g. optim.lr=0.005")
        sub.add_argument("--data-dir", type=Path, help="folder holding the dataset's raw files (sets dataset.data_dir)")
        sub.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")

    train = commands.add_parser("train", help="train a model", parents=[common])
    add_config_args(train, required=False)
    train.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue the run in RUN_DIR from its last.pt")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run train.run_dir already holds (default: refuse)")
    evaluate = commands.add_parser("evaluate", help="accuracy of a finished run's checkpoint", parents=[common])
    evaluate.add_argument("--run", type=Path, required=True, metavar="RUN_DIR", help="the run directory")
    evaluate.add_argument("--checkpoint", choices=("best", "last"), default="best",
                          help="best.pt (chosen on validation; default) or last.pt")
    evaluate.add_argument("--split", choices=("val", "test", "all"), default="test", help="nodes to evaluate on")
    moved = "folder holding the dataset's raw files, if not where the run found them (its dataset.data_dir)"
    evaluate.add_argument("--data-dir", type=Path, help=moved)
    predict = commands.add_parser("predict", help="write every node's predicted class and probabilities",
                                  parents=[common])
    predict.add_argument("--run", type=Path, required=True, metavar="RUN_DIR", help="the run directory")
    predict.add_argument("--output", type=Path, required=True, metavar="FILE",
                         help="a .pt, .csv or .parquet file (one row per node)")
    predict.add_argument("--checkpoint", choices=("best", "last"), default="best", help="best.pt (default) or last.pt")
    predict.add_argument("--data-dir", type=Path, help=moved)
    plan = commands.add_parser("plan", help="plan the first batch's micro-batches and their memory; no training",
                               parents=[common])
    add_config_args(plan, required=True)
    plan.add_argument("--measure", action="store_true", help="also run one step per micro-batch and measure its peak")
    plan.add_argument("--output", type=Path, default=None,
                      help="also write the plan as JSON to this file (default: not written)")
    validate = commands.add_parser("validate", help="check a config as train would, before loading data",
                                   parents=[common])
    add_config_args(validate, required=True)
    datasets = commands.add_parser("datasets", help="list known datasets and where their files are", parents=[common])
    datasets.add_argument("--data-dir", type=Path,
                          help="folder to look for the raw files in (as train's --data-dir; else $BETTY_DATA_DIR)")
    return parser


class _StderrHandler(logging.Handler):
    """Writes ``level: message`` to the current ``sys.stderr`` (looked up at every record, so a test's
    captured stream works too)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"{record.levelname.lower()}: {record.getMessage()}\n")
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


def configure_logging(level: str) -> list[tuple[logging.Logger, int, list[logging.Handler]]]:
    """Send the records of betty-trainer's packages at ``level`` and above to stderr.

    Returns:
        What to give :func:`restore_logging` to undo it (``main`` does, so calling it in a process leaves
        logging as it was).
    """
    saved = []
    for name in _PACKAGES:
        package = logging.getLogger(name)
        saved.append((package, package.level, list(package.handlers)))
        package.setLevel(level.upper())
        package.handlers = [h for h in package.handlers if not isinstance(h, _StderrHandler)] + [_StderrHandler()]
    return saved


def restore_logging(saved: list[tuple[logging.Logger, int, list[logging.Handler]]]) -> None:
    """Undo :func:`configure_logging`."""
    for package, level, handlers in saved:
        package.setLevel(level)
        package.handlers = handlers


def _resolve(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.data_dir is not None:
        overrides.append(f"dataset.data_dir={args.data_dir}")
    if getattr(args, "resume", None) is not None:
        if args.config is not None:
            raise ConfigError("--resume reads the run's own config.yaml; pass overrides, not --config")
        saved = args.resume / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"{args.resume} is not a run directory (no config.yaml)")
        return load_config(saved, overrides)
    if args.config is None:
        raise ConfigError("train needs --config FILE (try configs/quickstart.yaml) or --resume RUN_DIR")
    return load_config(args.config, overrides)


def _train(args: argparse.Namespace, console: Console) -> None:
    from betty_trainer.training.trainer import train  # heavy imports only when training

    config = _resolve(args)
    if args.print_config:
        print(config.to_yaml(), end="")
        return
    result = train(config, run_dir=args.resume, resume=args.resume is not None, overwrite=args.overwrite,
                   command=["betty-train", *sys.argv[1:]] if args.argv is None else ["betty-train", *args.argv],
                   console=console)
    last = "-" if result.last.test_acc is None else f"{result.last.test_acc:.4f}"
    console.print(
        f"final test accuracy {result.test_acc:.4f} (model chosen on validation: epoch {result.best_epoch}, "
        f"val {result.best_val_acc:.4f}; best.pt); last epoch test {last} (last.pt); run dir {result.run_dir}",
        highlight=False, soft_wrap=True,
    )


def _evaluate(args: argparse.Namespace, console: Console) -> None:
    from betty_trainer.training.inference import evaluate_run

    run, accuracy = evaluate_run(args.run, args.checkpoint, args.split, data_dir=args.data_dir)
    shown = "; ".join(f"{name} accuracy {value:.4f}" for name, value in accuracy.items())
    console.print(f"{shown} ({args.checkpoint}.pt, epoch {run.epoch}; run dir {args.run})", highlight=False,
                  soft_wrap=True)


def _predict(args: argparse.Namespace, console: Console) -> None:
    from betty_trainer.training.inference import predict_run

    path = predict_run(args.run, args.output, args.checkpoint, data_dir=args.data_dir)
    console.print(f"predictions of {args.checkpoint}.pt for every node written to {path}", highlight=False,
                  soft_wrap=True)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def _plan(args: argparse.Namespace, console: Console) -> None:
    from betty_trainer.training.dry_run import dry_run

    config = _resolve(args)
    if args.print_config:
        print(config.to_yaml(), end="")
        return
    output = args.output
    if output is not None and output.is_dir():
        raise ConfigError(f"--output {output} is a folder; give a file name such as {output / 'plan.json'}")
    if output is not None:
        refuse_run_file(output)
    if output is not None and not output.parent.is_dir():
        raise ConfigError(f"--output {output}: folder {output.parent} does not exist; create it or choose another "
                          "--output")
    report = dry_run(config, measure=args.measure)
    if output is not None and _rank() in (None, 0):  # under torchrun every rank holds the report; rank 0 writes it
        write_text(output, json.dumps(report, indent=2))
    _print_plan(console, report, args)


def _print_plan(console: Console, report: dict, args: argparse.Namespace) -> None:
    """The plan as one table, a row per piece (a micro-batch, chunk ``i`` of every layer, or a cooperative round),
    whatever the plan's kind, and a line of what was searched and estimated for the whole step; a distributed
    run's plan as one such table per rank."""
    for part in report.get("ranks") or [report]:
        _print_piece_table(console, {**report, **part}, args)
    draw = report.get("sampling")
    if draw is not None:
        chosen = (f"the most of the epoch's batches under sampling.bulk_memory {_mib(draw['bulk_memory'])} MiB"
                  if draw["bulk_memory"] is not None else "sampling.bulk")
        where = "in host memory"
        if draw["device_bytes"]:
            where = (f"on the GPU, with the graph structure's {_mib(draw['structure_bytes'])} MiB there"
                     + (", taken off the step's budget" if report["memory_terms"]["sampler_bytes"] else ""))
        batches = f"{draw['bulk']} batch{'es' if draw['bulk'] != 1 else ''} of {draw['batch_size']} seeds"
        console.print(f"bulk sampling: {batches} a draw ({chosen}), at most {_mib(draw['draw_bytes'])} MiB {where}",
                      highlight=False, soft_wrap=True)
    cache = report.get("aggregation_cache")
    if cache is not None:
        use = ("layer 0 reads the cached rows of its dst nodes" if cache["used"] else
               "micro_batch.mode=auto left it out, estimated better without it")
        console.print(f"aggregation cache ({cache['kind']}, {str(cache['mode']).lower()}): {_mib(cache['host_bytes'])} "
                      f"MiB in host memory ({cache['row_width']} columns a node, {cache['path']}), "
                      f"{_mib(cache['device_bytes'])} MiB on the device; {use}. "
                      f"Without it: {_uncached_text(cache['uncached'])}", highlight=False, soft_wrap=True)


def _uncached_text(uncached: dict) -> str:
    """The plan of the batch without the aggregation cache, in words (``aggregation_cache.uncached``)."""
    if "refused" in uncached:
        return f"no plan fits ({uncached['refused']})"
    sizes = " / ".join(str(layer["src_nodes"]) for layer in uncached["layers"])
    return (f"{uncached['summary']}, src nodes per layer {sizes}, estimated peak "
            f"{_mib(uncached['estimate_peak_bytes'] or 0)} MiB (full batch "
            f"{_mib(uncached['full_batch_estimate_bytes'] or 0)} MiB), estimated work {uncached['work']:,}")


def _print_piece_table(console: Console, report: dict, args: argparse.Namespace) -> None:
    budget, rows = report["budget_bytes"], report["pieces"]
    rank = f"rank {report['rank']} of {report['world_size']}, " if "rank" in report else ""
    table = Table(title=f"plan: {report['dataset']}, {rank}{report['summary']} ({report['partitioner']}), sizes in MiB")
    shown = _nonzero_components(report)
    measured = any("measured_peak_bytes" in row for row in rows)
    columns = ["#", "outputs", "src nodes/layer", "edges/layer", *(_COMPONENTS[name] for name in shown),
               "params+opt", "other", "est. peak", "budget"]
    if measured:
        columns += ["measured", "error"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        sizes = [str(row["piece"]), str(row["outputs"]),
                 " / ".join(str(layer["src_nodes"]) for layer in row["layers"]),
                 " / ".join(str(layer["edges"]) for layer in row["layers"])]
        if "estimate" in row:
            at_peak, peak = row["estimate"]["at_peak"], row["estimate"]["peak_bytes"]
            state = at_peak.get("parameters", 0) + at_peak.get("optimizer_state", 0)
            other = peak - state - sum(at_peak.get(name, 0) for name in _COMPONENTS)
            memory = [*(_mib(at_peak[name]) for name in shown), _mib(state), _mib(other), _mib(peak),
                      f"{peak / budget:.0%}" if budget else "-"]
        else:
            memory = ["-"] * (len(shown) + 4)
        cells = sizes + memory
        if measured:
            cells += [_mib(row["measured_peak_bytes"]) if "measured_peak_bytes" in row else "-",
                      f"{row['error']:+.1%}" if "error" in row else "-"]
        table.add_row(*cells)
    Console(width=max(console.width, 160), quiet=console.quiet).print(table)
    redundancy = " / ".join(f"{r:.3f}" for r in report["redundancy_per_layer"])
    full, peak = report["full_batch"]["estimate_peak_bytes"], report["estimate_peak_bytes"]
    step = (f"; measured {_mib(report['measured_peak_bytes'])} MiB"
            f"{' (' + format(report['error'], '+.1%') + ')' if 'error' in report else ''}"
            if "measured_peak_bytes" in report else "")
    console.print(f"budget {_budget_text(report)}; full batch estimate "
                  f"{_mib(full) + ' MiB' if full else 'not computed'}; estimated peak "
                  f"{_mib(peak) + ' MiB' if peak else '-'}{step}; estimated work {report['work']:,}; "
                  f"K = {report['num_pieces']} (tried {[t['k'] for t in report['tried']]}); "
                  f"redundancy per layer {redundancy}; the plan holds {_mib(report['plan_host_bytes'])} MiB of host "
                  f"memory{_kept_transposes(report)}; planning took {report['planning_seconds']:.3f} s"
                  f"{_written(args.output)}", highlight=False, soft_wrap=True)


def _kept_transposes(report: dict) -> str:
    """The plan summary's words on the transposes its blocks keep (``micro_batch.keep_transposes``), or nothing."""
    kept = report.get("kept_transpose_bytes", 0)
    return f" and its blocks keep transposes, {_mib(kept)} MiB (in the estimate)" if kept else ""


_COMPONENTS = {"input_features": "features", "hidden_outputs": "hidden", "dropout_masks": "dropout",
               "aggregator_intermediates": "aggr.", "gradients": "grads", "exchange_buffers": "exchange"}
"""The estimate's terms the plan table shows (``at_peak`` keys → column headers)."""


def _nonzero_components(report: dict) -> list[str]:
    """The :data:`_COMPONENTS` some piece's estimate holds (a model without dropout has no dropout column)."""
    rows = [row["estimate"]["at_peak"] for row in report["pieces"] if "estimate" in row]
    return [name for name in _COMPONENTS if any(at_peak.get(name, 0) for at_peak in rows)]


def _written(output: Path | None) -> str:
    return f"; written to {output}" if output is not None else ""


def _budget_text(report: dict) -> str:
    """The plan's budget for a training step, term by term (``memory_terms``: the configured or free device memory,
    the allocator's margin, the feature store's device bytes, a bulk sampler's device bytes), and what every estimate
    holds resident."""
    terms = report["memory_terms"]
    resident = (f"resident in every estimate: parameters {_mib(terms['parameters'])} MiB, optimizer state "
                f"{_mib(terms['optimizer_state'])} MiB, device_workspace {_mib(terms['device_workspace'])} MiB")
    if terms["step_bytes"] is None:
        return f"none (micro_batch.num_micro_batches); {resident}"
    if terms["budget"] == "auto":
        source = (f"NVML free {_mib(terms['nvml_free'])} MiB + held by this process "
                  f"{_mib(terms['process_reserved'])} MiB")
    else:
        source = f"micro_batch.budget {_mib(terms['device_bytes'])} MiB"
    allocator = terms["allocator"] or ("PyTorch's default allocator" if report.get("device", "cpu") != "cpu" else "cpu")
    return (f"{_mib(terms['step_bytes'])} MiB per step = {source} − allocator margin "
            f"{_mib(terms['allocator_margin'])} MiB ({allocator}) − feature store {_mib(terms['feature_store_bytes'])} "
            f"MiB (node cache, staged macro-batch) − sampler {_mib(terms['sampler_bytes'])} MiB (bulk draw on the GPU); "
            f"{resident}")


def _validate(args: argparse.Namespace, console: Console) -> None:
    from betty_trainer.training.preflight import check_config

    config = _resolve(args)
    if args.print_config:
        print(config.to_yaml(), end="")
        return
    checked = check_config(config, strict_device=False)
    console.print(f"{args.config}: well-formed; checked as train would before loading data: {', '.join(checked)}",
                  highlight=False, soft_wrap=True)


def _datasets(args: argparse.Namespace, console: Console) -> None:
    table = Table(title=f"datasets (cache: {cache_dir()})")
    for column in ("name", "kind", "description", "raw files", "converted"):
        table.add_column(column)
    for status in list_datasets(args.data_dir):
        converted = "\n".join(f"{folder.name}: {size / 2**20:.0f} MiB" for folder, size in status.processed)
        kind = f"{status.kind}, structure only" if status.structure_only else status.kind
        table.add_row(status.name, kind, status.description, status.raw, converted or "-")
    Console(width=max(console.width, 160), quiet=console.quiet).print(table)
    console.print("Files are read from --data-dir, else $BETTY_DATA_DIR, else the cache (downloaded when online).")
    console.print("Datasets marked structure only have no labels or splits: they serve the sampling benchmarks "
                  "(python benchmarks/sampling.py --graph NAME) and the Python API, not train or plan.",
                  highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``betty-train``; returns the exit status. Under ``torchrun`` (``RANK`` set) every process
    runs it: rank 0 prints and logs at ``--log-level``; the others print nothing but errors (``error: rank N: …``)."""
    args = _parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    saved = configure_logging(args.log_level if _rank() in (None, 0) else "error")
    try:
        return _run(args)
    finally:
        restore_logging(saved)


def _rank() -> int | None:
    """This process's rank when a launcher (``torchrun``) started several, else ``None``."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
    return int(rank) if rank is not None and rank.isdigit() and world.isdigit() and int(world) > 1 else None


def _run(args: argparse.Namespace) -> int:
    rank = _rank()
    console = Console(quiet=rank not in (None, 0))
    command = {"train": _train, "evaluate": _evaluate, "predict": _predict, "plan": _plan, "validate": _validate,
               "datasets": _datasets}[args.command]
    try:
        command(args, console)
    except BettyError as error:
        named = "" if rank is None or f"rank {rank}:" in str(error) else f"rank {rank}: "
        print(f"error: {named}{error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as error:
        if rank in (None, 0):  # under torchrun every rank is interrupted; rank 0 says it once
            print(_interrupted(args.command, getattr(error, "run_dir", None)), file=sys.stderr)
        return 130
    return 0


def _interrupted(command: str, run_dir: Path | None) -> str:
    """The line printed on Ctrl-C. ``train`` attaches its run directory to the ``KeyboardInterrupt`` as
    ``run_dir`` once it has one; a resume needs that directory's ``last.pt`` and, for a run of several processes,
    as many processes again (:func:`_launcher`)."""
    if command != "train":
        return "interrupted"
    if run_dir is None:
        return "interrupted before the run wrote its first checkpoint (last.pt); nothing to resume: start the run again"
    if not (Path(run_dir) / LAST_NAME).is_file():
        return (f"interrupted before the first epoch's checkpoint; nothing to resume in {shlex.quote(str(run_dir))}: "
                "start the run again")
    return f"interrupted; continue with: {_launcher()} train --resume {shlex.quote(str(run_dir))}"


def _launcher() -> str:
    """How this command was started: ``betty-train``, or under ``torchrun`` the ``torchrun`` line that starts as many
    processes (per node, and as many nodes) again."""
    if _rank() is None:
        return "betty-train"
    world = int(os.environ["WORLD_SIZE"])
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(local) if local.isdigit() and int(local) > 0 else world
    if per_node >= world:
        return f"torchrun --nproc-per-node {world} -m betty_trainer"
    return (f"torchrun --nnodes {world // per_node} --nproc-per-node {per_node} --rdzv-backend c10d --rdzv-endpoint "
            "HOST:PORT -m betty_trainer")


if __name__ == "__main__":
    sys.exit(main())
