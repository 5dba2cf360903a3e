"""Checks and benchmarks the CUDA fused TT update and device-side row cache, without TensorFlow.

    python3 python/gpu_harness/check_tt_update.py --lib LIB          # checks + benchmarks
    python3 python/gpu_harness/check_tt_update.py --lib LIB --small  # for compute-sanitizer
    python3 python/gpu_harness/check_tt_update.py --crosscheck-cpu-op
        # no GPU: the Python model of TTCacheCount against the TF CPU op
    python3 python/gpu_harness/gpu_check.py --only tt_update --lib LIB  # the same, via the driver

LIB is libtf_ttemb_gpu_harness.so (python/gpu_harness/build_gpu_harness.sh), which holds the C ABI
of python/gpu_harness/tt_update_capi.cu over the launchers of cuda/tt_update_kernels.cuh.

Correctness, against independent references computed on the CPU:
  * fused SGD / Adagrad (LaunchSparseUpdate): every dtype (f16, bf16, f32, f64), widths
    1, 3, 33, 4096 (and 128), p_k up to 1000 with n_k = p_k and random subsets, skipped
    rows (-1, >= p_k), a device-side row count, several variables in one launch, a
    problem larger than the capped grid. Two references: an operation-by-operation numpy
    model of the layer's TF ops (each product, sum, square root and quotient rounded in
    the compute type, the accumulator rounded to T before it is read) that the kernel
    must equal bit for bit, and float64 within the dtype's tolerance. Rows not listed
    must stay bitwise unchanged.
  * counting (LaunchCacheCount) against a Python model of the CPU TTCacheCount kernel,
    over several batches (Zipf ids, padding -1, tables of 1 to 65,536 slots, tables that
    fill up so the space-saving replacement runs), bit for bit.
  * lookup, row select/stitch and populate against numpy ports of the layer's TF code
    (searchsorted, stable argsorts, where/scatter), and a layer-like chain: count,
    populate, lookup, stitch, Adagrad on the hit cache rows, gradient split for the
    misses, with no host read-back inside the chain.
  * determinism: every launcher twice on the same inputs, bitwise.
Outputs are poisoned before each launch so unwritten elements fail.

Benchmarks (CUDA-event medians, rotated input sets): the update at FBTT's shape (cores
of p = [200, 220, 250], widths 128 / 4096 / 128, every row touched, one launch for the
three cores) and at large sizes, in GB/s against a device-to-device copy; counting,
lookup, stitch and populate at FBTT-like sizes. Writes JSON to $OUT when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tt_cache_model import (  # noqa: E402
    EMPTY,
    count_ref,
    crosscheck_cpu_op,
    log,
    lookup_ref,
    populate_ref,
    zipf_ids,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
SGD, ADAGRAD = 0, 1
OPT_NAMES = {SGD: "sgd", ADAGRAD: "adagrad"}


torch = None
LIB = None
Slice = None  # harness_cache.SparseUpdateSlice, set by load()
DTYPES = []
SHORT = {}
TOL = {}


def load(path):
    global LIB, Slice
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import harness_cache

    Slice = harness_cache.SparseUpdateSlice
    LIB = harness_cache.load_tt_update(path)


def code_of(dtype):
    return {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}[dtype]


def ptr(t):
    return None if t is None or t.numel() == 0 else t.data_ptr()


def stream():
    return torch.cuda.current_stream().cuda_stream


def check(code, what):
    if code != 0:
        raise RuntimeError(f"{what} failed: {LIB.ttupd_error_string(code).decode()}")


_scratch = {}


def scratch(nbytes):
    """A cached device buffer of at least nbytes (poisoned with 0xAB on first use)."""
    buf = _scratch.get("buf")
    if buf is None or buf.numel() < nbytes:
        buf = torch.full((max(nbytes, 256),), 0xAB, dtype=torch.uint8, device="cuda")
        _scratch["buf"] = buf
    return buf


# -- launch wrappers ---------------------------------------------------------


def launch(fn, what, *args, nbytes):
    """Runs launcher fn(*args, scratch, nbytes, stream) with the cached scratch buffer."""
    buf = scratch(nbytes)
    check(fn(*args, buf.data_ptr(), nbytes, stream()), what)


def sparse_update(opt, slices, lr, eps):
    """slices: list of dicts var, accum, rows, grad, num_valid (tensors or None)."""
    arr = (Slice * max(1, len(slices)))()
    for k, s in enumerate(slices):
        arr[k].var = ptr(s["var"])
        arr[k].accum = ptr(s.get("accum"))
        arr[k].rows = ptr(s["rows"])
        arr[k].grad = ptr(s["grad"])
        arr[k].num_valid = ptr(s.get("num_valid"))
        arr[k].num_rows = s["var"].shape[0]
        arr[k].width = s["var"].shape[1]
        arr[k].n = s["rows"].numel()
    dtype = slices[0]["var"].dtype
    check(
        LIB.ttupd_sparse_update(code_of(dtype), opt, arr, len(slices), lr, eps, stream()),
        "sparse_update",
    )


def select_rows(a, sel_a, b=None, sel_b=None, width=None, out=None):
    n = sel_a.numel()
    width = a.shape[1] if width is None else width
    if out is None:
        out = torch.full((n, width), float("nan"), dtype=a.dtype, device="cuda")
    check(
        LIB.ttupd_select_rows(
            code_of(a.dtype),
            n,
            width,
            ptr(a),
            a.shape[0],
            ptr(sel_a),
            ptr(b),
            0 if b is None else b.shape[0],
            ptr(sel_b),
            ptr(out),
            stream(),
        ),
        "select_rows",
    )
    return out


def cache_count(ids, keys, counts, id_bound=0):
    n, h = ids.numel(), keys.numel()
    nbytes = LIB.ttupd_cache_count_scratch_bytes(n, h, id_bound)
    args = (ptr(ids), n, id_bound, ptr(keys), ptr(counts), h)
    launch(LIB.ttupd_cache_count, "cache_count", *args, nbytes=nbytes)


def i64_poison(n):
    return torch.full((n,), -7, dtype=torch.int64, device="cuda")


def cache_lookup(ids, cache_ids, pad=0, with_hits=True, out=None):
    n = ids.numel()
    if out is None:
        out = {k: i64_poison(n) for k in ["position", "miss_rank", "miss_ids", "miss_at"]}
        if with_hits:
            out["hit_at"], out["hit_pos"] = i64_poison(n), i64_poison(n)
        out["counts"] = i64_poison(2)
    outputs = ("position", "miss_rank", "miss_ids", "miss_at")
    launch(
        LIB.ttupd_cache_lookup,
        "cache_lookup",
        *(ptr(ids), n, ptr(cache_ids), cache_ids.numel(), pad),
        *(ptr(out[k]) for k in outputs),
        *(ptr(out.get("hit_at")), ptr(out.get("hit_pos")), ptr(out["counts"])),
        nbytes=LIB.ttupd_cache_lookup_scratch_bytes(n),
    )
    return out


def cache_populate(keys, counts, old_ids, pad=0, out=None):
    c = old_ids.numel()
    if out is None:
        out = {k: i64_poison(c) for k in ["new_ids", "src", "fresh_rank", "fresh_ids", "fresh_at"]}
        out["num_fresh"] = i64_poison(1)
    outputs = ("new_ids", "src", "fresh_rank", "fresh_ids", "fresh_at", "num_fresh")
    launch(
        LIB.ttupd_cache_populate,
        "cache_populate",
        *(ptr(keys), ptr(counts), keys.numel(), ptr(old_ids), c, pad),
        *(ptr(out[k]) for k in outputs),
        nbytes=LIB.ttupd_cache_populate_scratch_bytes(keys.numel(), c),
    )
    return out


# -- references ------------------------------------------------------------------


def to_np_compute(t):
    """A CPU numpy copy in the compute type (float64 for double, else float32)."""
    c = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.detach().to("cpu", c).numpy()


def from_np(a, dtype):
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def update_ref_exact(var, acc, rows, grad, opt, lr, eps, n_valid=None):
    """Operation-by-operation model of the layer's TF update, in the compute type.

    Returns CPU tensors (var, acc) of var's dtype."""
    dtype = var.dtype
    ctype = np.float64 if dtype == torch.float64 else np.float32
    var_c = var.detach().cpu().clone()
    acc_c = None if acc is None else acc.detach().cpu().clone()
    rows_np = rows.cpu().numpy()
    n = len(rows_np) if n_valid is None else min(len(rows_np), n_valid)
    idx = np.arange(n)
    keep = (rows_np[:n] >= 0) & (rows_np[:n] < var.shape[0])
    r, i = rows_np[:n][keep], idx[keep]
    if len(r) == 0:
        return var_c, acc_c
    g = to_np_compute(grad.cpu()[torch.from_numpy(i)])
    w = to_np_compute(var_c[torch.from_numpy(r)])
    lr_c, eps_c = ctype(lr), ctype(eps)
    if opt == SGD:
        w_new = w - lr_c * g
    else:
        a = to_np_compute(acc_c[torch.from_numpy(r)])
        a_t = from_np(a + g * g, dtype)
        a_back = to_np_compute(a_t)
        w_new = w - (lr_c * g) / (np.sqrt(a_back) + eps_c)
        acc_c[torch.from_numpy(r)] = a_t
    var_c[torch.from_numpy(r)] = from_np(w_new, dtype)
    return var_c, acc_c


