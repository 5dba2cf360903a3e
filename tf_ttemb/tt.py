"""Numpy helpers for Tensor-Train (TT) embedding tables.

A table of `N` rows and `D` columns is stored as `T >= 2` cores in the layout of
`docs/tt_embedding_contract.md`:

* `p = [p_0, ..., p_{T-1}]` with `P = prod(p) >= N` (row shapes),
  `q = [q_0, ..., q_{T-1}]` with `prod(q) == D` (column shapes), inner ranks
  `ranks = [r_1, ..., r_{T-1}]` and `r_0 = r_T = 1`.
* Core k is a 2-D array `[p_k, r_k * q_k * r_{k+1}]` whose row `d` is the block
  `G_k[d]` of shape `(r_k, q_k, r_{k+1})`, flattened row-major. With `num_tables`
  tables it is `[num_tables * p_k, r_k * q_k * r_{k+1}]`, table t owning rows
  `t * p_k ... (t + 1) * p_k - 1`.
* Row `i` has digits `i_0 .. i_{T-1}` (most significant first,
  `i = sum_k i_k * prod_{j>k} p_j`); its entry at column `(j_0, ..., j_{T-1})`
  (row-major) is
  `G_0[i_0][0, j_0, :] @ G_1[i_1][:, j_1, :] @ ... @ G_{T-1}[i_{T-1}][:, j_{T-1}, 0]`.

This module is pure numpy. It chooses shapes (`suggested_shapes`, `resolve_shapes`),
counts parameters and FLOPs, expands cores to rows or to the dense table (`rows`,
`to_dense`: the float64 reference the rest of the package is tested against),
decomposes a dense table (`from_dense`, TT-SVD) and draws initial cores
(`initial_cores`) without ever building the full table.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tf_ttemb import _args

__all__ = [
    "WEIGHT_DISTS",
    "TTDecomposition",
    "flops_per_lookup",
    "from_dense",
    "initial_cores",
    "num_parameters",
    "resolve_shapes",
    "rows",
    "suggested_shapes",
    "to_dense",
]

WEIGHT_DISTS = ("approx-uniform", "approx-normal", "uniform", "normal", "naive-uniform")

# suggested_shapes(n, d) looks for factors within this ratio of n ** (1 / d).
_BALANCE_RATIO = 1.25
# ... and, for very large n, among a limited number of values of each free factor below
# the balanced value: at most _SEARCH_STEPS ** (1 / (d - 2)) (2 ** 20 for d = 2, where the
# one step is vectorised), so that the search takes at most about _SEARCH_STEPS
# vectorised steps (a fraction of a second) for any n and d.
_SEARCH_STEPS = 1024


# --------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive_int_list(name: str, values: object) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    values = list(values)
    if not values or not all(_is_int(v) and int(v) >= 1 for v in values):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    return [int(v) for v in values]


def _full_ranks(ranks: Sequence[int]) -> list[int]:
    return [1, *(int(r) for r in ranks), 1]


# --------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    small, large = [], []
    f = 1
    while f * f <= n:
        if n % f == 0:
            small.append(f)
            if f * f != n:
                large.append(n // f)
        f += 1
    return small + large[::-1]


def _exact_factorisations(n: int, d: int, smallest: int, divisors: list[int]):
    """All non-decreasing d-tuples of integers >= smallest whose product is n."""
    if d == 1:
        if n >= smallest:
            yield (n,)
        return
    for f in divisors:
        if f < smallest:
            continue
        if f**d > n:
            break
        if n % f == 0:
            for rest in _exact_factorisations(n // f, d - 1, f, divisors):
                yield (f, *rest)


def _iroot_ceil(n: int, m: int) -> int:
    """The smallest integer x >= 1 with x ** m >= n."""
    x = max(1, int(round(n ** (1.0 / m))))
    while x**m < n:
        x += 1
    while x > 1 and (x - 1) ** m >= n:
        x -= 1
    return x


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def suggested_shapes(n: int, d: int = 3, exact: bool = False) -> list[int]:
    """A balanced factorisation of `n` into `d` factors, in non-decreasing order.

    With `exact=False` (row shapes for `num_embeddings`) the product is at least `n`:
    among the near-balanced tuples, whose factors all lie in
    `[floor(c / 1.25), ceil(1.25 c)]` with `c = n ** (1 / d)`, the one with the smallest
    excess `prod - n` wins, ties going to the smallest spread `max - min`. Its excess is
    never larger than that of `[ceil(c)] * d`. (For very large n, beyond about 1e13 for
    d = 2, 1e11 for d = 3 or 1e9 for d = 4, only the factors closest to `c` are searched,
    to stay fast.)

    With `exact=True` (column shapes for `embedding_dim`) the product is exactly `n`,
    never rounded up: the factorisation with the smallest spread `max - min` (then the
    smallest sum) wins. Factors of 1 are allowed, so a prime `n` gives `[1, ..., 1, n]`.

    Args:
        n: The number to factor, `>= 1`.
        d: The number of factors (TT cores), `>= 2`.
        exact: Whether the product must equal `n`.

    Returns:
        `d` positive ints, non-decreasing.

    Raises:
        ValueError: `n < 1` or `d < 2` (or not integers).

    Example:
        >>> suggested_shapes(10_131_227, 3)
        [198, 208, 246]
        >>> suggested_shapes(128, 3, exact=True)
        [4, 4, 8]
        >>> suggested_shapes(97, 3, exact=True)
        [1, 1, 97]
    """
    n = _args.positive_int("n", n, 1)
    d = _args.positive_int("d", d, 2)
    if exact:
        divisors = _divisors(n)
        best = min(
            _exact_factorisations(n, d, 1, divisors),
            key=lambda f: (f[-1] - f[0], sum(f)),
        )
        return list(best)

    root = n ** (1.0 / d)
    top = _iroot_ceil(n, d)  # [top] * d is always a candidate
    # Free factors range over [lo, hi]; for large n at most `span` values below `top`, so
    # that the search (span ** (d - 2) vectorised steps at most) stays fast.
    span = 1 << 20 if d == 2 else max(2, int(round(_SEARCH_STEPS ** (1.0 / (d - 2)))))
    lo = max(1, int(math.floor(root / _BALANCE_RATIO)), top - span)
    hi = max(top, int(math.ceil(root * _BALANCE_RATIO)))
    best_key = (top**d - n, 0)
    best = (top,) * d
    small = n < 2**60  # int64 arithmetic is exact below this

    def search(prefix: tuple[int, ...], remaining: int, smallest: int) -> None:
        nonlocal best_key, best
        m = d - len(prefix)  # factors still to choose, >= 2 here
        # Sorted factors above _iroot_ceil(remaining, m) can only overshoot more.
        upper = min(hi, _iroot_ceil(remaining, m))
        if smallest > upper:
            return
        if m > 2:
            for a in range(smallest, upper + 1):
                search((*prefix, a), _ceil_div(remaining, a), a)
            return
        # The second-to-last factor, vectorised; the last one is then forced.
        f = np.arange(smallest, upper + 1, dtype=np.int64 if small else object)
        last = -(-remaining // f)
        ok = (last >= f) & (last <= hi)
        if not ok.any():
            return
        f, last = f[ok], last[ok]
        head = math.prod(prefix)
        excess = head * f * last - n
        spread = last - (prefix[0] if prefix else f)
        i = int(np.lexsort((spread, excess))[0])
        key = (int(excess[i]), int(spread[i]))
        if key < best_key:
            best_key, best = key, (*prefix, int(f[i]), int(last[i]))

    search((), n, lo)
    return list(best)


def resolve_shapes(
    num_embeddings: int,
    embedding_dim: int,
    tt_ranks: int | Sequence[int],
    tt_p_shapes: Sequence[int] | None = None,
    tt_q_shapes: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Validates TT shapes and fills in the missing ones.

    The number of cores T comes from `tt_p_shapes` if given, else `tt_q_shapes`, else
    `len(tt_ranks) + 1` when `tt_ranks` is a list, else 3. Missing shapes are
    `suggested_shapes(num_embeddings, T)` and `suggested_shapes(embedding_dim, T,
    exact=True)`.

    Args:
        num_embeddings: N, the number of table rows, `>= 1`.
        embedding_dim: D, the number of table columns, `>= 1`.
        tt_ranks: The inner ranks `[r_1, ..., r_{T-1}]`, or one int used for all of them.
        tt_p_shapes: Row shapes with `prod >= num_embeddings`, or None.
        tt_q_shapes: Column shapes with `prod == embedding_dim`, or None.

    Returns:
        `(p_shapes, q_shapes, ranks)` as lists of Python ints (ranks has T - 1 entries).

    Raises:
        ValueError: Any bad value, quoted in the message.

    Example:
        >>> resolve_shapes(10_131_227, 64, 32)
        ([198, 208, 246], [4, 4, 4], [32, 32])
        >>> resolve_shapes(1000, 16, [3, 5, 7])
        ([5, 5, 5, 8], [2, 2, 2, 2], [3, 5, 7])
    """
    n = _args.positive_int("num_embeddings", num_embeddings)
    dim = _args.positive_int("embedding_dim", embedding_dim)
    p = None if tt_p_shapes is None else _positive_int_list("tt_p_shapes", tt_p_shapes)
    q = None if tt_q_shapes is None else _positive_int_list("tt_q_shapes", tt_q_shapes)
    if _is_int(tt_ranks):
        rank_list = None
        if int(tt_ranks) < 1:
            raise ValueError(
                f"tt_ranks must be a positive integer or a list of them, got {tt_ranks!r}"
            )
    else:
        try:
            rank_list = _positive_int_list("tt_ranks", tt_ranks)
        except ValueError:
            raise ValueError(
                f"tt_ranks must be a positive integer or a list of them, got {tt_ranks!r}"
            ) from None

    if p is not None:
        num_cores = len(p)
    elif q is not None:
        num_cores = len(q)
    elif rank_list is not None:
        num_cores = len(rank_list) + 1
    else:
        num_cores = 3
    if num_cores < 2:
        raise ValueError(
            f"a TT table needs at least 2 cores, got {num_cores} "
            f"(tt_p_shapes={tt_p_shapes!r}, tt_q_shapes={tt_q_shapes!r}, tt_ranks={tt_ranks!r})"
        )
    if p is not None and q is not None and len(p) != len(q):
        raise ValueError(
            f"tt_p_shapes and tt_q_shapes must have the same length, got {p} ({len(p)} cores) "
            f"and {q} ({len(q)} cores)"
        )
    if rank_list is not None and len(rank_list) != num_cores - 1:
        raise ValueError(
            f"tt_ranks must have {num_cores - 1} entries for {num_cores} cores, got {rank_list}"
        )
    if p is None:
        p = suggested_shapes(n, num_cores)
    elif math.prod(p) < n:
        raise ValueError(
            f"prod(tt_p_shapes) = {math.prod(p)} must be >= num_embeddings = {n}, "
            f"got tt_p_shapes={p}"
        )
    if q is None:
        q = suggested_shapes(dim, num_cores, exact=True)
    elif math.prod(q) != dim:
        raise ValueError(
            f"prod(tt_q_shapes) = {math.prod(q)} must equal embedding_dim = {dim}, "
            f"got tt_q_shapes={q}"
        )
    ranks = rank_list if rank_list is not None else [int(tt_ranks)] * (num_cores - 1)
    return p, q, ranks


