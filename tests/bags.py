"""Test data for gather_reduce_sum: bags in every input form, their CSR view, and tolerances.

A `Bags` holds the ids as the op receives them (a dense [..., L] tensor, a
`tf.RaggedTensor` or a `tf.SparseTensor`) together with the canonical CSR view
(flat ids in bag order + row splits) the numpy reference works on, and the map
between the two layouts so weights and weight gradients can be moved across.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import reference
import tensorflow as tf

DTYPES = {
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
    "float32": tf.float32,
    "float64": tf.float64,
}
RTOL = {tf.float16: 1e-2, tf.bfloat16: 1e-2, tf.float32: 1e-5, tf.float64: 1e-10}
ID_DTYPES = {"int32": tf.int32, "int64": tf.int64}
FORMS = ("dense2d", "dense3d", "ragged", "sparse")
# (combiner, weighted): max takes no weights.
COMBINER_WEIGHTING = [
    ("sum", False),
    ("sum", True),
    ("mean", False),
    ("mean", True),
    ("sqrtn", False),
    ("sqrtn", True),
    ("max", False),
]


def combiner_id(value):
    combiner, weighted = value
    return f"{combiner}-{'weighted' if weighted else 'unweighted'}"


def combiner_cases(names: str, cases: list):
    """`pytest.mark.parametrize(names, cases)` over tuples (combiner, weighted, *more), each
    with the id of its combiner and weighting followed by the rest ("sum-weighted-ragged")."""
    ids = ["-".join([combiner_id(case[:2]), *map(str, case[2:])]) for case in cases]
    return pytest.mark.parametrize(names, cases, ids=ids)


def some_combiners(*ids: str):
    """`pytest.mark.parametrize("combiner,weighted", ...)` over the cases named by `ids`, a
    combiner and "-weighted" for weights ("sum-weighted", "max")."""
    cases = [(i.split("-")[0], i.endswith("-weighted")) for i in ids]
    return pytest.mark.parametrize("combiner,weighted", cases, ids=list(ids))


@dataclasses.dataclass
class Bags:
    form: str
    ids: object  # tf.Tensor [..., L] | tf.RaggedTensor [B, (L)] | tf.SparseTensor [B, W]
    flat_ids: np.ndarray  # [nnz] in bag order (the reference's CSR view)
    splits: np.ndarray  # [B + 1]
    lead_shape: tuple  # output shape without the trailing D
    # Weights' values tensor as the op sees it, entry i <-> CSR position csr_pos[i].
    csr_pos: np.ndarray
    values_shape: tuple

    @property
    def nnz(self) -> int:
        return len(self.flat_ids)

    @property
    def num_bags(self) -> int:
        return len(self.splits) - 1

    def values_from_csr(self, csr_values: np.ndarray) -> np.ndarray:
        """Per-entry CSR values rearranged into the layout of the weights' values tensor."""
        return np.asarray(csr_values)[self.csr_pos].reshape(self.values_shape)

    def csr_from_values(self, values: np.ndarray) -> np.ndarray:
        """Inverse of values_from_csr (for gradients w.r.t. the weights' values)."""
        out = np.zeros(self.nnz, dtype=np.float64)
        out[self.csr_pos] = np.asarray(values, dtype=np.float64).reshape(-1)
        return out


def weights_like(ids, values: tf.Tensor):
    """Weights shaped like `ids`, built from a dense values tensor (which a tape can watch)."""
    if isinstance(ids, tf.RaggedTensor):
        return ids.with_flat_values(values)
    if isinstance(ids, tf.SparseTensor):
        return tf.SparseTensor(ids.indices, values, ids.dense_shape)
    return values


def _random_ids(rng, shape, num_rows, padding_id, pad_fraction):
    ids = rng.integers(0, num_rows, size=shape).astype(np.int64)
    if padding_id is not None and ids.size:
        ids[rng.random(shape) < pad_fraction] = padding_id
    return ids


def dense_bags(rng, shape, num_rows, ids_dtype, padding_id=None, pad_fraction=0.3, ids=None):
    """Dense ids of `shape` [..., L]; with a padding id the first bag is all padding (empty)."""
    if ids is None:
        ids = _random_ids(rng, shape, num_rows, padding_id, pad_fraction)
        if padding_id is not None and ids.size:
            ids.reshape(-1, shape[-1])[0] = padding_id
    ids = np.asarray(ids, dtype=np.int64)
    shape = ids.shape
    length = shape[-1]
    num_bags = int(np.prod(shape[:-1]))
    return Bags(
        form="dense2d" if len(shape) == 2 else f"dense{len(shape)}d",
        ids=tf.constant(ids, dtype=ids_dtype),
        flat_ids=ids.reshape(-1),
        splits=np.arange(num_bags + 1, dtype=np.int64) * length,
        lead_shape=tuple(shape[:-1]),
        csr_pos=np.arange(ids.size),
        values_shape=tuple(shape),
    )


def ragged_bags(rng, lengths, num_rows, ids_dtype, padding_id=None, pad_fraction=0.3, ids=None):
    lengths = np.asarray(lengths, dtype=np.int64)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if ids is None:
        ids = _random_ids(rng, (int(splits[-1]),), num_rows, padding_id, pad_fraction)
    ids = np.asarray(ids, dtype=np.int64)
    return Bags(
        form="ragged",
        ids=tf.RaggedTensor.from_row_splits(tf.constant(ids, dtype=ids_dtype), splits),
        flat_ids=ids,
        splits=splits,
        lead_shape=(len(lengths),),
        csr_pos=np.arange(len(ids)),
        values_shape=(len(ids),),
    )


