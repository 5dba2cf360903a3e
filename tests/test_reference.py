"""Checks of the numpy reference itself, so that the op's tests stand on something tested.

The forward is compared with a second formulation (a dense [B, N] bag-count
matrix times params) and both gradients with central finite differences of
the reference forward. Pure numpy: needs neither TensorFlow nor the op library.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference
from bags import COMBINER_WEIGHTING

PADDING = -1


def _random_csr(rng, num_rows=6, num_bags=5, max_len=5, padding=True):
    lengths = rng.integers(0, max_len + 1, size=num_bags)
    lengths[1] = 0
    splits = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, num_rows, size=splits[-1])
    if padding:
        ids[rng.random(len(ids)) < 0.25] = PADDING
    return ids, splits


def _bag_matrix(ids, splits, weights, num_rows):
    """[B, N] matrix M with M[b, n] = sum of weights of bag b's entries equal to n."""
    m = np.zeros((len(splits) - 1, num_rows))
    for b in range(len(splits) - 1):
        for j in range(splits[b], splits[b + 1]):
            if ids[j] != PADDING:
                m[b, ids[j]] += 1.0 if weights is None else weights[j]
    return m


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_forward_as_matrix_product(rng, combiner, weighted):
    ids, splits = _random_csr(rng)
    params = rng.normal(size=(6, 3))
    weights = rng.uniform(0.5, 1.5, size=len(ids)) if weighted else None
    m = _bag_matrix(ids, splits, weights, 6)
    w = np.ones(len(ids)) if weights is None else weights
    live = ids != PADDING
    den = []
    for b in range(len(splits) - 1):
        wb = w[splits[b] : splits[b + 1]][live[splits[b] : splits[b + 1]]]
        den.append({"sum": 1.0, "mean": wb.sum(), "sqrtn": np.sqrt((wb**2).sum())}[combiner])
    den = np.array(den)
    want = np.divide(m @ params, den[:, None], out=np.zeros((len(den), 3)), where=den[:, None] != 0)
    got, scale = reference.forward(params, ids, splits, weights, combiner, PADDING)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    assert np.all(scale >= np.abs(got) - 1e-15)


def test_forward_max_and_empty_bags(rng):
    ids = np.array([2, PADDING, 0, PADDING, PADDING, 1, 1])
    splits = np.array([0, 3, 5, 5, 7])
    params = -rng.uniform(1, 2, size=(3, 2))
    got, _ = reference.forward(params, ids, splits, None, "max", PADDING)
    np.testing.assert_array_equal(got[0], np.maximum(params[2], params[0]))
    np.testing.assert_array_equal(got[1:3], 0.0)
    np.testing.assert_array_equal(got[3], params[1])


@pytest.mark.parametrize("combiner,weighted", COMBINER_WEIGHTING)
def test_gradients_match_finite_differences(rng, combiner, weighted):
    ids, splits = _random_csr(rng)
    if combiner == "max":  # distinct values: no ties for the finite differences to cross
        params = rng.permutation(18).reshape(6, 3) / 4.0
    else:
        params = rng.normal(size=(6, 3))
    weights = rng.uniform(0.5, 1.5, size=len(ids)) if weighted else None
    upstream = rng.normal(size=(len(splits) - 1, 3))

    def loss_of_params(p):
        out, _ = reference.forward(p, ids, splits, weights, combiner, PADDING)
        return float(np.sum(out * upstream))

    dp, scale = reference.params_grad(params, ids, splits, upstream, weights, combiner, PADDING)
    np.testing.assert_allclose(
        dp, reference.finite_difference(loss_of_params, params.copy()), atol=1e-7
    )
    assert np.all(scale >= np.abs(dp) - 1e-12)
    untouched = np.setdiff1d(np.arange(6), ids)
    np.testing.assert_array_equal(dp[untouched], 0.0)

    if weighted:

        def loss_of_weights(w):
            out, _ = reference.forward(params, ids, splits, w, combiner, PADDING)
            return float(np.sum(out * upstream))

        dw, scale = reference.weights_grad(
            params, ids, splits, weights, upstream, combiner, PADDING
        )
        np.testing.assert_allclose(
            dw, reference.finite_difference(loss_of_weights, weights.copy()), atol=1e-7
        )
        np.testing.assert_array_equal(dw[ids == PADDING], 0.0)
        assert np.all(scale >= np.abs(dw) - 1e-12)


def test_max_tie_goes_to_first_entry():
    params = np.array([[1.0, 0.0], [1.0, 2.0], [0.0, 2.0]])
    ids = np.array([PADDING, 2, 0, 1])
    splits = np.array([0, 4])
    upstream = np.array([[3.0, 5.0]])
    dp, _ = reference.params_grad(params, ids, splits, upstream, None, "max", PADDING)
    # column 0: rows 0 and 1 tie at 1.0, row 0 comes first; column 1: rows 2 and 1 tie, row 2 first
    np.testing.assert_array_equal(dp, [[3.0, 0.0], [0.0, 0.0], [0.0, 5.0]])


def test_touched_rows():
    np.testing.assert_array_equal(reference.touched_rows([[5, 1, -1], [1, 0, 5]], -1), [0, 1, 5])
    np.testing.assert_array_equal(reference.touched_rows([3, 3, 2], 3), [2])
