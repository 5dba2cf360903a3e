"""Command line of tf_ttemb: `python -m tf_ttemb <command> [options]`.

Commands:
  demo   measure what tf_ttemb buys on this machine (time, memory, plots)
  bench  the op benchmarks: time of the fused ops against plain TensorFlow (table, JSON)
  info   versions, build flags and ABI, CUDA, registered kernels per device, devices

Each command is a module exposing `add_arguments(parser)` and `main(args) -> int`,
registered in `COMMANDS`; `python -m tf_ttemb <command> --help` lists its options.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Keep TensorFlow's C++ start-up chatter (INFO and WARNING lines) out of the commands'
# output; errors still show. A value the user set wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from typing import Dict, Optional, Sequence, Tuple

# command name -> (module under tf_ttemb, one-line help). A command's module is imported
# only when that command runs.
COMMANDS: Dict[str, Tuple[str, str]] = {
    "demo": (
        "tf_ttemb.demo",
        "measure what tf_ttemb buys on this machine: time and peak memory against plain "
        "TensorFlow, a correctness check, a scaling sweep and plots",
    ),
    "bench": (
        "tf_ttemb.bench",
        "time the ops (gather_reduce_sum, TT rows, TT bags and their fused SGD step, PKM "
        "lookup; forward and forward+backward, per call and in graph) against plain "
        "TensorFlow and torch, at model-shaped presets (dlrm, pkm, fbtt): tables and JSON",
    ),
    "info": (
        "tf_ttemb.info",
        "versions (tf_ttemb, TensorFlow running and built against), compiler flags and ABI, "
        "CUDA kernels, the registered kernels per device of every op, visible devices",
    ),
}

_DESCRIPTION = "tf_ttemb: a fused EmbeddingBag op (and more) for TensorFlow and Keras 3."
_EPILOG = """examples:
  python -m tf_ttemb demo                    # about 6-8 minutes on 2 CPU cores
  python -m tf_ttemb demo --quick --out /tmp/demo
  python -m tf_ttemb bench --quick           # under a minute; a few minutes without
  python -m tf_ttemb bench --json bench.json
  python -m tf_ttemb bench --preset dlrm,pkm,fbtt --device GPU:0
  python -m tf_ttemb info
  python -m tf_ttemb <command> --help"""


def build_parser() -> Tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The top-level parser and its subparsers (commands add their options lazily)."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_ttemb",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="command")
    commands.required = True
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, description=help_text)
    return parser, commands


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses `argv` (default: `sys.argv[1:]`), runs the command, returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = build_parser()
    # Parse the command name first, so only the chosen command's module (which imports
    # TensorFlow) is loaded, then parse again with its options.
    known, _ = parser.parse_known_args(argv[:1] if argv and argv[0] in COMMANDS else argv)
    module = importlib.import_module(COMMANDS[known.command][0])
    module.add_arguments(commands.choices[known.command])
    args = parser.parse_args(argv)
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
