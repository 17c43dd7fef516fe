"""The `turboattn` command: info, demo, bench, eval.

Bad arguments stop the command before any model is loaded or any result written, with one line
on stderr (`turboattn: error: ...`, or argparse's usage line and `error: ...`) and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from .args import ArgumentParser, CLIError, HelpFormatter

# What a missing optional dependency means for the user (module -> extra that brings it).
EXTRAS = {"transformers": "hf", "gguf": "hf", "accelerate": "hf", "rich": "bench", "matplotlib": "bench",
          "triton": "triton"}


def _cmd_info(args) -> int:
    from .info import build_kernels, print_info
    if args.build_kernels:
        return build_kernels()
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
    parser = ArgumentParser(prog="turboattn", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command",
                                help="info, demo, bench, eval (each takes --help)")

    def add(name: str, summary: str, module_doc: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=module_doc or summary, formatter_class=HelpFormatter)

    p = add("info", "versions, device and the table of cache formats")
    p.add_argument("--build-kernels", action="store_true",
                   help="build the CUDA decode kernel now (nvcc, under a minute, once per machine: torch caches "
                        "the build) instead of at the first decode step; `make install` runs this on GPU machines")
    p.set_defaults(func=_cmd_info)

    from . import demo
    p = add("demo", "SmolLM2 answers a prompt with a compressed and with an exact KV cache", demo.__doc__)
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo, parser=p)

    from . import bench
    p = add("bench", "GPU benchmarks (decode, quantize, prefill, ...)", bench.__doc__)
    bench.add_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = add("eval", "model-quality evaluation of cache presets")
    try:
        from . import eval as ev
    except ImportError:  # eval needs the hf extra; `turboattn eval` then says so (_missing_extra)
        ev = None
    if ev is not None:
        p.description = ev.__doc__
        ev.add_arguments(p)
    p.set_defaults(func=_cmd_eval)
    return parser


def _missing_extra(e: ImportError) -> str:
    top = (e.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        raise e  # not an optional dependency: a bug, keep the traceback
    return f"this command needs the {top!r} package: pip install 'turboattn[{extra}]'"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        message = str(e)
    except ImportError as e:
        message = _missing_extra(e)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        # The loaders' own messages say what to install; a plain file error names the file.
        message = str(e) if e.filename is None else f"{e.strerror}: {e.filename}"
    except KeyboardInterrupt:
        print("turboattn: interrupted", file=sys.stderr)
        return 130
    print(f"turboattn: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
