"""gpu_check.py section "tt": TT embedding bags (cuda/tt_embedding_{forward,backward}.cu)
against float64 references, error messages, determinism and benchmarks at FBTT's shape."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_common as common  # noqa: E402
import harness as gh  # noqa: E402
from check_gather_reduce_sum import reference  # noqa: E402

# ---------------------------------------------------------------------------
# TT embedding bags (cuda/tt_embedding_{forward,backward}.cu), section "tt".

# name, p, q, ranks, num_tables, num_embeddings (None: prod p), bags, (min, max len),
# distribution, padding id
TT_CONFIGS = [
    ("2core", [7, 9], [2, 3], [4], 1, None, 40, (0, 10), "uniform", None),
    ("3core-zipf", [5, 6, 7], [4, 4, 4], [8, 8], 1, None, 64, (0, 24), "zipf", None),
    ("4core-odd-pad", [3, 4, 2, 5], [2, 1, 3, 2], [3, 5, 2], 1, None, 50, (0, 12), "uniform", -1),
    ("d1", [4, 5], [1, 1], [3], 1, None, 30, (0, 6), "uniform", None),
    ("q-ones-odd-ranks", [6, 7, 3], [1, 4, 1], [3, 5], 1, None, 40, (1, 9), "zipf", 11),
    ("N<prodp-pad", [10, 10], [2, 2], [5], 1, 73, 40, (0, 8), "uniform", 72),
    ("tables-pad", [4, 5, 6], [2, 2, 2], [3, 3], 3, 97, 60, (0, 10), "zipf", -1),
    ("5core", [2, 3, 2, 3, 2], [2, 1, 2, 1, 2], [3, 2, 3, 2], 1, None, 30, (0, 8), "uniform", None),
    ("empty-bags", [4, 5], [2, 2], [3], 1, None, 6, (0, 0), "uniform", None),
    ("hot-zipf-long", [20, 30], [4, 8], [16], 1, None, 48, (100, 300), "zipf", None),
    # FBTT's q and ranks on small p: full 4 x 4 tiles in the tiled core/parent gradient kernels.
    ("fbtt-r32", [20, 22, 25], [4, 4, 4], [32, 32], 1, None, 64, (0, 40), "zipf", None),
    # Wide B (Nc >= 32) with M % 4 == 0: the parent gradient by core row, at the last level
    # (rows' gradient in the table's dtype, tables, padding) and at a middle level.
    ("wide-last-tables-pad", [6, 5], [4, 32], [8], 2, 29, 40, (0, 12), "zipf", 3),
    (
        "4core-wide-mid",
        [3, 4, 5, 6],
        [4, 1, 8, 2],
        [4, 8, 4],
        1,
        None,
        40,
        (0, 10),
        "uniform",
        None,
    ),
    # ~88K distinct ids: the last core's gradient has > 4,096 pieces, which run in the order
    # of their parents (PieceOrderKeysKernel).
    ("ordered-pieces", [40, 50, 60], [2, 2, 2], [4, 4], 1, None, 8000, (10, 30), "uniform", None),
]
TT_SMALL = [
    "2core",
    "3core-zipf",
    "4core-odd-pad",
    "tables-pad",
    "empty-bags",
    "q-ones-odd-ranks",
    "fbtt-r32",
    "wide-last-tables-pad",
    "4core-wide-mid",
]


def tt_rows_torch(cores, p, q, r, num_tables, gids):
    """Rows of global ids by gathering core slices and batched matmuls (torch, any dtype,
    differentiable): the plain reimplementation used as reference and as a baseline."""
    T = len(p)
    P = math.prod(p)
    strides = [math.prod(p[k + 1 :]) for k in range(T)]
    n = gids.numel()
    tab = gids // P
    loc = gids % P
    acc = None
    for k in range(T):
        rows_k = tab * p[k] + (loc // strides[k]) % p[k]
        g = cores[k][rows_k].view(n, r[k], q[k] * r[k + 1])
        acc = g if acc is None else torch.bmm(acc.reshape(n, -1, r[k]), g)
    return acc.reshape(n, math.prod(q))


def tt_make_case(config, dtype, itype, combiner, weighted, seed):
    name, p, q, ranks, tables, n_emb, bags, (lo, hi), dist, pad = config
    gen = torch.Generator().manual_seed(seed)
    r = [1] + ranks + [1]
    P = math.prod(p)
    n_emb = P if n_emb is None else n_emb
    # Cores scaled so rows are O(1).
    cores64 = []
    for k in range(len(p)):
        scale = (1.0 / r[k]) ** 0.5
        cores64.append(
            torch.randn(tables * p[k], r[k] * q[k] * r[k + 1], generator=gen, dtype=torch.float64)
            * scale
        )
    lengths = torch.randint(lo, hi + 1, (bags,), generator=gen)
    offsets = torch.zeros(bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    nnz = int(offsets[-1])
    ids = common.make_ids(nnz, n_emb, dist, torch.int64, gen, "cpu")
    # Entries split into tables by position (uneven, some tables may be empty).
    cuts = sorted(torch.randint(0, nnz + 1, (tables - 1,), generator=gen).tolist())
    splits = torch.tensor([0] + cuts + [nnz], dtype=torch.int64)
    table_of = torch.repeat_interleave(torch.arange(tables), splits.diff())
    if pad is not None and nnz:
        mask = torch.rand(nnz, generator=gen) < 0.15
        ids[mask] = pad
    is_pad = ids == pad if pad is not None else torch.zeros(nnz, dtype=torch.bool)
    gids = torch.where(is_pad, torch.full_like(ids, -1), table_of * P + ids)
    weights = common.random_weights(nnz, combiner, gen) if weighted else None
    dy = torch.randn(bags, math.prod(q), generator=gen, dtype=torch.float64)
    cores = [c.to(dtype).to(common.DEVICE) for c in cores64]
    return dict(
        p=p,
        q=q,
        ranks=ranks,
        r=r,
        tables=tables,
        n_emb=n_emb,
        pad=pad,
        cores=cores,
        ids=ids.to(itype).to(common.DEVICE),
        gids=gids,
        offsets=offsets.to(common.DEVICE),
        splits=splits.to(common.DEVICE),
        weights=None if weights is None else weights.to(dtype).to(common.DEVICE),
        grad=dy.to(dtype).to(common.DEVICE),
        combiner=combiner,
    )


def tt_reference(c, out_kernel=None):
    """float64 reference: the full table from the (upcast) cores, the bag reference of
    gather_reduce_sum on it, core gradients by autograd; and the same with |.| for bounds."""
    p, q, r, tables = c["p"], c["q"], c["r"], c["tables"]
    P = math.prod(p)
    all_ids = torch.arange(tables * P)
    cores = [x.detach().cpu().double().requires_grad_(True) for x in c["cores"]]
    cores_abs = [x.detach().abs().requires_grad_(True) for x in cores]
    table = tt_rows_torch(cores, p, q, r, tables, all_ids)
    table_abs = tt_rows_torch(cores_abs, p, q, r, tables, all_ids)
    case = dict(
        params=table.detach(),
        ids=c["gids"],
        offsets=c["offsets"].cpu(),
        weights=c["weights"],
        grad=c["grad"],
        padding_id=-1,
        combiner=c["combiner"],
    )
    ref = reference(case, out_kernel=out_kernel)
    case_abs = dict(case, params=table_abs.detach())
    ref_abs = reference(case_abs)
    ref["out_abs"] = ref_abs["out_abs"]
    ref["core_grads"] = torch.autograd.grad(table, cores, ref["dense"])
    ref["core_grads_abs"] = torch.autograd.grad(table_abs, cores_abs, ref["dense_abs"])
    if "dw" in ref:
        ref["dw_abs"] = ref_abs["dw_abs"]
    # Core rows any valid entry touches.
    vg = ref["unique"]
    strides = [math.prod(p[k + 1 :]) for k in range(len(p))]
    ref["touched"] = [
        torch.unique((vg // P) * p[k] + (vg % P // strides[k]) % p[k]) for k in range(len(p))
    ]
    return ref


def tt_call_kwargs(c):
    return dict(
        weights=c["weights"],
        combiner=c["combiner"],
        num_tables=c["tables"],
        table_splits=c["splits"],
        padding_id=c["pad"],
        num_embeddings=c["n_emb"],
    )


def tt_check_case(config, dtype, itype, combiner, weighted, seed):
    c = tt_make_case(config, dtype, itype, combiner, weighted, seed)
    res = dict(
        common.case_fields(config, dtype, itype, combiner, weighted, "tt"), failures=[], worst={}
    )
    fail = res["failures"]
    args = (c["cores"], c["p"], c["q"], c["ranks"], c["ids"], c["offsets"])
    out, state = gh.tt_embedding_bag_forward(*args, **tt_call_kwargs(c))
    ref = tt_reference(c, out_kernel=out)
    common.check_close(res, "forward", "forward", out, ref["out"], ref["out_abs"], dtype)
    # Unique ids and slots.
    u = int(state.num_unique.item())
    uniq = state.unique[:u].cpu()
    if not torch.equal(uniq, ref["unique"]):
        fail.append("unique ids")
    slots = state.slots.cpu().long()
    g = c["gids"]
    want_slots = torch.full_like(g, -1)
    if g.numel():
        valid = g >= 0
        want_slots[valid] = torch.searchsorted(ref["unique"], g[valid])
    if not torch.equal(slots, want_slots) or state.slots.dtype != itype:
        fail.append("slots")
    dense_grads = None
    for dense in (True, False):
        grads, dw = gh.tt_embedding_bag_backward_from(state, c["grad"], dense=dense)
        tag = "dense" if dense else "compact"
        if dense:
            dense_grads = grads
        else:
            # The compact path's work buffer is sized by Prepare's report, the dense path's
            # is the upper bound: same arithmetic, so the same bits.
            for k, (idx, vals) in enumerate(grads):
                if not torch.equal(common.bits(vals), common.bits(dense_grads[k][idx])):
                    fail.append(f"core {k} grad compact != dense bitwise")
        worst = 0.0
        for k in range(len(c["p"])):
            want, want_abs = ref["core_grads"][k], ref["core_grads_abs"][k]
            if dense:
                ok, ratio = common.close(grads[k], want, want_abs, dtype)
            else:
                idx, vals = grads[k]
                if not torch.equal(idx.cpu(), ref["touched"][k]):
                    fail.append(f"core {k} compact indices")
                    ok, ratio = False, float("inf")
                else:
                    t = ref["touched"][k]
                    ok, ratio = common.close(vals, want[t], want_abs[t], dtype)
            worst = max(worst, ratio)
            if not ok:
                fail.append(f"core {k} grad {tag} ({ratio:.3g})")
        res["worst"][f"core_grad_{tag}"] = worst
        if c["weights"] is not None and combiner != "max":
            common.check_close(
                res,
                f"weights_grad_{tag}",
                f"weights grad {tag}",
                dw,
                ref["dw"],
                ref["dw_abs"],
                dtype,
            )
    return res


def tt_sweep_cases(small):
    configs = [x for x in TT_CONFIGS if not small or x[0] in TT_SMALL]
    dtypes = [torch.bfloat16, torch.float32, torch.float64] if small else common.DTYPES
    cases = []
    i = 0
    for config in configs:
        for dtype in dtypes:
            combos = [("sum", False), ("sum", True), ("mean", True), ("sqrtn", False)]
            if dtype in (torch.float32, torch.float64):
                combos.append(("max", False))
            if small:
                combos = combos[:2]
            for combiner, weighted in combos:
                cases.append((config, dtype, common.INDEX_DTYPES[i % 2], combiner, weighted))
                i += 1
    return cases


def tt_run_sweep(small, max_cases=None):
    return common.run_cases(
        tt_sweep_cases(small),
        tt_check_case,
        1000,
        lambda c: common.case_fields(*c, "tt"),
        "FAIL tt",
        max_cases,
    )


def tt_check_determinism(small):
    results = []
    p, q, ranks = (
        ([50, 60, 70], [4, 4, 4], [16, 16]) if not small else ([9, 8, 7], [2, 4, 2], [5, 3])
    )
    bags, length = (2048, 20) if not small else (32, 10)
    for dtype in (torch.float32, torch.bfloat16):
        config = ("det", p, q, ranks, 1, None, bags, (length, length), "zipf", None)
        c = tt_make_case(config, dtype, torch.int64, "sum", True, 4321)
        args = (c["cores"], c["p"], c["q"], c["ranks"], c["ids"], c["offsets"])
        runs = []
        for _ in range(3):
            out, state = gh.tt_embedding_bag_forward(*args, **tt_call_kwargs(c))
            dense, dw = gh.tt_embedding_bag_backward_from(state, c["grad"], dense=True)
            compact, _ = gh.tt_embedding_bag_backward_from(state, c["grad"], dense=False)
            runs.append(
                [common.bits(out), common.bits(dw)]
                + [common.bits(x) for x in dense]
                + [x for pair in compact for x in (pair[0], common.bits(pair[1]))]
            )
        same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
        hot = int(torch.bincount(c["ids"].long()).max())
        results.append(
            {
                "section": "tt",
                "dtype": common.SHORT[dtype],
                "shape": [p, q, ranks, bags, length],
                "hottest_row_entries": hot,
                "bitwise_identical": same,
            }
        )
        common.log(
            f"tt determinism {common.SHORT[dtype]} p={p} B={bags}x{length} hottest id {hot} "
            f"entries: {'identical' if same else 'DIFFERENT'}"
        )
    return results


def tt_check_errors():
    results = []
    dev = "cuda"
    p, q, ranks = [4, 5], [2, 2], [3]
    gen = torch.Generator(device=dev).manual_seed(5)
    cores = [
        torch.randn(4, 6, device=dev, generator=gen),
        torch.randn(5, 6, device=dev, generator=gen),
    ]
    off = torch.tensor([0, 4, 10], device=dev)
    shape = gh.TTShape(p, q, ranks)
    for itype in common.INDEX_DTYPES:
        ids = torch.tensor([1, 2, 3, 4, 5, 20, 6, -3, 7, 19], dtype=itype, device=dev)
        ids_pad = torch.tensor([1, -1, 3, -3, 5, 9, 6, 10, 7, 1], dtype=itype, device=dev)
        cases = [
            (
                "bag forward",
                lambda: gh.tt_embedding_bag(cores, p, q, ranks, ids, off),
                "indices[5] = 20 is not in [0, 20)",
            ),
            (
                "bag forward num_embeddings",
                lambda: gh.tt_embedding_bag(cores, p, q, ranks, ids, off, num_embeddings=6),
                "indices[5] = 20 is not in [0, 6)",
            ),
            (
                "bag forward padding",
                lambda: gh.tt_embedding_bag(cores, p, q, ranks, ids_pad, off, padding_id=-1),
                "indices[3] = -3 is not in [0, 20) and is not padding_id (-1)",
            ),
            (
                "bag backward",
                lambda: gh.tt_embedding_bag_backward(
                    cores, p, q, ranks, ids, off, torch.randn(2, 4, device=dev)
                ),
                "indices[5] = 20 is not in [0, 20)",
            ),
        ]
        for name, fn, msg in cases:
            ok, got = common.expect_error(fn, msg)
            results.append(
                {
                    "section": "tt",
                    "itype": common.SHORT[itype],
                    "case": name,
                    "ok": ok,
                    "got": got,
                    "want": msg,
                }
            )
            if not ok:
                common.log(
                    f"FAIL tt error check {name} {common.SHORT[itype]}: got {got!r}, want {msg!r}"
                )

    def rows_bad():
        gids = torch.tensor([0, 3, 19, 20, 7, -1], device=dev)
        _, rep = gh.tt_rows_async(shape, cores, gids)
        gh.tt_raise_global(rep, 20)

    def rows_grad_bad():
        gids = torch.tensor([0, 3, 25, 7], device=dev)
        _, rep = gh.tt_rows_grad(shape, cores, gids, torch.randn(4, 4, device=dev))
        gh.tt_raise_global(rep, 20)

    for name, fn, msg in [
        ("rows", rows_bad, "ids[3] = 20 is not in [0, 20)"),
        ("rows grad", rows_grad_bad, "ids[2] = 25 is not in [0, 20)"),
    ]:
        ok, got = common.expect_error(fn, msg)
        results.append(
            {"section": "tt", "itype": "i64", "case": name, "ok": ok, "got": got, "want": msg}
        )
        if not ok:
            common.log(f"FAIL tt error check {name}: got {got!r}, want {msg!r}")
    torch.cuda.synchronize()
    return results


def fp32_peak_tflops():
    """SMs x 128 FP32 lanes x 2 FLOP per FMA x max SM clock (nvidia-smi)."""
    props = torch.cuda.get_device_properties(0)
    try:
        mhz = float(
            subprocess.run(
                ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()[0]
        )
    except Exception:  # noqa: BLE001
        mhz = 1980.0
    return props.multi_processor_count * 128 * 2 * mhz * 1e6 / 1e12, mhz


def tt_flops_per_lookup(p, q, r):
    """The TT math of one row, left to right: sum_t 2 (q_0..q_t) r_{t+1} q_{t+1} r_{t+2}."""
    total, m = 0, q[0]
    for t in range(len(p) - 1):
        total += 2 * m * r[t + 1] * q[t + 1] * r[t + 2]
        m *= q[t + 1]
    return total


def tt_executed_flops(state):
    """FLOPs the kernels execute for the forward rows: per level t >= 1, the number of
    distinct prefixes (runs of sorted unique ids) times 2 M K Nc."""
    s = state.shape
    u = int(state.num_unique.item())
    g = state.unique[:u]
    strides = [math.prod(s.p[k + 1 :]) for k in range(s.num_cores)]
    total = 0
    m = s.q[0]
    for t in range(1, s.num_cores):
        items = (
            u if t == s.num_cores - 1 else int(torch.unique_consecutive(g // strides[t]).numel())
        )
        total += items * 2 * m * s.r[t] * s.q[t] * s.r[t + 1]
        m *= s.q[t]
    return total, u


def tt_bench_inputs(bags, length, dist, p, q, ranks, num_sets=3):
    """The TT benchmarks' inputs, the same for every section that times FBTT's shape:
    f32 cores [p_k, r_k q_k r_{k+1}] scaled by 1/sqrt(r_k), and `num_sets` (ids [B L],
    dy [B, D]) sets drawn from fixed seeds in a fixed order; offsets of bags of `length`
    and table splits of one table. Returns (cores, sets, offsets, splits)."""
    dev = "cuda"
    r = [1] + list(ranks) + [1]
    gen = torch.Generator(device=dev).manual_seed(11)
    n_rows = math.prod(p)
    cores = [
        torch.randn(p[k], r[k] * q[k] * r[k + 1], device=dev, generator=gen) * (1 / r[k]) ** 0.5
        for k in range(len(p))
    ]
    nnz = bags * length
    sets = []
    cgen = torch.Generator().manual_seed(12)
    for _ in range(num_sets):
        ids = common.make_ids(nnz, n_rows, dist, torch.int64, cgen, dev)
        dy = torch.randn(bags, math.prod(q), device=dev, generator=gen)
        sets.append((ids, dy))
    off = torch.arange(0, nnz + 1, length, device=dev)
    splits = torch.tensor([0, nnz], dtype=torch.int64, device=dev)
    return cores, sets, off, splits


def tt_bench_fields(bags, length, dist, p, q, ranks):
    """What names a TT benchmark case (float32) in its JSON row, after its section."""
    return {
        "bags": bags,
        "bag_len": length,
        "lookups": bags * length,
        "dist": dist,
        "p": p,
        "q": q,
        "ranks": ranks,
        "dtype": "f32",
    }


def tt_bench_shape(
    name, bags, length, dist, iters, p=(200, 220, 250), q=(4, 4, 4), ranks=(32, 32), torch_ref=True
):
    dev = "cuda"
    p, q, ranks = list(p), list(q), list(ranks)
    r = [1] + ranks + [1]
    cores, sets, off, splits = tt_bench_inputs(bags, length, dist, p, q, ranks)
    nnz = bags * length
    D = math.prod(q)
    res = dict(section="tt", shape=name, **tt_bench_fields(bags, length, dist, p, q, ranks))
    states = {}

    def fwd(i):
        ids, _ = sets[i % 3]
        out, st = gh.tt_embedding_bag_forward(
            cores, p, q, ranks, ids, off, table_splits=splits, check=False
        )
        states[i % 3] = st

    def fwd_bwd(i):
        ids, dy = sets[i % 3]
        out, st = gh.tt_embedding_bag_forward(
            cores, p, q, ranks, ids, off, table_splits=splits, check=False
        )
        gh.tt_embedding_bag_backward_from(st, dy, dense=True, check=False)

    def fwd_bwd_checked(i):
        ids, dy = sets[i % 3]
        out, st = gh.tt_embedding_bag_forward(
            cores, p, q, ranks, ids, off, table_splits=splits, check=True
        )
        gh.tt_embedding_bag_backward_from(st, dy, dense=True, check=True)

    common.timed(res, "ours_fwd", fwd, iters)
    common.timed(res, "ours_fwd_bwd", fwd_bwd, iters)
    common.timed(res, "ours_fwd_bwd_checked", fwd_bwd_checked, iters, graph=False)
    fwd(0)
    torch.cuda.synchronize()
    executed, u = tt_executed_flops(states[0])
    per = tt_flops_per_lookup(p, q, r)
    res["unique_ids"] = u
    res["tt_flops_per_lookup"] = per
    res["tt_flops_total"] = per * nnz
    res["executed_flops"] = executed
    if res.get("ours_fwd_ms"):
        res["fwd_us_per_lookup"] = res["ours_fwd_ms"] * 1e3 / nnz
        res["fwd_TFLOPs_tt_math"] = per * nnz / res["ours_fwd_ms"] / 1e9
        res["fwd_TFLOPs_executed"] = executed / res["ours_fwd_ms"] / 1e9
    if res.get("ours_fwd_bwd_ms"):
        res["fwd_bwd_us_per_lookup"] = res["ours_fwd_bwd_ms"] * 1e3 / nnz
    if torch_ref:
        leaves = [c.detach().clone().requires_grad_(True) for c in cores]
        bag_of = torch.repeat_interleave(torch.arange(bags, device=dev), length)

        def torch_fwd(i):
            ids, _ = sets[i % 3]
            rows = tt_rows_torch(cores, p, q, r, 1, ids)
            return torch.zeros(bags, D, device=dev).index_add_(0, bag_of, rows)

        def torch_fwd_bwd(i):
            ids, dy = sets[i % 3]
            rows = tt_rows_torch(leaves, p, q, r, 1, ids)
            out = torch.zeros(bags, D, device=dev).index_add(0, bag_of, rows)
            torch.autograd.grad(out, leaves, dy)

        # Graphs of the plain torch TT hold their [nnz, width] gathers per captured input
        # set: eager only at the large batch.
        common.timed(res, "torch_fwd", torch_fwd, iters, graph=bags <= 4096)
        common.timed(res, "torch_fwd_bwd", torch_fwd_bwd, iters, graph=bags <= 4096)
        for k in ("fwd", "fwd_bwd"):
            t, o = res.get(f"torch_{k}_ms"), res.get(f"ours_{k}_ms")
            res[f"torch_{k}_us_per_lookup"] = t * 1e3 / nnz if t else None
            res[f"speedup_vs_torch_{k}"] = t / o if t and o else None
    states = None
    torch.cuda.empty_cache()
    return res


def tt_run_benchmarks():
    rows = []
    peak, mhz = fp32_peak_tflops()
    specs = [
        ("FBTT B=512", 512, 20, "uniform", 50),
        ("FBTT B=512 zipf", 512, 20, "zipf", 50),
        ("B=65536", 65536, 20, "uniform", 10),
        ("B=65536 zipf", 65536, 20, "zipf", 10),
    ]
    for spec in specs:
        try:
            r = tt_bench_shape(*spec)
        except Exception as exc:  # noqa: BLE001
            r = {
                "section": "tt",
                "shape": spec[0],
                "error": repr(exc)[:300],
                "trace": traceback.format_exc(),
            }
        r["fp32_peak_TFLOPs"] = peak
        r["max_sm_clock_MHz"] = mhz
        if r.get("fwd_TFLOPs_tt_math"):
            r["fwd_fraction_of_peak_tt_math"] = r["fwd_TFLOPs_tt_math"] / peak
            r["fwd_fraction_of_peak_executed"] = r["fwd_TFLOPs_executed"] / peak
        rows.append(r)
        common.log(json.dumps(r))
    by = {r["shape"]: r for r in rows}
    targets = {}
    a = by.get("FBTT B=512", {})
    if a.get("fwd_bwd_us_per_lookup"):
        targets["fbtt_fwd_bwd_us_per_lookup<=0.02"] = a["fwd_bwd_us_per_lookup"]
    b = by.get("B=65536", {})
    if b.get("fwd_fraction_of_peak_tt_math"):
        targets["B65536_fwd_fraction_of_fp32_peak>=0.40 (tt math)"] = b[
            "fwd_fraction_of_peak_tt_math"
        ]
        targets["B65536_fwd_fraction_of_fp32_peak (executed)"] = b["fwd_fraction_of_peak_executed"]
    for small in ("FBTT B=512", "B=65536"):
        u, z = by.get(small, {}), by.get(small + " zipf", {})
        for k in ("fwd", "fwd_bwd"):
            if u.get(f"ours_{k}_ms") and z.get(f"ours_{k}_ms"):
                targets[f"{small} zipf speedup {k} (>=2)"] = u[f"ours_{k}_ms"] / z[f"ours_{k}_ms"]
    rows.append({"section": "tt", "targets": targets})
    common.log(json.dumps({"tt_targets": targets}))
    return rows


def tt_profile_run():
    tt_bench_shape("profile", 65536, 20, "uniform", 1, torch_ref=False)


TT_ROWS_GRAD_SHAPES = [
    # name, p, q, ranks, num_tables: the by-row kernels (fbtt-r32: middle level, wide-last:
    # last level), a 4-core wide middle level, and plain narrow cores.
    ("fbtt-r32", [20, 22, 25], [4, 4, 4], [32, 32], 1),
    ("wide-last-tables", [6, 5], [4, 32], [8], 2),
    ("4core-wide-mid", [3, 4, 5, 6], [4, 1, 8, 2], [4, 8, 4], 1),
    ("2core-odd", [7, 9], [2, 3], [4], 1),
]


def tt_check_rows_grad_work(small):
    """TTRowsGrad on ids of any order (unsorted, duplicated, prefixes alternating), where
    the prefix items are not bounded by the distinct prefixes: the two-buffer layout (work
    sized by Prepare's report, as the TF glue does) and the one-buffer layout (work at its
    upper bound) against float64 autograd, and bitwise against each other; the work bytes
    the report asks for, for these ids and for their sorted distinct ids."""
    results = []
    n_base = 120 if small else 1500
    for name, p, q, ranks, tables in TT_ROWS_GRAD_SHAPES:
        for dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(2024 + len(results))
            r = [1] + ranks + [1]
            P = math.prod(p)
            D = math.prod(q)
            base = torch.randint(0, tables * P, (n_base,), generator=gen)
            ids = torch.cat([base, base.flip(0), base[::3]])
            n = ids.numel()
            cores64 = [
                torch.randn(
                    tables * p[k], r[k] * q[k] * r[k + 1], generator=gen, dtype=torch.float64
                )
                * (1.0 / r[k]) ** 0.5
                for k in range(len(p))
            ]
            grad64 = torch.randn(n, D, generator=gen, dtype=torch.float64)
            leaves = [x.clone().requires_grad_(True) for x in cores64]
            leaves_abs = [x.abs().requires_grad_(True) for x in cores64]
            want = torch.autograd.grad(tt_rows_torch(leaves, p, q, r, tables, ids), leaves, grad64)
            want_abs = torch.autograd.grad(
                tt_rows_torch(leaves_abs, p, q, r, tables, ids), leaves_abs, grad64.abs()
            )
            shape = gh.TTShape(p, q, ranks, tables)
            cores = [x.to(dtype).to(common.DEVICE) for x in cores64]
            ids_d = ids.to(common.DEVICE)
            grad = grad64.to(dtype).to(common.DEVICE)
            dense, _ = gh.tt_rows_grad(shape, cores, ids_d, grad, dense=True)
            compact, rep = gh.tt_rows_grad(shape, cores, ids_d, grad, dense=False)
            fail = []
            worst = 0.0
            strides = [math.prod(p[k + 1 :]) for k in range(len(p))]
            for k in range(len(p)):
                ok, ratio = common.close(dense[k], want[k], want_abs[k], dtype)
                worst = max(worst, ratio)
                if not ok:
                    fail.append(f"core {k} grad ({ratio:.3g})")
                touched = torch.unique((ids // P) * p[k] + (ids % P // strides[k]) % p[k])
                idx, vals = compact[k]
                if not torch.equal(idx.cpu(), touched):
                    fail.append(f"core {k} compact indices")
                elif not torch.equal(common.bits(vals), common.bits(dense[k][idx])):
                    fail.append(f"core {k} compact != dense bitwise")
            sizes = gh.tt_rows_grad_bytes(shape, dtype, n, rep.cpu())
            uq = torch.unique(ids).to(common.DEVICE)
            _, rep_u = gh.tt_rows_grad(
                shape,
                cores,
                uq,
                torch.randn(uq.numel(), D, dtype=torch.float64, generator=gen)
                .to(dtype)
                .to(common.DEVICE),
                dense=False,
            )
            sizes_u = gh.tt_rows_grad_bytes(shape, dtype, uq.numel(), rep_u.cpu())
            upper = gh.tt_rows_grad_bytes(shape, dtype, n)
            res = {
                "section": "tt",
                "check": "rows_grad_work",
                "shape": name,
                "dtype": common.SHORT[dtype],
                "ids": n,
                "distinct": uq.numel(),
                "worst": worst,
                "failures": fail,
                "bytes_upper_bound": upper,
                "bytes_any_order": sizes,
                "bytes_sorted_distinct": sizes_u,
            }
            results.append(res)
            common.log(
                f"tt rows_grad work {name} {common.SHORT[dtype]}: {'ok' if not fail else fail} "
                f"worst {worst:.3g}; work bytes: upper bound {upper['work']}, these ids "
                f"{sizes['work']}, their {uq.numel()} sorted distinct ids {sizes_u['work']}"
            )
    return results


def tt_rows_grad_memory():
    """TTRowsGrad's device memory at FBTT's shape, B = 65,536 x 20 (f32), for the sorted
    distinct ids of the forward: the one-buffer layout (work part at its upper bound, the
    harness's dense path) against the TF glue's two buffers (work sized by the report):
    the sizes, and the peak allocation of each backward."""
    rows = []
    p, q, ranks = [200, 220, 250], [4, 4, 4], [32, 32]
    shape = gh.TTShape(p, q, ranks)
    for dist in ("uniform", "zipf"):
        cores, sets, off, splits = tt_bench_inputs(65536, 20, dist, p, q, ranks, num_sets=1)
        ids, _ = sets[0]
        _, st = gh.tt_embedding_bag_forward(cores, p, q, ranks, ids, off, table_splits=splits)
        u = int(st.num_unique.item())
        uq = st.unique[:u].contiguous()
        drows = torch.randn(u, math.prod(q), device=common.DEVICE)
        del st
        res = {"section": "tt", "check": "rows_grad_memory", "dist": dist, "unique_ids": u}
        for dense in (True, False):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            grads, rep = gh.tt_rows_grad(shape, cores, uq, drows, dense=dense)
            torch.cuda.synchronize()
            res["peak_MB_" + ("one_buffer_dense" if dense else "two_buffers_compact")] = (
                torch.cuda.max_memory_allocated() - before
            ) / 2**20
            if not dense:
                sizes = gh.tt_rows_grad_bytes(shape, torch.float32, u, rep.cpu())
                res["index_MB"] = sizes["index"] / 2**20
                res["work_MB"] = sizes["work"] / 2**20
                res["one_buffer_MB"] = sizes["one_buffer"] / 2**20
            del grads, rep
        rows.append(res)
        common.log(json.dumps(res))
    torch.cuda.empty_cache()
    return rows


def tt_main(args, report):
    sweep, n_failed, summary = common.run_section(
        report,
        "tt_",
        args,
        tt_run_sweep,
        tt_check_errors,
        tt_check_determinism,
        ("rows_grad_work", "rows-grad work layouts", tt_check_rows_grad_work),
    )
    common.log(summary)
    common.log_worst(sweep, "tt ", 28)
    if not args.small and not args.no_bench:
        report["tt_bench"] = tt_run_benchmarks()
        report["tt_rows_grad_memory"] = tt_rows_grad_memory()
    return n_failed == 0
