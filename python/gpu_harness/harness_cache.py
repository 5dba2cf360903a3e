"""ctypes harness, part two: TT embedding bags with the device-side row cache (the fused
TT update and the cache pipeline of tt_cache_kernels.cu, the counting of
cuda/tt_update_kernels.cu), over the library harness.py loads."""

from __future__ import annotations

import ctypes
import os
from typing import Optional, Union

import torch
from harness import (
    DTYPE_CODES,
    TTShape,
    TTState,
    bind,
    current_stream,
    load,
    load_tt,
    out_ptr,
    poison,
    ptr,
    tt_bags_of_rows,
    tt_check_ids_args,
    tt_rows_async,
    tt_unique_ids_async,
)

# ---------------------------------------------------------------------------------------
# TT embedding bags with the device-side row cache (cuda/tt_update_kernels.cuh, C ABI in
# python/gpu_harness/tt_update_capi.cu). The cached forward is the layer's composition
# (tf_ttemb/ops/tt_embedding.py `_rows_with_cache`: hits read the cache rows, only the
# misses go to TTRows, the two are stitched into the rows [U, D]), with U and the number of
# misses kept on the device:
#   unique_ids, slots = TTUniqueIds(ids)            unique_ids [nnz]: the first U sorted,
#                                                   the rest EMPTY_CACHE_ID (skipped below)
#   lookup(unique_ids, cache_ids)                   position (cache slot or -1), miss_rank,
#                                                   miss_ids (compacted, padded with id 0),
#                                                   counts = {hits, misses} on the device
#   miss_rows = TTRows(miss_ids, num_ids=misses)    [nnz, D], the first `misses` rows written
#   rows = select(cache_rows[position] | miss_rows[miss_rank])   [nnz, D] (rows U.. zero)
#   out = gather_reduce_sum(rows, slots, offsets, weights, padding_id=-1)
# Buffers are sized by the upper bound nnz; nothing is read back unless check=True.
# Populating the cache (count, populate, TT rows of the fresh ids, select) is also here.

EMPTY_CACHE_ID = 2**63 - 1


