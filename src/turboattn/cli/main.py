"""The `turboattn` command: info, demo, bench, eval."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args) -> int:
    from .info import print_info
    print_info()
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args)


def _cmd_bench(args) -> int:
    from .bench import run_bench
    return run_bench(args)


def _cmd_eval(args) -> int:
    from .eval import run_eval
    return run_eval(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turboattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, device and the table of cache formats")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="the main demo")
    from .demo import add_arguments as demo_args
    demo_args(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="GPU benchmarks (decode, quantize, prefill)")
    from .bench import add_arguments as bench_args
    bench_args(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("eval", help="model-quality evaluation of cache presets")
    try:
        from .eval import add_arguments as eval_args
    except ImportError:  # evaluate needs the hf extra
        eval_args = None
    if eval_args is not None:
        eval_args(p)
    p.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