def update_ref_f64(var, acc, rows, grad, opt, lr, eps, n_valid=None):
    """float64 reference of the updated values (inputs as stored)."""
    var64 = var.detach().cpu().double().clone()
    acc64 = None if acc is None else acc.detach().cpu().double().clone()
    rows_np = rows.cpu().numpy()
    n = len(rows_np) if n_valid is None else min(len(rows_np), n_valid)
    keep = (rows_np[:n] >= 0) & (rows_np[:n] < var.shape[0])
    r = torch.from_numpy(rows_np[:n][keep])
    g = grad.detach().cpu().double()[torch.from_numpy(np.arange(n)[keep])]
    if opt == SGD:
        var64[r] -= lr * g
    else:
        acc64[r] += g * g
        var64[r] -= lr * g / (acc64[r].sqrt() + eps)
    return var64, acc64


def bits_equal(a, b):
    """Bitwise equality of two CPU tensors (tells -0 from 0; NaN payloads count)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def rel_err(out, ref, mask_rows=None):
    o, r = out.detach().cpu().double(), ref.double()
    if mask_rows is not None:
        o, r = o[mask_rows], r[mask_rows]
    if r.numel() == 0:
        return 0.0
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / max(float(r.norm()), 1e-300))


# ---------------------------------------------------------------------------
# Checks. Each returns a list of result dicts {name, ok, ...}.

LR, EPS = 0.0371, 0.0137


def rand_rows(gen, p, n):
    return torch.randperm(p, generator=gen)[:n].sort().values


def make_var(gen, p, w, dtype, positive=False):
    x = torch.randn(p, w, generator=gen, dtype=torch.float64)
    if positive:
        x = x.abs() + 0.05
    return x.to(dtype).cuda()


def check_update_case(name, dtype, opt, p, n, width, gen, skipped=False, device_count=None):
    rows = rand_rows(gen, p, n)
    if skipped and n >= 2:
        rows[0] = -1
        rows[-1] = p + 3
    var = make_var(gen, p, width, dtype)
    acc = make_var(gen, p, width, dtype, positive=True) if opt == ADAGRAD else None
    grad = make_var(gen, n, width, dtype)
    rows_d = rows.cuda()
    nv = None
    if device_count is not None:
        nv = torch.tensor([device_count], dtype=torch.int64, device="cuda")
    exact_v, exact_a = update_ref_exact(var, acc, rows_d, grad, opt, LR, EPS, device_count)
    ref_v, ref_a = update_ref_f64(var, acc, rows_d, grad, opt, LR, EPS, device_count)
    var0 = var.cpu().clone()
    sparse_update(opt, [dict(var=var, accum=acc, rows=rows_d, grad=grad, num_valid=nv)], LR, EPS)
    torch.cuda.synchronize()
    got_v = var.cpu()
    bitwise = bits_equal(got_v, exact_v)
    err = rel_err(got_v, ref_v)
    if acc is not None:
        bitwise = bitwise and bits_equal(acc.cpu(), exact_a)
        err = max(err, rel_err(acc.cpu(), ref_a))
    touched = (got_v != var0).any(dim=1).sum().item()
    ok = bitwise and err <= TOL[dtype]
    return {
        "name": name,
        "dtype": SHORT[dtype],
        "opt": OPT_NAMES[opt],
        "p": p,
        "n": n,
        "width": width,
        "ok": ok,
        "bitwise_vs_op_model": bitwise,
        "rel_err_f64": err,
        "rows_changed": touched,
    }


def check_updates(small, gen):
    res = []
    widths = [1, 3, 33, 4096]
    ps = [1, 129, 1000]
    if small:
        widths, ps = [1, 33, 4096], [7, 129]
    for dtype in DTYPES:
        for opt in (SGD, ADAGRAD):
            for width in widths:
                for p in ps:
                    if small and width == 4096 and p > 7:
                        continue
                    res.append(check_update_case("all-rows", dtype, opt, p, p, width, gen))
                    if p == ps[-1]:
                        res.append(
                            check_update_case("subset", dtype, opt, p, p // 3 + 1, width, gen)
                        )
            res.append(check_update_case("skipped", dtype, opt, 300, 120, 33, gen, skipped=True))
            res.append(
                check_update_case("device-count", dtype, opt, 500, 400, 64, gen, device_count=123)
            )
    # Grid-stride: far more rows than the capped grid covers at once.
    if not small:
        for opt in (SGD, ADAGRAD):
            res.append(
                check_update_case("beyond-grid", torch.float32, opt, 2_000_000, 1_500_000, 3, gen)
            )
            res.append(
                check_update_case("beyond-grid", torch.float32, opt, 600_000, 500_000, 64, gen)
            )
    # Several variables in one launch: FBTT-like cores and a cache slice with misses (-1).
    for dtype in DTYPES:
        for opt in (SGD, ADAGRAD):
            slices, refs = [], []
            shapes = [
                (200, 128, 200),
                (220, 4096 if not small else 96, 220),
                (250, 128, 250),
                (300, 64, 90),
            ]
            for k, (p, w, n) in enumerate(shapes):
                if k == 3:
                    rows = torch.full((n,), -1, dtype=torch.int64)
                    hits = rand_rows(gen, p, n // 2)
                    where = rand_rows(gen, n, n // 2)
                    rows[where] = hits
                else:
                    rows = rand_rows(gen, p, n)
                var = make_var(gen, p, w, dtype)
                acc = make_var(gen, p, w, dtype, positive=True) if opt == ADAGRAD else None
                grad = make_var(gen, n, w, dtype)
                rows_d = rows.cuda()
                refs.append(
                    update_ref_exact(var, acc, rows_d, grad, opt, LR, EPS)
                    + update_ref_f64(var, acc, rows_d, grad, opt, LR, EPS)
                )
                slices.append(dict(var=var, accum=acc, rows=rows_d, grad=grad))
            sparse_update(opt, slices, LR, EPS)
            torch.cuda.synchronize()
            bitwise, err = True, 0.0
            for s, (ev, ea, rv, ra) in zip(slices, refs):
                bitwise &= bits_equal(s["var"].cpu(), ev)
                err = max(err, rel_err(s["var"].cpu(), rv))
                if s["accum"] is not None:
                    bitwise &= bits_equal(s["accum"].cpu(), ea)
                    err = max(err, rel_err(s["accum"].cpu(), ra))
            res.append(
                {
                    "name": "multi-slice",
                    "dtype": SHORT[dtype],
                    "opt": OPT_NAMES[opt],
                    "ok": bitwise and err <= TOL[dtype],
                    "bitwise_vs_op_model": bitwise,
                    "rel_err_f64": err,
                }
            )
    return res


def check_select(small, gen):
    res = []
    for dtype in DTYPES:
        for width in [1, 3, 33, 4096] if not small else [3, 33]:
            na, nb, n = 57, 41, 300
            a = make_var(gen, na, width, dtype)
            b = make_var(gen, nb, width, dtype)
            sel_a = torch.randint(-1, na + 3, (n,), generator=gen)
            sel_a[torch.rand(n, generator=gen) < 0.4] = -1
            sel_b = torch.randint(-1, nb + 3, (n,), generator=gen)
            for use_b in (True, False):
                out = select_rows(
                    a, sel_a.cuda(), b if use_b else None, sel_b.cuda() if use_b else None
                )
                torch.cuda.synchronize()
                ref = torch.zeros(n, width, dtype=dtype)
                ac, bc = a.cpu(), b.cpu()
                for j in range(n):
                    ia, ib = int(sel_a[j]), int(sel_b[j])
                    if ia >= 0:
                        if ia < na:
                            ref[j] = ac[ia]
                    elif use_b and 0 <= ib < nb:
                        ref[j] = bc[ib]
                ok = bits_equal(out.cpu(), ref)
                res.append(
                    {
                        "name": "select",
                        "dtype": SHORT[dtype],
                        "width": width,
                        "with_b": use_b,
                        "ok": ok,
                    }
                )
    return res


def check_count(small, gen, rng):
    res = []
    sizes = [1, 7, 32, 33, 100, 1000, 4099, 65536] if not small else [7, 33, 1000]
    batches = 5 if not small else 3
    for size in sizes:
        for start in ("empty", "random"):
            keys = np.full(size, -1, np.int64)
            counts = np.zeros(size, np.int64)
            if start == "random":
                keys = rng.integers(0, 50 * size + 11, size).astype(np.int64)
                keys[rng.random(size) < 0.3] = -1
                counts = rng.integers(0, 40, size).astype(np.int64)
            keys_d, counts_d = torch.from_numpy(keys).cuda(), torch.from_numpy(counts).cuda()
            ok, steps = True, []
            for batch in range(batches):
                n = int(rng.choice([0, 1, 60, 2500, 20000 if not small else 3000]))
                ids = zipf_ids(rng, n, 30 * size + 13, pad_frac=0.1)
                # The id bound cuts the sort to the bits it needs (0: all 64 bits).
                bound = 30 * size + 13 if start == "empty" else 0
                cache_count(torch.from_numpy(ids).cuda(), keys_d, counts_d, bound)
                count_ref(keys, counts, ids)
                same = np.array_equal(keys_d.cpu().numpy(), keys) and np.array_equal(
                    counts_d.cpu().numpy(), counts
                )
                ok &= same
                steps.append((n, bool(same)))
            res.append(
                {
                    "name": "count",
                    "table": size,
                    "start": start,
                    "ok": ok,
                    "batches": steps,
                    "filled": int((keys >= 0).sum()),
                }
            )
    return res


def _compared(out, ref):
    """{"ok", "mismatch": the names of the device outputs (dict of CUDA tensors) that differ
    from the reference's (dict of numpy arrays)}."""
    bad = [k for k in ref if not np.array_equal(out[k].cpu().numpy(), ref[k])]
    return {"ok": not bad, "mismatch": bad}


def _sizes(small, sizes, large):
    """The sizes a cache check runs: `sizes`, then `large` unless --small (the sanitizers'
    sweep)."""
    return sizes if small else sizes + large


def check_lookup(small, gen, rng):
    res = []
    cases = _sizes(
        small,
        [(0, 50), (1, 1), (13, 0), (1000, 300), (5000, 4096), (64, 1000)],
        large=[(200_000, 50_000)],
    )
    for n, c in cases:
        universe = max(4 * (n + c), 10)
        ids = np.sort(rng.choice(universe, size=n, replace=False)).astype(np.int64)
        held = np.sort(rng.choice(universe, size=int(c * 0.8), replace=False)).astype(np.int64)
        cache_ids = np.concatenate([held, np.full(c - len(held), EMPTY, np.int64)])
        if n >= 3:
            ids[1] = -1 if n < 100 else ids[1]  # a skipped id (neither hit nor miss)
            ids = np.sort(ids)
        for pad in (0, -5):
            out = cache_lookup(
                torch.from_numpy(ids).cuda(), torch.from_numpy(cache_ids).cuda(), pad
            )
            ref = lookup_ref(ids, cache_ids, pad)
            hits = int(ref["counts"][0])
            res.append(dict(name="lookup", n=n, cache=c, pad=pad, **_compared(out, ref), hits=hits))
    # Skipped ids: EMPTY in the query.
    ids = np.array([3, 5, 8, EMPTY], np.int64)
    cache_ids = np.array([5, 9, EMPTY], np.int64)
    out = cache_lookup(torch.from_numpy(ids).cuda(), torch.from_numpy(cache_ids).cuda(), 0)
    res.append({"name": "lookup-empty-id", **_compared(out, lookup_ref(ids, cache_ids, 0))})
    return res


def check_populate(small, gen, rng):
    res = []
    cases = _sizes(
        small,
        [(1, 1), (32, 5), (100, 40), (1000, 200), (4099, 1000), (50, 80)],
        large=[(262144, 40000)],
    )
    for table, c in cases:
        for variant in range(2):
            keys = rng.integers(0, 5 * table + 3, table).astype(np.int64)
            keys = np.unique(keys)  # distinct keys, as the counting keeps them
            keys = np.concatenate([keys, np.full(table - len(keys), -1, np.int64)])
            rng.shuffle(keys)
            counts = rng.integers(0, 6, table).astype(np.int64)  # many ties and zeros
            counts[keys < 0] = rng.integers(0, 3, int((keys < 0).sum()))
            live = keys[(keys >= 0) & (counts > 0)]
            old = rng.choice(
                np.concatenate([live, np.arange(5 * table + 3, 5 * table + 50)]),
                size=min(c, len(live) + 40),
                replace=False,
            ).astype(np.int64)
            old = np.sort(old)[: c if variant == 0 else c // 2]
            old_ids = np.concatenate([old, np.full(c - len(old), EMPTY, np.int64)])
            out = cache_populate(
                torch.from_numpy(keys).cuda(),
                torch.from_numpy(counts).cuda(),
                torch.from_numpy(old_ids).cuda(),
                pad=0,
            )
            ref = populate_ref(keys, counts, old_ids, 0)
            row = dict(name="populate", table=table, cache=c, variant=variant)
            row.update(_compared(out, ref))
            row.update(fresh=int(ref["num_fresh"][0]), stay=int((ref["src"] >= 0).sum()))
            res.append(row)
    return res


def check_chain(small, gen, rng):
    """A layer-like sequence with Adagrad on cache rows; stand-in 'TT rows' = a dense table."""
    res = []
    for dtype in DTYPES:
        num_ids, dim, cache, table = (5000, 33, 200, 1024) if not small else (800, 9, 40, 128)
        dense = make_var(gen, num_ids, dim, dtype)  # the rows the cores would give
        keys = torch.full((table,), -1, dtype=torch.int64, device="cuda")
        counts = torch.zeros(table, dtype=torch.int64, device="cuda")
        cache_ids = torch.full((cache,), EMPTY, dtype=torch.int64, device="cuda")
        cache_rows = torch.zeros(cache, dim, dtype=dtype, device="cuda")
        cache_acc = torch.zeros(cache, dim, dtype=dtype, device="cuda")
        # Reference state.
        r_keys, r_counts = np.full(table, -1, np.int64), np.zeros(table, np.int64)
        r_ids = np.full(cache, EMPTY, np.int64)
        r_rows, r_acc = torch.zeros(cache, dim, dtype=dtype), torch.zeros(cache, dim, dtype=dtype)
        ok, notes = True, []
        for step in range(6):
            raw = zipf_ids(rng, 3000, num_ids, pad_frac=0.05)
            raw_d = torch.from_numpy(raw).cuda()
            cache_count(raw_d, keys, counts, num_ids)
            count_ref(r_keys, r_counts, raw)
            if step in (2, 4):
                pop = cache_populate(keys, counts, cache_ids, pad=0)
                fresh_rows = dense[pop["fresh_ids"]]  # fixed size: no read-back of num_fresh
                new_rows = select_rows(cache_rows, pop["src"], fresh_rows, pop["fresh_rank"])
                new_acc = select_rows(cache_acc, pop["src"])
                cache_ids.copy_(pop["new_ids"])
                cache_rows.copy_(new_rows)
                cache_acc.copy_(new_acc)
                pr = populate_ref(r_keys, r_counts, r_ids, 0)
                stays = torch.from_numpy(pr["src"] >= 0)
                fresh = torch.from_numpy(pr["fresh_rank"] >= 0)
                nr = torch.zeros(cache, dim, dtype=dtype)
                na = torch.zeros(cache, dim, dtype=dtype)
                src = torch.from_numpy(np.maximum(pr["src"], 0))
                nr[stays] = r_rows[src][stays]
                na[stays] = r_acc[src][stays]
                nr[fresh] = dense.cpu()[torch.from_numpy(pr["new_ids"][fresh.numpy()])]
                r_ids, r_rows, r_acc = pr["new_ids"], nr, na
            uniq = np.unique(raw[raw >= 0])
            uniq_d = torch.from_numpy(uniq).cuda()
            lk = cache_lookup(uniq_d, cache_ids, pad=0)
            miss_rows = dense[lk["miss_ids"]]
            rows = select_rows(cache_rows, lk["position"], miss_rows, lk["miss_rank"])
            grad = make_var(gen, len(uniq), dim, dtype)
            sparse_update(
                ADAGRAD,
                [dict(var=cache_rows, accum=cache_acc, rows=lk["position"], grad=grad)],
                LR,
                EPS,
            )
            miss_grad = select_rows(grad, lk["miss_at"])
            torch.cuda.synchronize()
            # Reference forward, update and split.
            lr_ = lookup_ref(uniq, r_ids, 0)
            hit = lr_["position"] >= 0
            ref_rows = dense.cpu()[torch.from_numpy(uniq)].clone()
            ref_rows[torch.from_numpy(hit)] = r_rows[torch.from_numpy(lr_["position"][hit])]
            r_rows, r_acc = update_ref_exact(
                r_rows, r_acc, torch.from_numpy(lr_["position"]), grad.cpu(), ADAGRAD, LR, EPS
            )
            nm = int(lr_["counts"][1])
            ref_mg = torch.zeros(len(uniq), dim, dtype=dtype)
            ref_mg[:nm] = grad.cpu()[torch.from_numpy(lr_["miss_at"][:nm])]
            checks = {
                "keys": np.array_equal(keys.cpu().numpy(), r_keys),
                "counts": np.array_equal(counts.cpu().numpy(), r_counts),
                "cache_ids": np.array_equal(cache_ids.cpu().numpy(), r_ids),
                "rows": bits_equal(rows.cpu(), ref_rows),
                "cache_rows": bits_equal(cache_rows.cpu(), r_rows),
                "cache_acc": bits_equal(cache_acc.cpu(), r_acc),
                "miss_grad": bits_equal(miss_grad.cpu(), ref_mg),
            }
            bad = [k for k, v in checks.items() if not v]
            ok &= not bad
            notes.append({"step": step, "hits": int(lr_["counts"][0]), "misses": nm, "bad": bad})
        res.append({"name": "chain", "dtype": SHORT[dtype], "ok": ok, "steps": notes})
    return res


def check_determinism(gen, rng):
    res = []
    # Update: twice from the same state.
    for dtype in DTYPES:
        p, w = 1000, 4096 if dtype == torch.float32 else 33
        rows = rand_rows(gen, p, 777).cuda()
        var, acc = make_var(gen, p, w, dtype), make_var(gen, p, w, dtype, positive=True)
        grad = make_var(gen, 777, w, dtype)
        outs = []
        for _ in range(2):
            v, a = var.clone(), acc.clone()
            sparse_update(ADAGRAD, [dict(var=v, accum=a, rows=rows, grad=grad)], LR, EPS)
            outs.append((v, a))
        same = bits_equal(outs[0][0].cpu(), outs[1][0].cpu()) and bits_equal(
            outs[0][1].cpu(), outs[1][1].cpu()
        )
        res.append({"name": "update", "dtype": SHORT[dtype], "ok": bool(same)})
    ids = torch.from_numpy(zipf_ids(rng, 200_000, 1_000_000, pad_frac=0.05)).cuda()
    outs = []
    for _ in range(2):
        k = torch.full((65536,), -1, dtype=torch.int64, device="cuda")
        c = torch.zeros(65536, dtype=torch.int64, device="cuda")
        cache_count(ids, k, c, 1_000_000)
        cache_count(ids[:50_000], k, c, 1_000_000)
        outs.append((k, c))
    res.append(
        {
            "name": "count",
            "ok": bool(torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])),
        }
    )
    pops = [
        cache_populate(
            outs[0][0], outs[0][1], torch.full((3000,), EMPTY, dtype=torch.int64, device="cuda")
        )
        for _ in range(2)
    ]
    res.append(
        {"name": "populate", "ok": all(torch.equal(pops[0][k], pops[1][k]) for k in pops[0])}
    )
    return res