class SparseUpdateSlice(ctypes.Structure):
    """One variable of ttupd_sparse_update (python/gpu_harness/tt_update_capi.cu)."""

    _fields_ = [
        ("var", ctypes.c_void_p),
        ("accum", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("num_valid", ctypes.c_void_p),
        ("num_rows", ctypes.c_int64),
        ("width", ctypes.c_int64),
        ("n", ctypes.c_int64),
    ]


_cache_loaded = False


def _load_cache() -> ctypes.CDLL:
    global _cache_loaded
    lib = load_tt()
    if _cache_loaded:
        return lib
    vp, sz, i32, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int64
    f64 = ctypes.c_double
    sigs = {
        "ttupd_max_slices": (i32, []),
        "ttupd_error_string": (ctypes.c_char_p, [i32]),
        "ttupd_sparse_update": (
            i32,
            [i32, i32, ctypes.POINTER(SparseUpdateSlice), i32, f64, f64, vp],
        ),
        "ttupd_select_rows": (i32, [i32, i64, i64, vp, i64, vp, vp, i64, vp, vp, vp]),
        "ttupd_cache_count_scratch_bytes": (sz, [i64, i64, i64]),
        "ttupd_cache_count": (i32, [vp, i64, i64, vp, vp, i64, vp, sz, vp]),
        "ttupd_cache_lookup_scratch_bytes": (sz, [i64]),
        "ttupd_cache_lookup": (
            i32,
            [vp, i64, vp, i64, i64, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        ),
        "ttupd_cache_populate_scratch_bytes": (sz, [i64, i64]),
        "ttupd_cache_populate": (
            i32,
            [vp, vp, i64, vp, i64, i64, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        ),
    }
    bind(lib, sigs)
    _cache_loaded = True
    return lib


def load_tt_update(path: Optional[Union[str, os.PathLike]] = None) -> ctypes.CDLL:
    """The harness library with the fused TT update and row cache functions bound."""
    load(path)
    return _load_cache()


def _check_upd(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed: {_load_cache().ttupd_error_string(code).decode()}")


def _launch_upd(fn, what: str, *args, scratch_bytes: int, device) -> None:
    """Runs ttupd launcher fn(*args, scratch, its bytes, stream) with scratch of
    scratch_bytes (at least 256) on `device`; raises RuntimeError naming `what` if it fails."""
    scratch = torch.empty(max(int(scratch_bytes), 256), dtype=torch.uint8, device=device)
    _check_upd(fn(*args, scratch.data_ptr(), scratch.numel(), current_stream()), what)


def _int64_outputs(device, n: int, *names: str, **sizes: int) -> dict:
    """Fresh int64 vectors (poisoned when POISON is set) by name: [n] for each of names,
    then [size] for each name=size."""
    sizes = dict(dict.fromkeys(names, n), **sizes)
    return {k: poison(torch.empty(m, dtype=torch.int64, device=device)) for k, m in sizes.items()}


def tt_cache_count(ids, keys, counts, id_bound=0):
    """TTCacheCount: adds the batch's ids (int64 global ids, negatives skipped) to the
    frequency table (keys, counts: [H] int64 CUDA tensors, updated in place). id_bound: every
    id is below it (the radix sort then runs on fewer bits); 0 = unknown."""
    lib = _load_cache()
    ids = ids.contiguous()
    if ids.dtype != torch.int64 or keys.dtype != torch.int64 or counts.dtype != torch.int64:
        raise TypeError("ids, keys and counts must be int64")
    n, h = ids.numel(), keys.numel()
    _launch_upd(
        lib.ttupd_cache_count,
        "cache count",
        *(out_ptr(ids), n, int(id_bound), out_ptr(keys), out_ptr(counts), h),
        scratch_bytes=lib.ttupd_cache_count_scratch_bytes(n, h, int(id_bound)),
        device=ids.device,
    )


def tt_cache_populate(keys, counts, old_ids, fresh_pad_id=0):
    """Cache populate (ids part): dict of new_ids, src, fresh_rank, fresh_ids, fresh_at
    ([C] int64 each) and num_fresh ([1], on the device)."""
    lib = _load_cache()
    c = old_ids.numel()
    dev = old_ids.device
    names = ("new_ids", "src", "fresh_rank", "fresh_ids", "fresh_at")
    out = _int64_outputs(dev, c, *names, num_fresh=1)
    _launch_upd(
        lib.ttupd_cache_populate,
        "cache populate",
        *(
            out_ptr(keys),
            out_ptr(counts),
            keys.numel(),
            out_ptr(old_ids.contiguous()),
            c,
            int(fresh_pad_id),
        ),
        *(out_ptr(out[k]) for k in names),
        out["num_fresh"].data_ptr(),
        scratch_bytes=lib.ttupd_cache_populate_scratch_bytes(keys.numel(), c),
        device=dev,
    )
    return out


def tt_cache_lookup(ids, cache_ids, miss_pad_id=0):
    """Cache lookup of sorted distinct global ids [n] (entries >= EMPTY_CACHE_ID or < 0 are
    neither hits nor misses): dict of position, miss_rank, miss_ids, miss_at ([n] int64) and
    counts ([2] = {hits, misses}, on the device)."""
    lib = _load_cache()
    ids = ids.contiguous()
    n = ids.numel()
    dev = ids.device
    names = ("position", "miss_rank", "miss_ids", "miss_at")
    out = _int64_outputs(dev, n, *names, counts=2)
    _launch_upd(
        lib.ttupd_cache_lookup,
        "cache lookup",
        *(out_ptr(ids), n, out_ptr(cache_ids.contiguous()), cache_ids.numel(), int(miss_pad_id)),
        *(out_ptr(out[k]) for k in names),
        *(None, None, out["counts"].data_ptr()),
        scratch_bytes=lib.ttupd_cache_lookup_scratch_bytes(n),
        device=dev,
    )
    return out


def tt_select_rows(a, sel_a, b=None, sel_b=None, out=None):
    """out[j] = a[sel_a[j]] if sel_a[j] >= 0, else b[sel_b[j]] if sel_b[j] >= 0, else 0."""
    lib = _load_cache()
    n = sel_a.numel()
    width = a.shape[1]
    if out is None:
        out = poison(torch.empty(n, width, dtype=a.dtype, device=a.device))
    if b is not None and (b.dtype != a.dtype or b.shape[1] != width):
        raise ValueError("a and b must have the same dtype and width")
    _check_upd(
        lib.ttupd_select_rows(
            DTYPE_CODES[a.dtype],
            n,
            width,
            ptr(a.contiguous()),
            a.shape[0],
            ptr(sel_a),
            None if b is None else ptr(b.contiguous()),
            0 if b is None else b.shape[0],
            None if sel_b is None else ptr(sel_b),
            out_ptr(out),
            current_stream(),
        ),
        "select rows",
    )
    return out


def tt_cache_fill(shape: TTShape, cores, keys, counts, cache_size, old_ids=None, old_rows=None):
    """The layer's cache_populate on the device: the cache_size most frequent ids of the
    frequency table, staying rows kept from old_rows, fresh rows computed by TTRows from the
    cores (only num_fresh of them, a device count), empty slots zero. Returns (cache_ids [C]
    sorted, EMPTY_CACHE_ID for empty slots, cache_rows [C, D], populate dict). No read-back."""
    cores = shape.check_cores(cores)
    dev = keys.device
    dtype = cores[0].dtype
    if old_ids is None:
        old_ids = torch.full((cache_size,), EMPTY_CACHE_ID, dtype=torch.int64, device=dev)
        old_rows = torch.zeros(cache_size, shape.dim, dtype=dtype, device=dev)
    pop = tt_cache_populate(keys, counts, old_ids, fresh_pad_id=0)
    fresh_rows, _ = tt_rows_async(shape, cores, pop["fresh_ids"], pop["num_fresh"])
    rows = tt_select_rows(old_rows, pop["src"], fresh_rows, pop["fresh_rank"])
    return pop["new_ids"], rows, pop


def tt_embedding_bag_forward_cached(
    cores,
    p_shapes,
    q_shapes,
    ranks,
    ids,
    offsets,
    cache_ids,
    cache_rows,
    weights=None,
    combiner="sum",
    num_tables=1,
    table_splits=None,
    padding_id=None,
    num_embeddings=None,
    check=True,
):
    """Forward of a TT embedding bag with a row cache; returns (out [B, D], TTState).

    cache_ids [C] int64: sorted global ids, EMPTY_CACHE_ID in empty slots (at the end);
    cache_rows [C, D] of the cores' dtype. Cached ids read their cache row, the others are
    computed from the cores. No host synchronisation unless check=True. The state holds the
    intermediates (unique, slots, num_unique, lookup, miss_rows, rows)."""
    shape = TTShape(p_shapes, q_shapes, ranks, num_tables)
    cores = shape.check_cores(cores)
    n_emb, table_splits = tt_check_ids_args(shape, ids, table_splits, num_embeddings)
    if cache_ids.dtype != torch.int64 or cache_ids.dim() != 1:
        raise ValueError("cache_ids must be an int64 vector")
    if (
        tuple(cache_rows.shape) != (cache_ids.numel(), shape.dim)
        or cache_rows.dtype != cores[0].dtype
    ):
        raise ValueError(
            f"cache_rows must be [{cache_ids.numel()}, {shape.dim}] of the cores' dtype"
        )
    unique, slots, urep = tt_unique_ids_async(
        ids, table_splits, n_emb, shape.rows_per_table, padding_id, unique_fill=EMPTY_CACHE_ID
    )
    lookup = tt_cache_lookup(unique, cache_ids, miss_pad_id=0)
    num_miss = lookup["counts"][1:2]
    miss_rows, rrep = tt_rows_async(shape, cores, lookup["miss_ids"], num_miss)
    rows = tt_select_rows(cache_rows, lookup["position"], miss_rows, lookup["miss_rank"])
    state = TTState(shape=shape, cores=cores, unique=unique, slots=slots, num_unique=urep[2:3])
    state.__dict__.update(lookup=lookup, num_miss=num_miss, miss_rows=miss_rows)
    return tt_bags_of_rows(state, rows, offsets, weights, combiner, urep, n_emb, padding_id, check)