def _rank_list(ranks: int | Sequence[int], num_cores: int) -> list[int]:
    """Inner ranks as a list; one int stands for all T - 1 of them."""
    if _is_int(ranks):
        return [_args.positive_int("ranks", ranks)] * (num_cores - 1)
    if isinstance(ranks, (Sequence, np.ndarray)) and len(ranks) == 0:
        return []
    return _positive_int_list("ranks", ranks)


def _check_shapes(p: Sequence[int], q: Sequence[int], ranks: int | Sequence[int]):
    p = _positive_int_list("p_shapes", p)
    q = _positive_int_list("q_shapes", q)
    ranks = _rank_list(ranks, len(p))
    if len(p) < 2 or len(q) != len(p) or len(ranks) != len(p) - 1:
        raise ValueError(
            f"need T >= 2 cores with len(p_shapes) == len(q_shapes) == len(ranks) + 1, got "
            f"p_shapes={p}, q_shapes={q}, ranks={ranks}"
        )
    return p, q, ranks


def num_parameters(p: Sequence[int], q: Sequence[int], ranks: int | Sequence[int]) -> int:
    """The number of entries of the cores of one table: `sum_k r_k p_k q_k r_{k+1}`.

    `ranks` are the T - 1 inner ranks (one int stands for all of them).

    Example:
        >>> num_parameters([200, 220, 250], [4, 4, 4], [32, 32])
        958720
    """
    p, q, ranks = _check_shapes(p, q, ranks)
    r = _full_ranks(ranks)
    return sum(r[k] * p[k] * q[k] * r[k + 1] for k in range(len(p)))