def sparse_bags(
    rng,
    lengths,
    num_rows,
    ids_dtype,
    padding_id=None,
    pad_fraction=0.3,
    ids=None,
    shuffle=True,
    width=None,
):
    """A 2-D SparseTensor whose row b holds bag b at sorted random columns (with gaps).

    The bag order is the column order; with `shuffle` the entries are handed to the
    op in a random (non-canonical) order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    nnz = int(splits[-1])
    if ids is None:
        ids = _random_ids(rng, (nnz,), num_rows, padding_id, pad_fraction)
    ids = np.asarray(ids, dtype=np.int64)
    if width is None:
        width = int(lengths.max()) + 3 if len(lengths) else 4
    coords = np.zeros((nnz, 2), dtype=np.int64)
    for b, n in enumerate(lengths):
        lo = splits[b]
        coords[lo : lo + n, 0] = b
        coords[lo : lo + n, 1] = np.sort(rng.choice(width, size=int(n), replace=False))
    order = rng.permutation(nnz) if shuffle else np.arange(nnz)
    sp = tf.SparseTensor(
        tf.constant(coords[order].reshape(nnz, 2), dtype=tf.int64),
        tf.constant(ids[order], dtype=ids_dtype),
        dense_shape=[len(lengths), width],
    )
    return Bags(
        form="sparse",
        ids=sp,
        flat_ids=ids,
        splits=splits,
        lead_shape=(len(lengths),),
        csr_pos=order,
        values_shape=(nnz,),
    )


def make_bags(rng, form, num_rows, ids_dtype, padding_id=None, num_bags=6, max_len=6):
    """Small bags of a given form with at least one empty bag (where the form allows it)."""
    if form == "dense2d":
        return dense_bags(rng, (num_bags, max_len - 1), num_rows, ids_dtype, padding_id)
    if form == "dense3d":
        return dense_bags(rng, (2, 3, 4), num_rows, ids_dtype, padding_id)
    lengths = rng.integers(0, max_len + 1, size=num_bags)
    lengths[min(1, num_bags - 1)] = 0
    if form == "ragged":
        return ragged_bags(rng, lengths, num_rows, ids_dtype, padding_id)
    if form == "sparse":
        return sparse_bags(rng, lengths, num_rows, ids_dtype, padding_id)
    raise ValueError(form)


def quantize(values, dtype):
    """A tf tensor of `dtype` and the float64 numpy array of exactly its values."""
    t = tf.constant(np.asarray(values, dtype=np.float64), dtype=dtype)
    return t, tf.cast(t, tf.float64).numpy()


def make_params(rng, num_rows, dim, dtype, distinct=False):
    """Random params; with `distinct` every column holds distinct values exact in every dtype.

    Distinct columns keep max free of ties between different rows, so its gradient is
    well defined in every dtype (ties between equal ids do not change the gradient).
    """
    if distinct:
        grid = np.arange(-128, 129)
        assert num_rows <= len(grid), "distinct params need num_rows <= 257"
        values = (
            np.stack([rng.choice(grid, size=num_rows, replace=False) for _ in range(dim)], axis=1)
            / 64.0
        )
        return quantize(values.reshape(num_rows, dim), dtype)
    return quantize(rng.normal(size=(num_rows, dim)), dtype)


def make_weights(rng, bags: Bags, dtype, low=0.5, high=1.5):
    """Positive per-entry weights: (tf values tensor in the op's layout, float64 CSR array)."""
    csr = rng.uniform(low, high, size=bags.nnz)
    t, csr64 = quantize(csr, dtype)
    return tf.constant(bags.values_from_csr(t.numpy()), dtype=dtype), csr64


def make_upstream(rng, bags: Bags, dim, dtype):
    """Random upstream gradient of the output's shape: (tf tensor, float64 [B, D])."""
    t, g64 = quantize(rng.normal(size=bags.lead_shape + (dim,)), dtype)
    return t, g64.reshape(bags.num_bags, dim)


def make_inputs(rng, bags: Bags, num_rows, dim, dtype, combiner, weighted):
    """The other inputs of one op call on `bags`, each a (tf tensor, float64 values) pair,
    drawn from `rng` in this order: params [num_rows, dim] (with distinct columns for
    max, see make_params), positive weights when `weighted` (else (None, None)) and an
    upstream gradient."""
    params = make_params(rng, num_rows, dim, dtype, distinct=combiner == "max")
    weights = make_weights(rng, bags, dtype) if weighted else (None, None)
    return params, weights, make_upstream(rng, bags, dim, dtype)


def dense_value(x) -> np.ndarray:
    """float64 numpy value of a tensor or IndexedSlices (duplicates summed)."""
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    return tf.cast(x, tf.float64).numpy()


def assert_close(got, want, scale, dtype, what=""):
    """|got - want| <= rtol(dtype) * scale elementwise; scale >= |want| bounds the summed terms."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}"
    tol = RTOL[dtype] * np.maximum(np.asarray(scale, dtype=np.float64), np.abs(want)) + 1e-300
    err = np.abs(got - want)
    bad = ~(err <= tol)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements out of tolerance; first at {idx}: "
            f"got {got[idx]!r}, expected {want[idx]!r} (tol {tol[idx]:.3g}, "
            f"max err {err.max():.3g})"
        )


def reference_all(params64, bags: Bags, weights64, upstream64, combiner, padding_id):
    """Reference forward [B, D], dense params grad [N, D], weights grad [nnz] (CSR), scales."""
    out = reference.forward(params64, bags.flat_ids, bags.splits, weights64, combiner, padding_id)
    dp = reference.params_grad(
        params64, bags.flat_ids, bags.splits, upstream64, weights64, combiner, padding_id
    )
    dw = None
    if weights64 is not None:
        dw = reference.weights_grad(
            params64, bags.flat_ids, bags.splits, weights64, upstream64, combiner, padding_id
        )
    return out, dp, dw
