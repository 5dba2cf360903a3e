"""Seeded fuzzing of gather_reduce_sum: random shapes, dtypes, input forms, combiners,
padding and hostile ids, through every implementation.

Each batch of cases runs in a fresh interpreter, which announces a case before running
it, so a crash fails this test and names the case that crashed. A case fails on:

* a result (forward, params gradient, weights gradient) of any implementation farther
  from the float64 numpy reference than the tolerance of its dtype (tests/bags.py), or,
  where the reference is NaN or +-Inf, not exactly that;
* a hostile input (an id outside [0, N) that is not the padding id, a SparseTensor
  coordinate outside its dense_shape) that an implementation accepts, or that two
  implementations reject with different texts, or with a text that does not name the
  entry (`indices[k] = ...`).

Implementations: the custom op and the plain-TF composite, eagerly and in a
`tf.function`, and `implementation="auto"` under `jit_compile` (the composite through
XLA, which by contract treats out-of-range ids as padding, so it gets only valid ids).
Two in five cases of max and of weighted mean and sqrtn hold non-finite table values
(issue 18, cases 4 and 8): under max NaN, +Inf and -Inf anywhere in the table (NaN wins,
and a column's gradient goes to its first NaN entry); under mean and sqrtn some bags get
zero weights (a zero denominator) and the rows that only they read get NaN or +-Inf, which
must leave them +0 with zero gradients. (Non-finite rows in bags of other denominators
follow IEEE arithmetic, whose NaN and Inf outcomes depend on the order of the sums.)

Bounded: `CASES` cases in `BATCHES` interpreters (about 35 s on 2 quiet cores; CI allows 60).
"""

from __future__ import annotations

import json
import pathlib

import pytest
from processes import run_fresh_python

CASES, BATCHES = 64, 2
TESTS_DIR = str(pathlib.Path(__file__).resolve().parent)