def flops_per_lookup(q: Sequence[int], ranks: int | Sequence[int]) -> int:
    """Forward FLOPs to build one row from its core blocks, multiplying left to right.

    Step t (t = 1 .. T-1) multiplies the `(q_0...q_{t-1}) x r_t` partial product by the
    `r_t x (q_t r_{t+1})` block: `2 (q_0...q_{t-1}) r_t q_t r_{t+1}` FLOPs (`r_T = 1`).
    `ranks` are the T - 1 inner ranks (one int stands for all of them).

    Example:
        >>> flops_per_lookup([4, 4, 4], [32, 32])
        36864
    """
    q = _positive_int_list("q_shapes", q)
    ranks = _rank_list(ranks, len(q))
    if len(q) < 2 or len(ranks) != len(q) - 1:
        raise ValueError(
            f"need len(q_shapes) == len(ranks) + 1 >= 2, got q_shapes={q}, ranks={ranks}"
        )
    r = _full_ranks(ranks)
    return sum(2 * math.prod(q[:t]) * r[t] * q[t] * r[t + 1] for t in range(1, len(q)))


# --------------------------------------------------------------------------------------
# Expansion: cores -> rows / dense table
# --------------------------------------------------------------------------------------


def _result_dtype(cores: Sequence[np.ndarray], dtype) -> np.dtype:
    if dtype is not None:
        return np.dtype(dtype)
    return np.dtype(
        np.float64 if all(np.asarray(c).dtype == np.float64 for c in cores) else np.float32
    )


