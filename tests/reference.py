"""Independent float64 numpy reference for gather_reduce_sum (EmbeddingBag).

Everything here works on the CSR form of a batch of bags and in float64:

  params      [N, D]
  ids         [nnz]     row ids; bag b owns ids[splits[b]:splits[b + 1]]
  splits      [B + 1]
  weights     [nnz] or None

Entries whose id equals `padding_id` are skipped everywhere: not summed, not
counted by mean, not in sqrtn's norm, never the max, no gradient.  A bag with no
non-padding entries, or with a zero denominator, gives zeros (and zero
gradients).  For max, ties go to the first entry of the bag, and NaN wins (numpy's max
and argmax: a column holding NaN gives NaN, its gradient going to the first NaN entry).

Every function returns `(value, scale)`: `scale` is the same quantity computed
from absolute values (|w|, |e|, |upstream|), an upper bound on the magnitude of
the terms that were summed.  Tests use it to scale an absolute tolerance so a
result that cancels to ~0 is compared sensibly (rounding error is proportional
to the terms, not to the result).

The functions are written bag by bag with plain numpy, on purpose unlike the
implementation (no sort, no segment ops), so that they share no bug with it.
"""

from __future__ import annotations

import numpy as np

COMBINERS = ("sum", "mean", "sqrtn", "max")


def _bag_entries(ids, splits, weights, b, padding_id):
    """Positions (inside the flat ids), ids and weights of bag b's live entries."""
    lo, hi = int(splits[b]), int(splits[b + 1])
    pos = np.arange(lo, hi)
    bag_ids = np.asarray(ids[lo:hi], dtype=np.int64)
    if padding_id is not None:
        keep = bag_ids != padding_id
        pos, bag_ids = pos[keep], bag_ids[keep]
    if weights is None:
        w = np.ones(len(pos), dtype=np.float64)
    else:
        w = np.asarray(weights, dtype=np.float64)[pos]
    return pos, bag_ids, w


def _denominator(w, combiner):
    """Denominator of a bag (1 for sum); 0 means the bag's output is zero."""
    if combiner == "sum":
        return 1.0
    if combiner == "mean":
        return float(np.sum(w))
    if combiner == "sqrtn":
        return float(np.sqrt(np.sum(w * w)))
    raise ValueError(combiner)


def _check(params, ids, splits, weights, combiner):
    if combiner not in COMBINERS:
        raise ValueError(f"unknown combiner {combiner!r}")
    if combiner == "max" and weights is not None:
        raise ValueError("combiner 'max' does not take weights")
    params = np.asarray(params, dtype=np.float64)
    assert params.ndim == 2
    splits = np.asarray(splits, dtype=np.int64)
    assert splits[0] == 0 and splits[-1] == len(ids)
    assert np.all(np.diff(splits) >= 0)
    return params, splits


def forward(params, ids, splits, weights=None, combiner="sum", padding_id=None):
    """Output [B, D] and its magnitude scale [B, D]."""
    params, splits = _check(params, ids, splits, weights, combiner)
    num_bags, dim = len(splits) - 1, params.shape[1]
    out = np.zeros((num_bags, dim))
    scale = np.zeros((num_bags, dim))
    for b in range(num_bags):
        _, bag_ids, w = _bag_entries(ids, splits, weights, b, padding_id)
        if len(bag_ids) == 0:
            continue
        rows = params[bag_ids]  # [n, D]
        if combiner == "max":
            out[b] = rows.max(axis=0)
            scale[b] = np.abs(out[b])
            continue
        den = _denominator(w, combiner)
        if den == 0.0:
            continue
        out[b] = (w[:, None] * rows).sum(axis=0) / den
        scale[b] = (np.abs(w)[:, None] * np.abs(rows)).sum(axis=0) / abs(den)
    return out, scale


def params_grad(params, ids, splits, grad, weights=None, combiner="sum", padding_id=None):
    """Dense gradient w.r.t. params [N, D] for upstream `grad` [B, D], and its scale."""
    params, splits = _check(params, ids, splits, weights, combiner)
    grad = np.asarray(grad, dtype=np.float64)
    dparams = np.zeros_like(params)
    scale = np.zeros_like(params)
    cols = np.arange(params.shape[1])
    for b in range(len(splits) - 1):
        _, bag_ids, w = _bag_entries(ids, splits, weights, b, padding_id)
        if len(bag_ids) == 0:
            continue
        if combiner == "max":
            # np.argmax returns the first maximal entry: the tie rule.
            first = np.argmax(params[bag_ids], axis=0)  # [D]
            winners = bag_ids[first]
            dparams[winners, cols] += grad[b]
            scale[winners, cols] += np.abs(grad[b])
            continue
        den = _denominator(w, combiner)
        if den == 0.0:
            continue
        for j, row in enumerate(bag_ids):
            dparams[row] += (w[j] / den) * grad[b]
            scale[row] += abs(w[j] / den) * np.abs(grad[b])
    return dparams, scale


def weights_grad(params, ids, splits, weights, grad, combiner="sum", padding_id=None):
    """Gradient w.r.t. the per-entry weights [nnz] and its scale.

    sum:   d out / d w_j = e_j
    mean:  out = S / W,        d out / d w_j = (e_j - out) / W
    sqrtn: out = S / sqrt(Q),  d out / d w_j = (e_j - out * w_j / sqrt(Q)) / sqrt(Q)
    """
    if combiner == "max":
        raise ValueError("combiner 'max' does not take weights")
    params, splits = _check(params, ids, splits, weights, combiner)
    grad = np.asarray(grad, dtype=np.float64)
    out, _ = forward(params, ids, splits, weights, combiner, padding_id)
    dw = np.zeros(len(ids))
    scale = np.zeros(len(ids))
    for b in range(len(splits) - 1):
        pos, bag_ids, w = _bag_entries(ids, splits, weights, b, padding_id)
        if len(bag_ids) == 0:
            continue
        den = _denominator(w, combiner)
        if den == 0.0:
            continue
        g = grad[b]
        for j, (p, row) in enumerate(zip(pos, bag_ids)):
            e = params[row]
            if combiner == "sum":
                d, s = e, np.abs(e)
            elif combiner == "mean":
                d = (e - out[b]) / den
                s = (np.abs(e) + np.abs(out[b])) / abs(den)
            else:  # sqrtn
                d = (e - out[b] * w[j] / den) / den
                s = (np.abs(e) + np.abs(out[b] * w[j] / den)) / den
            dw[p] = float(np.dot(g, d))
            scale[p] = float(np.dot(np.abs(g), s))
    return dw, scale


def touched_rows(ids, padding_id=None):
    """Sorted unique non-padding ids: the rows of the IndexedSlices gradient."""
    u = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
    if padding_id is not None:
        u = u[u != padding_id]
    return u


def finite_difference(fn, array, eps=1e-6):
    """d fn / d array by central differences (fn: array -> float), changing one entry of
    `array` at a time in place (and putting it back)."""
    grad = np.zeros_like(array)
    flat, out = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        up = fn(array)
        flat[i] = keep - eps
        down = fn(array)
        flat[i] = keep
        out[i] = (up - down) / (2 * eps)
    return grad
