"""Argument parsing for ``python -m grouped_linear``."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``grouped_linear`` parser with its ``demo`` and ``bench`` subcommands."""
    parser = argparse.ArgumentParser(
        prog="python -m grouped_linear",
        description="Grouped linear layers for Mixture-of-Experts models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench}")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="train a small MoE language model on synthetic data and show the loss falling",
        description="Train a small Mixture-of-Experts language model (router -> permute -> "
        "GroupedMLP -> unpermute) on sequences from a random sparse Markov chain.",
    )
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                      help="where to train; 'auto' picks CUDA when available (default: cpu)")
    demo.add_argument("--steps", type=int, default=None,
                      help="optimizer steps (default: 400 on CPU, 1000 on CUDA)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--ep", type=int, default=1,
                      help="expert-parallel CPU processes over gloo (default: 1, no parallelism)")

    bench = sub.add_parser(
        "bench",
        help="measure grouped_linear against dense, per-expert-loop and torch baselines",
        description="Time forward and forward+backward of grouped GEMMs on the packaged MoE "
        "shapes and print TFLOP/s per implementation (--suite gemm), or the pad/unpad and "
        "permute/unpermute ops against copy bandwidth and GroupedMLP against its GEMMs "
        "(--suite layouts), or transformers' experts modules by its grouped_mm and by this "
        "library (--suite transformers), or a whole MoE block, permute -> GroupedMLP -> "
        "unpermute, in bf16 and under each FP8 recipe (--suite moe), or one layer's many "
        "small groups against raw grouped_mm (--suite fine). On CPU the sizes are scaled down.",
    )
    bench.add_argument("--suite", choices=("gemm", "layouts", "transformers", "moe", "fine"),
                       default="gemm",
                       help="gemm: grouped GEMM TFLOP/s (default); layouts: layout ops' GB/s "
                       "and GroupedMLP overhead; transformers: its experts modules; moe: a "
                       "MoE block, bf16 and FP8; fine: many small groups against grouped_mm")
    bench.add_argument("--shapes", default=None,
                       help="comma-separated shape names from shapes.json, or "
                       "uniform:G:M:K:N (G groups of M/G rows, K -> N) (default: all; "
                       "--suite gemm only)")
    bench.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                       help="write every measured number to this JSON file")
    bench.add_argument("--plot", dest="plot_path", default=None, metavar="PATH",
                       help="write a PNG bar chart (needs matplotlib; --suite gemm only)")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where to measure; 'auto' picks CUDA when available (default)")
    bench.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                       help="compute dtype (default: bf16 on CUDA, fp32 on CPU; --suite gemm "
                       "and transformers only)")
    bench.add_argument("--reps", type=int, default=5,
                       help="timed repetitions per case on CPU (default: 5)")
    bench.add_argument("--rounds", type=int, default=None,
                       help="measure each case's columns this many times in alternation and "
                       "report the median (gemm and fine suites, default 1; transformers "
                       "and moe suites, default 3)")
    bench.add_argument("--columns", default=None,
                       help="comma-separated columns to measure (gemm suite; default: all "
                       "available)")
    return parser


#: The suites of whole cases: their module, entry point and default number of rounds.
_SUITES = {
    "transformers": ("bench_transformers", "run_transformers_bench", 3),
    "moe": ("bench_moe", "run_moe_bench", 3),
    "fine": ("bench_fine", "run_fine_bench", 1),
}


def _names(flag: str, value: str | None, parser: argparse.ArgumentParser) -> list[str] | None:
    """A comma-separated option as a list of names (``None`` when not given)."""
    if value is None:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        parser.error(f"{flag} {value!r} names nothing")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code. Bad arguments, including those
    only the commands can judge (unknown shapes or columns, a device that is missing), and a
    suite whose library is not installed end with a usage message and exit code 2 rather
    than a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    json_path = getattr(args, "json_path", None)
    if json_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(json_path))):
        parser.error(f"--json {json_path}: its directory does not exist")
    from ..integrations import MissingDependency

    try:
        return _run(args, parser)
    except (ValueError, MissingDependency) as error:
        parser.error(str(error))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "demo":
        from .demo import run_demo

        if args.steps is not None and args.steps < 1:
            raise SystemExit(f"--steps must be >= 1, got {args.steps}")
        if args.ep < 1:
            raise SystemExit(f"--ep must be >= 1, got {args.ep}")
        run_demo(steps=args.steps, device=args.device, seed=args.seed, ep=args.ep)
        return 0
    if args.reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {args.reps}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.suite == "layouts":
        from .bench_layouts import run_layouts_bench

        given = [flag for flag, value in (("--shapes", args.shapes), ("--plot", args.plot_path),
                                          ("--dtype", args.dtype), ("--columns", args.columns),
                                          ("--rounds", args.rounds))
                 if value is not None]
        if given:
            raise SystemExit(f"{', '.join(given)}: for --suite gemm only")
        run_layouts_bench(device=args.device, json_path=args.json_path, reps=args.reps)
        return 0
    if args.suite in _SUITES:  # the suites of whole cases: none of the gemm suite's flags
        module, function, rounds = _SUITES[args.suite]
        takes_dtype = args.suite == "transformers"
        given = [flag for flag, value in (("--shapes", args.shapes), ("--plot", args.plot_path),
                                          ("--dtype", None if takes_dtype else args.dtype),
                                          ("--columns", args.columns))
                 if value is not None]
        if given:
            raise SystemExit(f"{', '.join(given)}: not for --suite {args.suite}")
        run = getattr(importlib.import_module(f".{module}", __package__), function)
        extra = {"dtype": args.dtype} if takes_dtype and args.dtype is not None else {}
        run(device=args.device, json_path=args.json_path, reps=args.reps,
            rounds=rounds if args.rounds is None else args.rounds, **extra)
        return 0
    from .bench import run_bench

    run_bench(
        shapes=_names("--shapes", args.shapes, parser),
        device=args.device,
        dtype=args.dtype,
        json_path=args.json_path,
        plot_path=args.plot_path,
        reps=args.reps,
        columns=_names("--columns", args.columns, parser),
        rounds=1 if args.rounds is None else args.rounds,
    )
    return 0