# ---------------------------------------------------------------------------
# Benchmarks.


def time_ms(fn, reps=50, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def time_graph_ms(fn, reps=50, per=1):
    """Median of CUDA-graph replays of fn divided by `per` (fn runs `per` problems);
    eager events if the capture fails."""
    try:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            with torch.cuda.graph(g, stream=st):
                fn()
        torch.cuda.synchronize()
        return time_ms(g.replay, reps) / per, "graph"
    except Exception as e:  # noqa: BLE001
        log(f"   (graph capture failed: {type(e).__name__}: {e}; timing eagerly)")
        torch.cuda.synchronize()
        return time_ms(fn, reps) / per, "eager"


def copy_bandwidth():
    x = torch.empty(2 * 2**30 // 4, dtype=torch.float32, device="cuda").uniform_()
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e12


def bench_update(gen):
    """Update time per problem: a graph replays every input set once (rotation defeats L2)."""
    out = []
    # name, [(p, width, n)], input sets
    shapes = [
        ("fbtt-cores", [(200, 128, 200), (220, 4096, 220), (250, 128, 250)], 16),
        ("rows1M-w128", [(2_000_000, 128, 1_000_000)], 2),
        ("rows65k-w4096", [(131072, 4096, 65536)], 1),
        ("rows4M-w16", [(8_000_000, 16, 4_000_000)], 2),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for opt in (SGD, ADAGRAD):
            for name, cores, sets in shapes:
                if dtype != torch.float32 and name == "rows65k-w4096":
                    continue
                es = torch.tensor([], dtype=dtype).element_size()
                all_sets = []
                for _ in range(sets):
                    slices = []
                    for p, w, n in cores:
                        rows = rand_rows(gen, p, n).cuda()
                        var = torch.randn(p, w, dtype=dtype, device="cuda")
                        acc = (
                            torch.rand(p, w, dtype=dtype, device="cuda") + 0.1
                            if opt == ADAGRAD
                            else None
                        )
                        grad = torch.randn(n, w, dtype=dtype, device="cuda")
                        slices.append(dict(var=var, accum=acc, rows=rows, grad=grad))
                    all_sets.append(slices)
                bytes_moved = sum(
                    n * w * es * (3 if opt == SGD else 5) + n * 8 for p, w, n in cores
                )

                def one_launch():
                    for slices in all_sets:
                        sparse_update(opt, slices, LR, EPS)

                def per_core():
                    for slices in all_sets:
                        for s in slices:
                            sparse_update(opt, [s], LR, EPS)

                ms, mode = time_graph_ms(one_launch, per=sets)
                r = {
                    "shape": name,
                    "dtype": SHORT[dtype],
                    "opt": OPT_NAMES[opt],
                    "ms": ms,
                    "GBps": bytes_moved / (ms * 1e-3) / 1e9,
                    "bytes": bytes_moved,
                    "timing": mode,
                }
                if len(cores) > 1:
                    r["ms_one_launch_per_core"] = time_graph_ms(per_core, per=sets)[0]
                    r["ms_eager_one_launch"] = time_ms(
                        lambda: sparse_update(opt, all_sets[0], LR, EPS)
                    )
                out.append(r)
                all_sets = None
                torch.cuda.empty_cache()
    return out


def bench_cache(rng):
    """Counting, populate, lookup and stitch at FBTT's table (11M rows), cache = 1% of rows."""
    out = []
    rows_total = 200 * 220 * 250
    cache = rows_total // 100
    table = 2 * cache
    dim = 64
    for label, nnz, dist in [
        ("B512xL20-uniform", 10240, "uniform"),
        ("B512xL20-zipf", 10240, "zipf"),
        ("B65536xL20-zipf", 1_310_720, "zipf"),
        ("B65536xL20-uniform", 1_310_720, "uniform"),
    ]:
        # One fixed Zipf popularity order (as a real workload has), fresh draws per batch.
        perm = rng.permutation(rows_total)
        probs = np.arange(1, rows_total + 1, dtype=np.float64) ** -1.1
        probs /= probs.sum()

        def batch():
            if dist == "uniform":
                return torch.from_numpy(rng.integers(0, rows_total, nnz).astype(np.int64)).cuda()
            return torch.from_numpy(
                perm[rng.choice(rows_total, nnz, p=probs)].astype(np.int64)
            ).cuda()

        keys = torch.full((table,), -1, dtype=torch.int64, device="cuda")
        counts = torch.zeros(table, dtype=torch.int64, device="cuda")
        for _ in range(4):  # earlier batches fill the table; the timed batch is a new one
            cache_count(batch(), keys, counts, rows_total)
        raw_d = batch()
        scratch(
            max(
                LIB.ttupd_cache_count_scratch_bytes(nnz, table, 0),
                LIB.ttupd_cache_populate_scratch_bytes(table, cache),
                LIB.ttupd_cache_lookup_scratch_bytes(nnz),
            )
        )
        k2, c2 = keys.clone(), counts.clone()
        t_count, _ = time_graph_ms(lambda: cache_count(raw_d, k2, c2, rows_total), 20)
        t_count64, _ = time_graph_ms(lambda: cache_count(raw_d, k2, c2, 0), 20)
        old = torch.full((cache,), EMPTY, dtype=torch.int64, device="cuda")
        pop = cache_populate(keys, counts, old)
        t_pop, _ = time_graph_ms(lambda: cache_populate(keys, counts, old, out=pop), 10)
        cache_ids = pop["new_ids"].clone()
        uniq = torch.unique(raw_d)
        lk = cache_lookup(uniq, cache_ids)
        hits = int(lk["counts"][0])
        t_lookup, mode = time_graph_ms(lambda: cache_lookup(uniq, cache_ids, out=lk), 30)
        cache_rows = torch.randn(cache, dim, device="cuda")
        miss_rows = torch.randn(uniq.numel(), dim, device="cuda")
        out_rows = torch.empty(uniq.numel(), dim, device="cuda")
        t_stitch, _ = time_graph_ms(
            lambda: select_rows(
                cache_rows, lk["position"], miss_rows, lk["miss_rank"], out=out_rows
            ),
            30,
        )
        t_torch, _ = time_graph_ms(lambda: torch.searchsorted(cache_ids, uniq), 30)
        out.append(
            {
                "case": label,
                "nnz": nnz,
                "unique": uniq.numel(),
                "cache": cache,
                "table": table,
                "hits": hits,
                "count_ms": t_count,
                "count_64bit_sort_ms": t_count64,
                "populate_ms": t_pop,
                "lookup_ms": t_lookup,
                "stitch_ms": t_stitch,
                "dim": dim,
                "torch_searchsorted_ms": t_torch,
                "timing": mode,
            }
        )
    return out


# ---------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", help="libtf_ttemb_gpu_harness.so")
    ap.add_argument("--small", action="store_true", help="small sweep, no benchmarks")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true", help="benchmarks, no checks")
    ap.add_argument(
        "--crosscheck-cpu-op",
        action="store_true",
        help="compare the Python TTCacheCount model with the TF CPU op (no GPU)",
    )
    args = ap.parse_args(argv)
    if args.crosscheck_cpu_op:
        return crosscheck_cpu_op()

    global torch, DTYPES, SHORT, TOL
    import torch as _torch

    torch = _torch
    DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    SHORT = {
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.float32: "f32",
        torch.float64: "f64",
    }
    TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-13}
    lib = args.lib or os.environ.get(
        "TF_TTEMB_GPU_HARNESS", REPO / "build" / "gpu_harness" / "libtf_ttemb_gpu_harness.so"
    )
    load(lib)
    gen = torch.Generator().manual_seed(1234)
    rng = np.random.default_rng(4321)
    props = torch.cuda.get_device_properties(0)
    report = {
        "argv": sys.argv,
        "host": platform.node(),
        "gpu": props.name,
        "torch": torch.__version__,
    }
    log(f"GPU {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")

    groups = [
        ("update", lambda: check_updates(args.small, gen)),
        ("select", lambda: check_select(args.small, gen)),
        ("count", lambda: check_count(args.small, gen, rng)),
        ("lookup", lambda: check_lookup(args.small, gen, rng)),
        ("populate", lambda: check_populate(args.small, gen, rng)),
        ("chain", lambda: check_chain(args.small, gen, rng)),
        ("determinism", lambda: check_determinism(gen, rng)),
    ]
    passed = True
    for name, fn in [] if args.bench_only else groups:
        t0 = time.time()
        try:
            res = fn()
        except Exception:  # noqa: BLE001
            res = [{"name": name, "ok": False, "error": traceback.format_exc()}]
        torch.cuda.synchronize()
        n_ok = sum(r["ok"] for r in res)
        passed &= n_ok == len(res)
        report[name] = res
        extra = ""
        if name == "update":
            worst = {}
            for r in res:
                k = r["dtype"]
                worst[k] = max(worst.get(k, 0.0), r["rel_err_f64"])
            extra = "; worst rel err vs f64: " + ", ".join(
                f"{k} {v:.2g}" for k, v in sorted(worst.items())
            )
            rows = [r for r in res if r["name"] == "all-rows" and r["dtype"] in ("f32", "f64")]
            extra += (
                f"; f32/f64 all-rows cases with every row changed: "
                f"{sum(r['rows_changed'] == r['p'] for r in rows)}/{len(rows)}"
            )
        log(f"{name:12s} {n_ok}/{len(res)} passed ({time.time() - t0:.1f} s){extra}")
        for r in res:
            if not r["ok"]:
                log("   FAIL", json.dumps(r, default=str)[:2000])

    if not args.small and not args.no_bench:
        report["copy_TBps"] = copy_bandwidth()
        log(f"device-to-device copy: {report['copy_TBps']:.2f} TB/s (read + write)")
        report["bench_update"] = bench_update(gen)
        log(f"{'shape':14s} {'dtype':5s} {'opt':8s} {'ms':>9s} {'GB/s':>7s}  per-core launches")
        for r in report["bench_update"]:
            pc = r.get("ms_one_launch_per_core")
            log(
                f"{r['shape']:14s} {r['dtype']:5s} {r['opt']:8s} {r['ms']:9.4f} "
                f"{r['GBps']:7.0f}  {'' if pc is None else f'{pc:.4f} ms'} ({r['timing']})"
                + (
                    f"; eager one launch {r['ms_eager_one_launch']:.4f} ms"
                    if "ms_eager_one_launch" in r
                    else ""
                )
            )
        report["bench_cache"] = bench_cache(rng)
        log(
            f"{'case':20s} {'unique':>8s} {'hits':>8s} {'count':>8s} {'count64':>8s} "
            f"{'populate':>8s} {'lookup':>8s} {'stitch':>8s} {'torch ss':>8s}  (ms)"
        )
        for r in report["bench_cache"]:
            log(
                f"{r['case']:20s} {r['unique']:8d} {r['hits']:8d} {r['count_ms']:8.4f} "
                f"{r['count_64bit_sort_ms']:8.4f} "
                f"{r['populate_ms']:8.4f} {r['lookup_ms']:8.4f} {r['stitch_ms']:8.4f} "
                f"{r['torch_searchsorted_ms']:8.4f}"
            )
    report["passed"] = passed
    out_dir = os.environ.get("OUT")
    if out_dir:
        name = (
            "tt_update_small.json"
            if args.small
            else "tt_update_bench.json"
            if args.bench_only
            else "tt_update.json"
        )
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(report, f, indent=1, default=str)
    log("PASSED" if passed else "FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
