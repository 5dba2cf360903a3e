"""The demo's memory measurement (section gather_reduce_sum) against the arithmetic.

A plain-TF step (gather · w → reduce_sum) must hold at least the [tokens, heads * knn,
dim] float32 rows it gathers; the fused lookup holds no such tensor. Measured as the demo
measures, one fresh process per step.
"""

from __future__ import annotations

import argparse

import pytest

from tf_ttemb import demo as demo_cli
from tf_ttemb.demo import _util
from tf_ttemb.demo import gather_reduce_sum as demo

MIB = float(1 << 20)


def test_plain_step_holds_at_least_the_gathered_rows_and_the_fused_one_far_less():
    shape = demo.PkmShape()  # 65,536 x 256 values, 4 heads x 32 knn
    tokens = 1024
    assert demo.gathered_bytes(shape, tokens) == 128 * (1 << 20)
    records = demo._run_memory_worker(
        shape, [tokens], seed=3, method=demo.memory_method(), on_record=lambda _: None
    )
    got = {r["lookup"]: r["bytes"] for r in records}
    assert set(got) == {demo.BASELINE, demo.FUSED}
    plain, fused = got[demo.BASELINE], got[demo.FUSED]
    # None would mean the plain step measured below its gathered rows (not measured).
    assert plain is not None and plain >= demo.gathered_bytes(shape, tokens), got
    # The fused step's own tensors: output [tokens, dim], the deduplicated values
    # gradient [<= slots, dim] and the weights gradient; nothing of [tokens, 128, dim].
    assert 0 < fused <= (tokens + shape.slots) * shape.dim * 4 + 32 * MIB, got
    assert plain >= 5 * fused, got


def test_a_measurement_below_the_gathered_rows_is_reported_as_not_measured(monkeypatch):
    shape = demo.PkmShape(slots=64, dim=8, heads=1, knn=2)

    class Done:
        returncode = 0
        stderr = ""

        def __init__(self, lookup):
            record = {"lookup": lookup, "tokens": 4, "bytes": 0}
            self.stdout = demo._RECORD_MARK + demo.json.dumps(record) + "\n"

    def fake_run(command, **kwargs):
        spec = demo.json.loads(command[-1])
        return Done(spec["lookup"])

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    # A method measured in worker processes (the GPU allocator's is measured in this one).
    records = demo._run_memory_worker(shape, [4], 0, demo.RSS, lambda _: None)
    got = {r["lookup"]: r["bytes"] for r in records}
    assert got == {demo.BASELINE: None, demo.FUSED: 0}
    assert _util.mib(None) == _util.NOT_MEASURED
    assert _util.ratio(None, 5.0) == _util.NOT_MEASURED


@pytest.mark.parametrize("gpu", [False, True])
def test_unset_sizes_follow_the_device_and_explicit_ones_stay(monkeypatch, gpu):
    monkeypatch.setattr(_util, "gpu_visible", lambda: gpu)
    parser = argparse.ArgumentParser()
    demo_cli.add_arguments(parser)
    args = parser.parse_args([])
    demo.resolve_sizes(args)
    shape = demo.PkmShape(slots=args.slots, dim=args.dim, heads=args.heads, knn=args.knn)
    if gpu:
        # The feature request's case: batch 32 x 512 tokens, 4 heads x 32 knn, dim 1024,
        # whose plain lookup gathers 8 GiB and whose output is 64 MiB.
        assert args.headline_tokens == 32 * 512
        assert demo.gathered_bytes(shape, args.headline_tokens) == 8 << 30
        assert args.headline_tokens * shape.dim * 4 == 64 << 20
    else:
        assert shape == demo.PkmShape() and args.headline_tokens == 1024
    assert args.headline_tokens in args.tokens
    explicit = parser.parse_args(["--dim", "24", "--tokens", "8,16", "--headline-tokens", "8"])
    demo.resolve_sizes(explicit)
    assert (explicit.dim, explicit.tokens, explicit.headline_tokens) == (24, [8, 16], 8)
    assert explicit.slots == shape.slots


def test_densified_sums_indexed_slices_a_slice_at_a_time(monkeypatch):
    """The demo densifies the plain lookup's 2^31-element gradient in slices of rows (TF's
    GPU segment sum aborts past int32): the result is the whole sum, repeated rows added."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(7)
    values = rng.standard_normal((1000, 3))
    indices = rng.integers(0, 17, 1000)
    want = np.zeros((17, 3))
    np.add.at(want, indices, values)
    slices = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([17, 3]))
    np.testing.assert_allclose(demo._densified(slices).numpy(), want, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(demo, "DENSIFY_ELEMENTS", 90)  # slices of 30 rows, the last partial
    np.testing.assert_allclose(demo._densified(slices).numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(demo._densified(tf.constant(want)).numpy(), want)