FUZZ_SCRIPT = """
    import json, sys, traceback
    sys.path.insert(0, sys.argv[3])
    import numpy as np
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    import tf_ttemb
    from bags import (DTYPES, ID_DTYPES, assert_close, dense_bags, make_params, make_upstream,
                      quantize, ragged_bags, reference_all, sparse_bags)
    from processes import our_message
    from test_gather_reduce_sum import check_case, run_op

    seed, count = int(sys.argv[1]), int(sys.argv[2])
    RUNS = [("custom_op", "eager"), ("custom_op", "function"), ("composite", "eager"),
            ("composite", "function"), ("auto", "jit")]

    def draw(rng):
        combiner = str(rng.choice(["sum", "mean", "sqrtn", "max"]))
        num_rows = int(rng.choice([1, 2, int(rng.integers(3, 60))]))
        padding = rng.choice(["none", "in_range", "minus_one", "far"])
        padding_id = {"none": None, "in_range": int(rng.integers(0, num_rows)),
                      "minus_one": -1, "far": int(rng.integers(2**40, 2**50))}[padding]
        return dict(
            dtype=str(rng.choice(list(DTYPES))),
            ids_dtype=str(rng.choice(list(ID_DTYPES))),
            form=str(rng.choice(["dense2d", "dense3d", "ragged", "sparse"])),
            combiner=combiner,
            weighted=bool(combiner != "max" and rng.random() < 0.6),
            num_rows=num_rows,
            dim=int(rng.integers(1, 10)),
            padding_id=padding_id,
            hostile=str(rng.choice(["none"] * 3 + ["bad_id", "bad_coordinate"])),
        )

    def make(rng, c):
        ids_dtype = ID_DTYPES[c["ids_dtype"]]
        n, pad = c["num_rows"], c["padding_id"]
        if pad is not None and ids_dtype == tf.int32 and not -2**31 <= pad < 2**31:
            pad = None  # no int32 id can equal it: the op sees no padding entry
        if c["form"] in ("dense2d", "dense3d"):
            shape = ((int(rng.integers(0, 5)), int(rng.integers(1, 7))) if c["form"] == "dense2d"
                     else (2, int(rng.integers(1, 3)), int(rng.integers(1, 6))))
            return dense_bags(rng, shape, n, ids_dtype, pad, pad_fraction=rng.random())
        lengths = rng.integers(0, 9, size=int(rng.integers(0, 7)))
        make_form = ragged_bags if c["form"] == "ragged" else sparse_bags
        return make_form(rng, lengths, n, ids_dtype, pad, pad_fraction=rng.random())

    def bad_id_bags(rng, c):
        # Valid bags with one entry replaced by an id outside [0, N) that is not padding.
        for _ in range(20):
            bags = make(rng, c)
            if bags.nnz:
                break
        else:
            return None
        ids = bags.flat_ids.copy()
        bad = int(rng.choice([c["num_rows"] + int(rng.integers(0, 5)), -int(rng.integers(2, 9))]))
        if bad == c["padding_id"]:
            bad = c["num_rows"] + 7
        ids[int(rng.integers(0, ids.size))] = bad
        ids_dtype = ID_DTYPES[c["ids_dtype"]]
        if bags.form.startswith("dense"):
            shaped = ids.reshape(bags.values_shape)
            return dense_bags(rng, None, c["num_rows"], ids_dtype, ids=shaped).ids
        lengths = np.diff(bags.splits)
        if bags.form == "ragged":
            return ragged_bags(rng, lengths, c["num_rows"], ids_dtype, ids=ids).ids
        return sparse_bags(rng, lengths, c["num_rows"], ids_dtype, ids=ids).ids

    def bad_coordinate_ids(rng, c):
        rows, cols = 3, 4
        coords = [[0, 0], [1, 2], [2, 3]]
        bad = [[-1, 0], [3, 1], [1, 4], [0, -2]][int(rng.integers(0, 4))]
        coords[int(rng.integers(0, 3))] = bad
        values = rng.integers(0, c["num_rows"], size=3)
        return tf.SparseTensor(tf.constant(coords, tf.int64),
                               tf.constant(values, ID_DTYPES[c["ids_dtype"]]), [rows, cols])

    def hostile_errors(rng, c):
        ids = bad_id_bags(rng, c) if c["hostile"] == "bad_id" else bad_coordinate_ids(rng, c)
        if ids is None:
            return None
        params = tf.constant(rng.standard_normal((c["num_rows"], c["dim"])), DTYPES[c["dtype"]])
        messages = {}
        for implementation, mode in RUNS[:4]:
            def call():
                return tf_ttemb.gather_reduce_sum(
                    params, ids, combiner=c["combiner"], padding_id=c["padding_id"],
                    implementation=implementation)
            try:
                out = tf.function(call)() if mode == "function" else call()
                messages[implementation + "/" + mode] = "accepted: " + str(out.shape)
            except tf.errors.InvalidArgumentError as e:
                messages[implementation + "/" + mode] = our_message(e.message)
        return messages

    def assert_matches(got, want, scale, dtype, what):
        # Exactly the reference where it is NaN or +-Inf, within tolerance elsewhere.
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        exact = ~np.isfinite(want)
        np.testing.assert_array_equal(got[exact], want[exact], err_msg=what)
        assert_close(got[~exact], want[~exact], np.asarray(scale)[~exact], dtype, what)

    def check_nonfinite_case(rng, bags, c, mode, implementation):
        dtype, n, dim, pad = DTYPES[c["dtype"]], c["num_rows"], c["dim"], c["padding_id"]
        _, params64 = make_params(rng, n, dim, dtype, distinct=c["combiner"] == "max")
        params64 = params64.copy()
        hostile = np.array([np.nan, np.inf, -np.inf])
        w64 = None
        if c["combiner"] == "max":
            where = rng.random(params64.shape) < 0.3
            params64[where] = rng.choice(hostile, size=int(where.sum()))
        else:
            w64 = quantize(rng.uniform(0.5, 1.5, size=bags.nnz), dtype)[1]
            entry_bag = np.repeat(np.arange(bags.num_bags), np.diff(bags.splits))
            zero = (rng.random(bags.num_bags) < 0.5)[entry_bag]
            w64[zero] = 0.0
            live = np.ones(bags.nnz, bool) if pad is None else bags.flat_ids != pad
            only_zero = set(bags.flat_ids[live & zero].tolist())
            only_zero -= set(bags.flat_ids[live & ~zero].tolist())
            for row in sorted(only_zero):
                params64[row, rng.integers(dim)] = rng.choice(hostile)
        params = quantize(params64, dtype)[0]
        w = None if w64 is None else tf.constant(bags.values_from_csr(w64), dtype)
        up, up64 = make_upstream(rng, bags, dim, dtype)
        out, dp, dw = run_op(params, bags, w, up, mode, combiner=c["combiner"],
                             padding_id=pad, implementation=implementation)
        (ref_out, s_out), (ref_dp, s_dp), ref_dw = reference_all(
            params64, bags, w64, up64, c["combiner"], pad)
        def to64(x):
            return tf.cast(tf.convert_to_tensor(x), tf.float64).numpy()

        assert_matches(to64(out).reshape(-1, dim), ref_out, s_out, dtype, "forward")
        assert_matches(to64(dp), ref_dp, s_dp, dtype, "params grad")
        if w is not None:
            assert_matches(bags.csr_from_values(to64(dw)), *ref_dw, dtype, "weights grad")

    for k in range(count):
        print(json.dumps({"start": k}), flush=True)
        rng = np.random.default_rng([seed, k])
        c = draw(rng)
        # Drawn apart, so that the finite cases keep the data they always had.
        c["values"] = ("nonfinite" if (c["combiner"] == "max" or c["weighted"])
                       and c["combiner"] != "sum"
                       and np.random.default_rng([seed, k, 1]).random() < 0.4 else "finite")
        failures = []
        if c["hostile"] == "bad_coordinate" and c["form"] != "sparse":
            c["hostile"] = "none"
        if c["hostile"] != "none":
            messages = hostile_errors(rng, c)
            if messages is not None:
                texts = set(messages.values())
                named = all(t.startswith(("indices[", "sparse indices: indices[")) for t in texts)
                if len(texts) != 1 or not named:
                    failures.append({"errors": messages})
        else:
            bags = make(rng, c)
            for implementation, mode in RUNS:
                try:
                    if c["values"] == "nonfinite":
                        check_nonfinite_case(rng, bags, c, mode, implementation)
                        continue
                    check_case(rng, bags, DTYPES[c["dtype"]], c["combiner"], c["weighted"],
                               c["padding_id"], c["num_rows"], c["dim"], mode=mode,
                               implementation=implementation)
                except Exception as e:  # noqa: BLE001 - any failure is the finding
                    failures.append({"run": implementation + "/" + mode,
                                     "error": type(e).__name__ + ": " + str(e)[:500]})
        print(json.dumps({"case": k, "config": c, "failures": failures}), flush=True)
    print(json.dumps({"done": count}))
"""


@pytest.mark.parametrize("batch", range(BATCHES))
def test_fuzz_gather_reduce_sum(batch):
    seed = 20261201 + batch
    lines = run_fresh_python(
        FUZZ_SCRIPT, str(seed), str(CASES // BATCHES), TESTS_DIR, timeout=240, all_lines=True
    )
    records = [json.loads(line) for line in lines if line.startswith("{")]
    done = [r for r in records if "done" in r]
    started = [r["start"] for r in records if "start" in r]
    assert done, (
        f"the fuzzing process stopped during case {started[-1] if started else None}"
        f": {records[-1] if records else lines[-5:]}"
    )
    cases = [r for r in records if "case" in r]
    assert len(cases) == CASES // BATCHES
    failed = [r for r in cases if r["failures"]]
    assert not failed, json.dumps(failed[:3], indent=1)
    hostile = sum(r["config"]["hostile"] != "none" for r in cases)
    assert 0 < hostile < len(cases)  # both kinds of case ran
    assert any(
        r["config"]["values"] == "nonfinite" and r["config"]["hostile"] == "none" for r in cases
    )  # and cases of NaN and Inf in the table
