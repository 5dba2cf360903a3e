"""`python -m tf_ttemb demo`: what tf_ttemb buys you, measured on your machine.

The demo is a list of sections (`SECTIONS`), one per feature; each one runs its
measurements, prints a summary and saves a plot and a JSON file under `--out`.

* `gather_reduce_sum`: a Product-Key-Memory-like lookup (a value table, and per token
  heads × knn slots with softmax weights), done by `tf_ttemb.gather_reduce_sum` and by
  the plain TensorFlow composite `tf.reduce_sum(tf.gather(values, ids) * w[..., None], -2)`.
  It compares one training step (forward and the gradients w.r.t. the values and the
  weights) in time and peak memory, checks that both give the same numbers, and sweeps
  the number of tokens.
* `tt_quality`: a small CTR model (3 sparse features over tables of 1,000,000 rows, 4 dense
  features, an MLP) trained on data from a planted logistic model, once with full
  `EmbeddingBag` tables and once per TT rank with `TTEmbeddingBag` tables: embedding
  parameters, compression, held-out logloss and AUC, and the time of a training step,
  against the dense-features-only model and the planted model itself (the best possible).
  `--sections tt_quality` runs only this section; `--tt-*` options set its sizes.
* `pkm_lm`: a small byte-level transformer language model trained on the Python standard
  library's own source files (those of the interpreter running the demo), once as is and
  once with the feed-forward block of its middle layer replaced by a
  `tf_ttemb.layers.ProductKeyMemory`, at equal steps and batches: validation bits per
  byte (learning curves), training steps/s, parameter counts and the memory's slot usage.
  The corpus, split and models are described in `tf_ttemb/demo/pkm_lm.py`; `--lm-*` options
  set its length (`--lm-long` for a longer run).

The sections live in `tf_ttemb/demo/`: `gather_reduce_sum.py`, `tt_quality.py`,
`pkm_lm.py` (its corpus, split and models described there), on the helpers of
`_util.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Callable, Dict

from tf_ttemb import _timing
from tf_ttemb.demo import gather_reduce_sum, pkm_lm, tt_quality
from tf_ttemb.ops import _loader

DEFAULT_OUT = "demo_output"


# ----------------------------------------------------------------------------------------
# The command.


@dataclasses.dataclass(frozen=True)
class Section:
    """One part of the demo: a title and a function that runs it and returns its results."""

    title: str
    run: Callable[[argparse.Namespace], Dict[str, Any]]


SECTIONS: Dict[str, Section] = {
    "gather_reduce_sum": Section(
        "fused EmbeddingBag vs plain TensorFlow on a PKM-like lookup",
        gather_reduce_sum.section_gather_reduce_sum,
    ),
    "tt_quality": Section(
        "full vs Tensor-Train compressed tables in a small CTR model: size, quality, speed",
        tt_quality.section_tt_quality,
    ),
    "pkm_lm": Section(
        "byte-level language model on Python's stdlib source, without vs with a "
        "ProductKeyMemory layer",
        pkm_lm.section,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to `parser` (the `demo` subcommand of `python -m tf_ttemb`)."""
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help="where the plots and JSON results go (default: %(default)s/)",
    )
    _timing.add_choice_list(
        parser,
        "--sections",
        list(SECTIONS),
        f"comma-separated sections to run (default: all: {', '.join(SECTIONS)})",
        default=list(SECTIONS),
    )
    parser.add_argument(
        "--tokens",
        type=_timing.positive_int_list,
        default=None,
        help="token counts of the scaling sweep (default: 256,512,1024,2048,4096; "
        "2048,4096,8192,16384 with a GPU)",
    )
    pkm = gather_reduce_sum.PkmShape
    _timing.add_int_options(
        parser,
        headline_tokens=(
            None,
            "token count of the summary and the equality check (default: 1024; 16384 = "
            "32 x 512 with a GPU)",
        ),
        repeats=(3, "timed steps per measurement (default: %(default)s)"),
        slots=(None, f"rows of the values table (default: {pkm.slots}; 262144 with a GPU)"),
        dim=(None, f"width of the values table (default: {pkm.dim}; 1024 with a GPU)"),
        heads=(None, f"memory heads per token (default: {pkm.heads}; 4 with a GPU)"),
        knn=(None, f"slots per head (default: {pkm.knn}; 32 with a GPU)"),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short smoke test: tokens 128,256,512, headline 256, 2 repeats; tt_quality "
        "with 100,000-row tables, ranks 4,16, 100 steps, 20,000 held-out examples; pkm_lm "
        "with 30 steps per model and 32 validation windows (overrides those options, except "
        "an explicit --lm-steps)",
    )
    _timing.add_int_options(
        parser,
        tt_rows=(
            1_000_000,
            "tt_quality: rows of each of the 3 embedding tables (default: %(default)s)",
        ),
        tt_dim=(16, "tt_quality: embedding dimension (default: %(default)s)"),
    )
    parser.add_argument(
        "--tt-ranks",
        type=_timing.positive_int_list,
        default=[4, 16, 64],
        help="tt_quality: TT ranks to compare with the full tables (default: 4,16,64)",
    )
    train = tt_quality.TrainConfig
    _timing.add_int_options(
        parser,
        tt_steps=(train.steps, "tt_quality: training steps per model (default: %(default)s)"),
        tt_batch=(train.batch, "tt_quality: examples per training step (default: %(default)s)"),
        tt_test_examples=(100_000, "tt_quality: held-out examples (default: %(default)s)"),
        lm_steps=(None, "pkm_lm: training steps per model (default: 200; 2000 with --lm-long)"),
    )
    parser.add_argument(
        "--lm-long",
        action="store_true",
        help="pkm_lm: a longer run, 2000 steps per model and 1024 validation windows "
        "(about 10x the default's time)",
    )
    _timing.add_int_options(
        parser,
        lm_batch=(16, "pkm_lm: windows of 128 bytes per training step (default: %(default)s)"),
    )
    parser.add_argument(
        "--lm-lr",
        type=float,
        default=2e-3,
        help="pkm_lm: peak Adam learning rate of everything but the memory values "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--lm-values-lr",
        type=float,
        default=1e-3,
        help="pkm_lm: peak learning rate of the memory values' sparse Adam (default: "
        "%(default)s, as in the paper)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG plots")
    parser.add_argument("--seed", type=int, default=0, help="data seed (default: %(default)s)")


def apply_quick(args: argparse.Namespace) -> None:
    """The `--quick` overrides: small sizes for a smoke test."""
    args.tokens, args.headline_tokens, args.repeats = [128, 256, 512], 256, 2
    args.tt_rows, args.tt_ranks, args.tt_steps = 100_000, [4, 16], 100
    args.tt_test_examples = 20_000


def main(args: argparse.Namespace) -> int:
    """Runs the selected sections; returns the process exit status."""
    if args.quick:
        apply_quick(args)
    os.makedirs(args.out, exist_ok=True)
    for index, name in enumerate(args.sections, 1):
        section = SECTIONS[name]
        print(f"\n== [{index}/{len(args.sections)}] {name}: {section.title} ==")
        try:
            section.run(args)
        except _loader.OpLibraryNotFoundError as e:
            print(f"\n{e}", file=sys.stderr)
            return 1
    return 0