def _blocks(cores, p, q, ranks, num_tables: int) -> list[np.ndarray]:
    """Each core as a float64 array [num_tables * p_k, r_k, q_k, r_{k+1}], shapes checked."""
    if len(cores) != len(p):
        raise ValueError(f"expected {len(p)} cores for p_shapes={p}, got {len(cores)}")
    r = _full_ranks(ranks)
    out = []
    for k, core in enumerate(cores):
        core = np.asarray(core)
        want = (num_tables * p[k], r[k] * q[k] * r[k + 1])
        if core.shape != want:
            raise ValueError(
                f"cores[{k}] has shape {core.shape}, expected {want} = "
                f"[num_tables * p_{k}, r_{k} * q_{k} * r_{k + 1}] with num_tables={num_tables}, "
                f"p_{k}={p[k]}, q_{k}={q[k]}, r_{k}={r[k]}, r_{k + 1}={r[k + 1]}"
            )
        out.append(core.astype(np.float64).reshape(want[0], r[k], q[k], r[k + 1]))
    return out


def rows(
    cores: Sequence[np.ndarray],
    p: Sequence[int],
    q: Sequence[int],
    ranks: int | Sequence[int],
    ids,
    *,
    num_tables: int = 1,
    dtype=None,
) -> np.ndarray:
    """The rows `ids` of a TT table, computed in float64 without building the table.

    Args:
        cores: T arrays `[num_tables * p_k, r_k * q_k * r_{k+1}]`.
        p: Row shapes.
        q: Column shapes.
        ranks: Inner ranks (T - 1 ints, or one int for all).
        ids: Integer ids, any shape, any order, duplicates allowed. With several tables
            they are global ids `t * prod(p) + i` (as in the TTRows op).
        num_tables: Number of tables stacked in the cores.
        dtype: Result dtype; default float64 if every core is float64, else float32.

    Returns:
        `[*ids.shape, D]` rows.

    Raises:
        ValueError: Inconsistent shapes, or an id outside `[0, num_tables * prod(p))`
            (`ids[3] = 9001 is not in [0, 4096)`, flat position).

    Example:
        >>> cores = initial_cores(1000, 8, [10, 10, 10], [2, 2, 2], [3, 3], seed=0)
        >>> rows(cores, [10, 10, 10], [2, 2, 2], [3, 3], [7, 999, 7]).shape
        (3, 8)
    """
    p, q, ranks = _check_shapes(p, q, ranks)
    num_tables = _args.positive_int("num_tables", num_tables)
    blocks = _blocks(cores, p, q, ranks, num_tables)
    ids = np.asarray(ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
    flat = ids.reshape(-1).astype(np.int64)
    total = num_tables * math.prod(p)
    bad = np.flatnonzero((flat < 0) | (flat >= total))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"ids[{j}] = {int(flat[j])} is not in [0, {total})")
    big_p = math.prod(p)
    table, local = flat // big_p, flat % big_p
    # Chain the blocks left to right: acc[n, (j_0..j_t), a_{t+1}].
    acc = np.ones((flat.size, 1, 1))
    for k in range(len(p)):
        stride = math.prod(p[k + 1 :])
        digit = (local // stride) % p[k]
        block = blocks[k][table * p[k] + digit]  # [n, r_k, q_k, r_{k+1}]
        _, r_in, q_k, r_out = block.shape
        # [n, (j_0..j_{k-1}), r_k] @ [n, r_k, q_k * r_{k+1}] -> [n, (j_0..j_k), r_{k+1}]
        acc = np.matmul(acc, block.reshape(flat.size, r_in, q_k * r_out))
        acc = acc.reshape(flat.size, acc.shape[1] * q_k, r_out)
    out = acc.reshape(*ids.shape, math.prod(q))
    return out.astype(_result_dtype(cores, dtype))


def to_dense(
    cores: Sequence[np.ndarray],
    p_shapes: Sequence[int],
    q_shapes: Sequence[int],
    ranks: int | Sequence[int],
    num_embeddings: int | None = None,
    *,
    num_tables: int = 1,
    table: int = 0,
    dtype=None,
) -> np.ndarray:
    """The full `[N, D]` table of TT cores, computed in float64.

    Args:
        cores, p_shapes, q_shapes, ranks, num_tables, dtype: As `cores`, `p`, `q`,
            `ranks`, `num_tables` and `dtype` of `rows`.
        num_embeddings: N (`<= prod(p_shapes)`): the rows returned; default all
            `prod(p_shapes)` rows.
        table: Which table to expand, in `[0, num_tables)`.

    Returns:
        The `[N, D]` table.

    Raises:
        ValueError: Inconsistent shapes or arguments.

    Example:
        >>> cores = initial_cores(1000, 8, [10, 10, 10], [2, 2, 2], [3, 3], seed=0)
        >>> to_dense(cores, [10, 10, 10], [2, 2, 2], [3, 3], 990).shape
        (990, 8)
    """
    p, q, ranks = _check_shapes(p_shapes, q_shapes, ranks)
    num_tables = _args.positive_int("num_tables", num_tables)
    if not _is_int(table) or not 0 <= int(table) < num_tables:
        raise ValueError(f"table must be in [0, {num_tables}), got {table!r}")
    big_p = math.prod(p)
    n = big_p if num_embeddings is None else _args.positive_int("num_embeddings", num_embeddings)
    if n > big_p:
        raise ValueError(f"num_embeddings = {n} must be <= prod(p_shapes) = {big_p}")
    blocks = _blocks(cores, p, q, ranks, num_tables)
    # acc[(i_0..i_t), (j_0..j_t), a_{t+1}], built one core at a time.
    acc = np.ones((1, 1, 1))
    for k in range(len(p)):
        block = blocks[k][table * p[k] : (table + 1) * p[k]]  # [p_k, r_k, q_k, r_{k+1}]
        acc = np.einsum("ixa,dajb->idxjb", acc, block)
        acc = acc.reshape(acc.shape[0] * acc.shape[1], acc.shape[2] * acc.shape[3], acc.shape[4])
    dense = acc.reshape(big_p, math.prod(q))[:n]
    return dense.astype(_result_dtype(cores, dtype))


# --------------------------------------------------------------------------------------
# Decomposition: dense table -> cores (TT-SVD)
# --------------------------------------------------------------------------------------


class TTDecomposition(NamedTuple):
    """The result of `from_dense`.

    Attributes:
        cores: T arrays `[p_k, r_k * q_k * r_{k+1}]` (float64 for a float64 input, else
            float32).
        p_shapes: Row shapes used.
        q_shapes: Column shapes used.
        ranks: Inner ranks used (the requested ones capped at each unfolding's size).
        relative_error: `||A - to_dense(cores)||_F / ||A||_F` of the returned cores
            (0.0 for an all-zero A that is reproduced exactly).
    """

    cores: list[np.ndarray]
    p_shapes: list[int]
    q_shapes: list[int]
    ranks: list[int]
    relative_error: float


def from_dense(
    matrix,
    tt_ranks: int | Sequence[int],
    tt_p_shapes: Sequence[int] | None = None,
    tt_q_shapes: Sequence[int] | None = None,
) -> TTDecomposition:
    """TT-SVD of a dense `[N, D]` table: sequential truncated SVDs, in float64.

    The table is padded with zero rows to `P = prod(p)`, viewed as the tensor
    `[p_0, ..., p_{T-1}, q_0, ..., q_{T-1}]` (row and column digits, most significant
    first), transposed to `[p_0, q_0, p_1, q_1, ...]`, and split core by core with SVDs
    truncated to the requested ranks (capped at the rank each unfolding can have). With
    ranks at least the table's TT ranks the reconstruction is exact up to rounding.

    Args:
        matrix: The `[N, D]` table (any float dtype).
        tt_ranks: Inner ranks, a list of T - 1 ints or one int for all.
        tt_p_shapes: Row shapes (prod >= N), default `suggested_shapes(N, T)`.
        tt_q_shapes: Column shapes (prod == D), default `suggested_shapes(D, T, exact=True)`.

    Returns:
        A `TTDecomposition`.

    Raises:
        ValueError: A matrix that is not 2-D or empty, or bad shapes/ranks.

    Example:
        >>> a = np.random.default_rng(0).standard_normal((30, 8))
        >>> dec = from_dense(a, 64, [2, 3, 5], [2, 2, 2])
        >>> dec.ranks, dec.relative_error < 1e-12
        ([4, 10], True)
    """
    a = np.asarray(matrix)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"matrix must be a non-empty 2-D array [N, D], got shape {a.shape}")
    n, dim = a.shape
    p, q, requested = resolve_shapes(n, dim, tt_ranks, tt_p_shapes, tt_q_shapes)
    out_dtype = np.float64 if a.dtype == np.float64 else np.float32
    num_cores = len(p)
    big_p = math.prod(p)

    padded = np.zeros((big_p, dim))
    padded[:n] = a
    tensor = padded.reshape(*p, *q)
    order = [ax for k in range(num_cores) for ax in (k, num_cores + k)]
    tensor = tensor.transpose(order)  # [p_0, q_0, p_1, q_1, ...]

    modes = [p[k] * q[k] for k in range(num_cores)]
    ranks = []
    cores = []
    left_rank = 1
    rest = np.ascontiguousarray(tensor).reshape(1, -1)
    for k in range(num_cores - 1):
        unfolding = rest.reshape(left_rank * modes[k], -1)
        u, s, vt = np.linalg.svd(unfolding, full_matrices=False)
        r = min(requested[k], unfolding.shape[0], unfolding.shape[1])
        core = u[:, :r].reshape(left_rank, p[k], q[k], r)
        cores.append(core)
        rest = s[:r, None] * vt[:r]
        ranks.append(r)
        left_rank = r
    cores.append(rest.reshape(left_rank, p[-1], q[-1], 1))

    ours = [
        np.ascontiguousarray(c.transpose(1, 0, 2, 3)).reshape(c.shape[1], -1).astype(out_dtype)
        for c in cores
    ]
    approx = to_dense(ours, p, q, ranks, n, dtype=np.float64)
    exact = a.astype(np.float64)
    norm = float(np.linalg.norm(exact))
    diff = float(np.linalg.norm(exact - approx))
    error = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
    return TTDecomposition(ours, p, q, ranks, error)


# --------------------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------------------


def _routes(rng: np.random.Generator, count: int, sources: int, targets: int) -> np.ndarray:
    """`count` independent random maps [0, sources) -> [0, targets): `[count, sources]`.

    Each map is as balanced as possible: injective when sources <= targets, otherwise
    every target receives floor or ceil of sources / targets sources.
    """
    width = max(sources, targets)
    shuffled = np.argsort(rng.random((count, width)), axis=1)  # a permutation per map
    return shuffled[:, :sources] % targets


def _stratified(rng: np.random.Generator, draw, groups: int, size) -> np.ndarray:
    """`[groups, *size]` draws of a law, each exactly distributed as `draw`'s, spread evenly.

    `draw(shape)` returns i.i.d. samples. Per group (a table) we draw `k * n` of them
    (n = prod(size)), sort them, take one at a random rank from each block of k
    consecutive ranks, and shuffle: each output is a uniformly random element of an
    i.i.d. sample, so exactly of the law, while the n outputs of a group cover its
    quantiles evenly (Latin-hypercube-like), so that a core of a few hundred entries
    already has nearly the law's moments. Groups are independent.
    """
    n = math.prod(size)
    k = max(1, min(16, (1 << 21) // max(groups * n, 1)))
    pool = np.sort(draw((groups, n * k)), axis=1)
    picked = np.take_along_axis(pool, np.arange(n) * k + rng.integers(0, k, (groups, n)), axis=1)
    shuffle = np.argsort(rng.random((groups, n)), axis=1)
    return np.take_along_axis(picked, shuffle, axis=1).reshape(groups, *size)


def _balanced_signs(rng: np.random.Generator, groups: int, size) -> np.ndarray:
    """`[groups, *size]` random +-1, half of each per group (one more of either if odd)."""
    n = math.prod(size)
    signs = np.where(np.arange(n) % 2 == 0, 1.0, -1.0) * np.where(
        rng.random((groups, 1)) < 0.5, -1.0, 1.0
    )
    shuffle = np.argsort(rng.random((groups, n)), axis=1)
    return np.take_along_axis(signs, shuffle, axis=1).reshape(groups, *size)


def _approx_magnitudes(rng, dist: str, k: int, num_cores: int, groups: int, size) -> np.ndarray:
    """Positive factors m_k, E[m_k^2] = 1, whose product over k = 0..T-1 has the target law.

    uniform: m_k = 3^(1/(2T)) exp(-G_k), G_k ~ Gamma(1/T). The G_k sum to an Exp(1)
      variable E (the exponential law is infinitely divisible), and exp(-E) ~ U(0, 1), so
      prod_k m_k = sqrt(3) U(0, 1): with a random sign, uniform with unit variance.
    normal: Gamma(1/2) = Beta(1/2, 1/2) Beta(2/2, 1/2) ... Beta((T-1)/2, 1/2) Gamma(T/2)
      with independent factors (beta-gamma algebra: Gamma(a) = Beta(a, b) Gamma(a + b)),
      and Z^2 / 2 ~ Gamma(1/2) for Z ~ N(0, 1). Core k < T-1 takes the (k+1)-th beta
      factor, the last core the Gamma(T/2) one, each divided by its mean: the product of
      their square roots is |Z|.
    """
    if dist == "approx-uniform":
        t = num_cores

        def draw(m):
            return 3.0 ** (0.5 / t) * np.exp(-rng.gamma(1.0 / t, 1.0, m))

    elif k < num_cores - 1:
        a = (k + 1) / 2.0

        def draw(m):  # Beta(a, 1/2) = X / (X + Y), X ~ Gamma(a), Y ~ Gamma(1/2) ~ Z^2 / 2
            x = 0.5 * rng.standard_normal(m) ** 2 if a == 0.5 else rng.gamma(a, 1.0, m)
            y = 0.5 * rng.standard_normal(m) ** 2
            return np.sqrt(x / (x + y) * (a + 0.5) / a)

    else:
        t = num_cores

        def draw(m):
            return np.sqrt(rng.gamma(t / 2.0, 1.0, m) * 2.0 / t)

    return _stratified(rng, draw, groups, size)


def _approx_cores(rng, dist, p, q, ranks, num_tables, scale) -> list[np.ndarray]:
    """Cores [num_tables * p_k, r_k, q_k, r_{k+1}] for approx-uniform / approx-normal.

    Each (core row, incoming rank index a_k, column digit j_k) continues on one outgoing
    index a_{k+1}: random maps, as balanced as possible (in core 0, whose r_0 = 1, each
    table's (i_0, j_0) pairs are spread over the r_1 indices; in a later core, each row's
    (a_k, j_k) pairs over the r_{k+1} indices). So each table entry follows one chain of
    rank indices, and is the product of T independent non-zero core entries: a random
    sign times `scale ** (1/T)` times the factor of `_approx_magnitudes`.
    """
    num_cores = len(p)
    r = _full_ranks(ranks)
    per_core = scale ** (1.0 / num_cores)
    cores = []
    for k in range(num_cores):
        count = num_tables * p[k]
        if k == 0:
            targets = _routes(rng, num_tables, p[0] * q[0], r[1])
        else:
            targets = _routes(rng, count, r[k] * q[k], r[k + 1])
        targets = targets.reshape(count, r[k], q[k], 1)
        size = (p[k], r[k], q[k])  # per table
        magnitudes = _approx_magnitudes(rng, dist, k, num_cores, num_tables, size)
        values = per_core * _balanced_signs(rng, num_tables, size) * magnitudes
        block = np.zeros((count, r[k], q[k], r[k + 1]))
        np.put_along_axis(block, targets, values.reshape(count, r[k], q[k], 1), axis=3)
        cores.append(block)
    return cores


def initial_cores(
    num_embeddings: int,
    embedding_dim: int,
    p: Sequence[int],
    q: Sequence[int],
    ranks: int | Sequence[int],
    weight_dist: str = "approx-uniform",
    seed: int | np.random.Generator | None = None,
    num_tables: int = 1,
    dtype=np.float32,
) -> list[np.ndarray]:
    """Random initial TT cores; the full table is never built.

    The target is DLRM's embedding initialisation U(-1/sqrt(N), 1/sqrt(N)), whose
    entries have mean 0 and standard deviation `sigma = 1/sqrt(3N)`.

    * `"approx-uniform"` / `"approx-normal"`: every table entry follows
      U(-1/sqrt(N), 1/sqrt(N)), respectively N(0, 1/(3N)), exactly in law (in shape, not
      only in variance). Each entry is routed through one chain of rank indices: in
      core 0 the digits (`i_0`, `j_0`) pick `a_1`, in each later core (`i_k`, `a_k`,
      `j_k`) pick `a_{k+1}` (random maps, as balanced as possible). Only the routed core
      entries are non-zero, so each entry is a product of T independent core entries: a
      random sign times a positive factor, the T factors multiplying to a uniform
      (respectively half-normal) variable by an exact product decomposition of that law
      (see `_approx_magnitudes`). Different entries use different rank components, so
      the table has full TT ranks (it is not rank-1), and the zero core entries receive
      gradients (all of them from the first step when `p_0 q_0 >= r_1`). Within a table,
      each core's factors and signs are stratified (evenly spread over the law's
      quantiles, each still exactly of the law), so that one table's empirical
      statistics are close to the law's too. Measured on 2,000 sampled
      rows, 10 seeds each, N from 5,000 to 10,000,000, 2 to 4 cores, ranks 1 to 32:
      excess kurtosis -1.20 (median; -1.24 to -1.15 per table) for approx-uniform
      (uniform: -1.2) and 0.00 (-0.10 to +0.15) for approx-normal (normal: 0), std
      within 3% of sigma, signs 50 +- 0.7% positive. Tiny cores (p_k q_k of a few tens)
      fluctuate more: up to 5% in std and +-0.35 in kurtosis at p = [10, 10, 10],
      q = [2, 2, 2].
    * `"uniform"` / `"normal"`: cores i.i.d. U(-a, a), respectively N(0, v), with the
      per-core variance `v = (sigma^2 / prod_k r_k)^(1/T)`, so that the entries, sums of
      `prod_k r_k` products of T core entries, have variance `v^T prod_k r_k = sigma^2`.
      Their shape is not controlled: a sum of products, heavy-tailed unless the ranks are
      large. Measured excess kurtosis, uniform / normal: +0.15 / +0.39 at q = [4, 4, 4],
      ranks [32, 32]; +1.4 / +2.7 with 4 cores, ranks [8, 8, 8]; +2.8 / +23 with 3
      cores, ranks [1, 1]. One table's std also fluctuates more (up to 13% at rank 1).
    * `"naive-uniform"`: the TT-Rec paper's naive baseline, cores i.i.d.
      U(0, 1/sqrt(N)). Kept for comparison only: every entry is positive, with mean
      `prod_k r_k / (2 sqrt(N))^T`, orders of magnitude off sigma (far too small for
      T >= 3 and usual ranks, too large for large ranks and small N).

    Args:
        num_embeddings: N, which sets the target scale.
        embedding_dim: D, must equal `prod(q)`.
        p: Row shapes, `prod(p) >= N`.
        q: Column shapes.
        ranks: Inner ranks, T - 1 ints or one int.
        weight_dist: One of `WEIGHT_DISTS`.
        seed: An int, a `np.random.Generator`, or None for fresh entropy.
        num_tables: Independent tables stacked along each core's rows.
        dtype: The cores' dtype (computed in float64, then cast).

    Returns:
        T arrays `[num_tables * p_k, r_k * q_k * r_{k+1}]`.

    Raises:
        ValueError: Bad shapes, an unknown `weight_dist` (the choices are listed) or a
            non-float dtype.

    Example:
        >>> p, q, r = [100, 100, 100], [4, 4, 4], [8, 8]
        >>> cores = initial_cores(1_000_000, 64, p, q, r, "approx-uniform", seed=0)
        >>> [c.shape for c in cores]
        [(100, 32), (100, 256), (100, 32)]
        >>> ids = np.random.default_rng(1).integers(0, 1_000_000, 2000)
        >>> x = rows(cores, p, q, r, ids)  # [2000, 64], never the full table
        >>> bool(abs(x.std() * np.sqrt(3e6) - 1) < 0.1), bool(np.abs(x).max() <= 1e-3)
        (True, True)
    """
    if not isinstance(weight_dist, str) or weight_dist not in WEIGHT_DISTS:
        raise ValueError(
            f"weight_dist must be one of {', '.join(repr(w) for w in WEIGHT_DISTS)}, "
            f"got {weight_dist!r}"
        )
    p, q, ranks = resolve_shapes(num_embeddings, embedding_dim, ranks, p, q)
    num_tables = _args.positive_int("num_tables", num_tables)
    try:
        out_dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be a float dtype, got {dtype!r}") from None
    if out_dtype.kind != "f" and out_dtype.name != "bfloat16":
        raise ValueError(f"dtype must be a float dtype, got {out_dtype.name}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)

    n = int(num_embeddings)
    num_cores = len(p)
    r = _full_ranks(ranks)
    sigma = 1.0 / math.sqrt(3.0 * n)
    if weight_dist in ("approx-uniform", "approx-normal"):
        blocks = _approx_cores(rng, weight_dist, p, q, ranks, num_tables, sigma)
    else:
        # Stacking the tables' rows, one draw covers all of them, independently.
        shapes = [(num_tables * p[k], r[k], q[k], r[k + 1]) for k in range(num_cores)]
        var = (sigma**2 / math.prod(ranks)) ** (1.0 / num_cores)
        if weight_dist == "uniform":
            bound = math.sqrt(3.0 * var)
            blocks = [rng.uniform(-bound, bound, s) for s in shapes]
        elif weight_dist == "normal":
            blocks = [rng.normal(0.0, math.sqrt(var), s) for s in shapes]
        else:  # naive-uniform
            blocks = [rng.uniform(0.0, 1.0 / math.sqrt(n), s) for s in shapes]
    return [b.reshape(b.shape[0], -1).astype(out_dtype) for b in blocks]
