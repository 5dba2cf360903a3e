"""What the per-family checks of gpu_check.py share: dtypes, tolerances, logging, ids,
the error-measure, the CUDA-event timers and the harness build."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INDEX_DTYPES = [torch.int32, torch.int64]
COMBINERS = ["sum", "mean", "sqrtn", "max"]
RTOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}
ATOL = {torch.float16: 1e-4, torch.bfloat16: 1e-30, torch.float32: 1e-30, torch.float64: 0.0}
DEVICE = "cuda"  # a dry run on a machine without a GPU sets "cpu"
SHORT = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int32: "i32",
    torch.int64: "i64",
}

# name, N, D, (min len, max len), B, distribution, padding id
CONFIGS = [
    ("d1", 50, 1, (0, 8), 64, "uniform", None),
    ("d3-pad-oob", 100, 3, (0, 16), 50, "zipf", -1),
    ("d64-pad", 1000, 64, (0, 64), 128, "uniform", 7),
    ("d127-zipf", 500, 127, (0, 40), 64, "zipf", None),
    ("d1024", 2000, 1024, (0, 32), 32, "uniform", None),
    ("d4096-pad", 300, 4096, (0, 8), 8, "zipf", 3),
    ("long-bags", 5000, 64, (2048, 4096), 3, "uniform", None),
    ("hot-rows", 64, 96, (0, 4096), 24, "zipf", 5),
    ("empty-bags", 10, 16, (0, 0), 5, "uniform", None),
    ("no-bags", 10, 16, (0, 0), 0, "uniform", None),
    ("zero-den", 40, 8, (2, 2), 6, "uniform", None),
]
SMALL_CONFIGS = [
    "d3-pad-oob",
    "d64-pad",
    "d127-zipf",
    "long-bags",
    "hot-rows",
    "zero-den",
    "empty-bags",
]


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------
# Inputs.


def random_weights(nnz, combiner, gen):
    """float64 weights in [0.25, 1.25): positive for mean (no zero denominators), else 30%
    of them negative."""
    if combiner == "mean":
        return torch.rand(nnz, generator=gen, dtype=torch.float64) + 0.25
    sign = torch.where(torch.rand(nnz, generator=gen) < 0.3, -1.0, 1.0)
    return (torch.rand(nnz, generator=gen, dtype=torch.float64) + 0.25) * sign


def make_ids(n, num_rows, dist, dtype, gen, device, perm=None):
    """perm: a fixed popularity order for Zipf ids (the id of rank r is perm[r]); None draws
    a new one per call (then successive batches have different hot ids)."""
    if n == 0:
        return torch.empty(0, dtype=dtype, device=device)
    if dist == "uniform":
        ids = torch.randint(0, num_rows, (n,), generator=gen)
    else:
        ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
        probs = ranks.pow(-1.1)
        draw = torch.multinomial(probs, n, replacement=True, generator=gen)
        if perm is None:
            perm = torch.randperm(num_rows, generator=gen)
        ids = perm[draw]
    return ids.to(dtype).to(device)


def close(got, ref, ref_abs, dtype):
    """|got - ref| <= rtol * sum|terms| + atol elementwise; returns (ok, worst ratio)."""
    if got.shape != ref.shape:
        return False, float("inf")
    if got.numel() == 0:
        return True, 0.0
    g = got.detach().cpu().double()
    err = (g - ref).abs()
    bound = RTOL[dtype] * ref_abs + ATOL[dtype]
    ok = bool(torch.all(err <= bound)) and not bool(torch.isnan(g).any())
    ratio = float((err / (ref_abs + 1e-300)).nan_to_num(float("inf")).max())
    return ok, ratio


def check_close(res, key, label, got, ref, ref_abs, dtype):
    """close(); records the ratio as res["worst"][key] and a failure named `label`."""
    ok, ratio = close(got, ref, ref_abs, dtype)
    res["worst"][key] = ratio
    if not ok:
        res["failures"].append(f"{label} ({ratio:.3g})")
    return ok


# ---------------------------------------------------------------------------
# Checks.


def bits(t):
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


def expect_error(fn, message):
    try:
        fn()
    except ValueError as exc:
        return str(exc) == message, str(exc)
    return False, "no error"


def bench(fn, iters, warmup=3):
    """Median of CUDA-event timings in ms; fn(i) gets the iteration number."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    events = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i)
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def bench_graph(make_fn, iters):
    """Median replay time (ms) of CUDA graphs, one captured per input set: device time
    without the host's launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            make_fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for i in range(3):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            make_fn(i)
        graphs.append(g)
    ms = bench(lambda i: graphs[i % 3].replay(), iters)
    graphs = None
    return ms


def timed(r, key, make_fn, iters, graph=True):
    """r[key + '_ms']: graph replay when it can be captured, else eager; both recorded."""
    try:
        r[key + "_eager_ms"] = bench(make_fn, iters)
    except Exception as exc:  # noqa: BLE001
        r[key + "_eager_ms"] = None
        r[key + "_error"] = repr(exc)[:300]
        r[key + "_ms"] = None
        return
    if graph:
        try:
            r[key + "_graph_ms"] = bench_graph(make_fn, iters)
        except Exception as exc:  # noqa: BLE001
            r[key + "_graph_ms"] = None
            r[key + "_graph_error"] = repr(exc)[:300]
            torch.cuda.synchronize()
    r[key + "_ms"] = r.get(key + "_graph_ms") or r[key + "_eager_ms"]


def copy_bandwidth():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda i: y.copy_(x), 20)
    return 2 * x.numel() / ms / 1e9


def build(lib_dir):
    t0 = time.time()
    subprocess.run(
        ["bash", str(REPO / "python" / "gpu_harness" / "build_gpu_harness.sh"), str(lib_dir)],
        check=True,
    )
    return time.time() - t0


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def log_worst(sweep, prefix, width):
    """Logs the worst |err| / sum|terms| per (dtype, quantity) over a sweep's cases."""
    worst = {}
    for r in sweep:
        for k, v in r.get("worst", {}).items():
            key = (r["dtype"], k)
            worst[key] = max(worst.get(key, 0.0), v)
    for (dt, k), v in sorted(worst.items()):
        log(f"  {prefix}worst |err| / sum|terms|  {dt:5s} {k:{width}s} {v:.3g}")


def run_poisoned(report, prefix, sweep, *checks):
    """A section's sweep and checks with harness.POISON on (so that an output element the
    kernels fail to write shows up): report[prefix + "sweep"] = sweep(), its seconds in
    report[prefix + "sweep_s"], then report[key] = check() for each (key, check) pair.
    Returns (the sweep, the number of its cases that failed)."""
    harness.POISON = True
    t0 = time.time()
    result = sweep()
    report[prefix + "sweep_s"] = time.time() - t0
    report[prefix + "sweep"] = result
    for key, check in checks:
        report[key] = check()
    harness.POISON = False
    return result, sum(bool(r["failures"]) for r in result)


def run_section(report, prefix, args, sweep, errors, determinism, *more):
    """The checks of a kernel family's section, under run_poisoned: the sweep
    (sweep(args.small, args.max_cases)), its error messages (errors(): rows that fail
    where not r["ok"]) in report[prefix + "errors"], its bitwise determinism
    (determinism(args.small): rows that fail where not r["bitwise_identical"]) in
    report[prefix + "determinism"], then each (key, name, check) of `more`
    (check(args.small): rows that fail where r["failures"]) in report[prefix + key].
    Returns (the sweep, how many sweep cases and check rows failed, the summary line
    "<prefix>sweep: 9/9 cases passed (1.2 s); error messages: 4/4; determinism: 2/2; ...")."""
    checks = [
        ("errors", "error messages", errors, lambda r: not r["ok"]),
        (
            "determinism",
            "determinism",
            lambda: determinism(args.small),
            lambda r: not r["bitwise_identical"],
        ),
    ]
    checks += [
        (key, name, lambda check=check: check(args.small), lambda r: bool(r["failures"]))
        for key, name, check in more
    ]
    result, failed = run_poisoned(
        report,
        prefix,
        lambda: sweep(args.small, args.max_cases),
        *((prefix + key, check) for key, _, check, _ in checks),
    )
    parts = [
        f"{prefix.replace('_', ' ')}sweep: {len(result) - failed}/{len(result)} cases passed "
        f"({report[prefix + 'sweep_s']:.1f} s)"
    ]
    for key, name, _, fails in checks:
        rows = report[prefix + key]
        n_fail = sum(bool(fails(r)) for r in rows)
        failed += n_fail
        parts.append(f"{name}: {len(rows) - n_fail}/{len(rows)}")
    return result, failed, "; ".join(parts)


def case_fields(config, dtype, itype, combiner, weighted, section=None):
    """How a sweep case of the gather_reduce_sum and TT sections is named in the report."""
    fields = {} if section is None else {"section": section}
    fields.update(
        config=config[0],
        dtype=SHORT[dtype],
        itype=SHORT[itype],
        combiner=combiner,
        weighted=weighted,
    )
    return fields


def run_cases(cases, check, first_seed, describe, label, max_cases=None):
    """Runs `check(*case, seed)` over the cases (seeds counting from first_seed; at most
    max_cases of them, spread evenly). An exception is a failure with its trace, recorded
    with `describe(case)` (a dict of the case's fields); failures are logged as `label`
    with the fields that `describe` names."""
    if max_cases and len(cases) > max_cases:
        step = len(cases) / max_cases
        cases = [cases[int(i * step)] for i in range(max_cases)]
    results = []
    for seed, case in enumerate(cases, first_seed):
        try:
            r = check(*case, seed)
        except Exception as exc:  # noqa: BLE001 -- reported, not hidden
            r = dict(describe(case), failures=[f"exception: {exc!r}"])
            r["trace"] = traceback.format_exc()
        results.append(r)
        if r["failures"]:
            fields = [k for k in describe(case) if k != "section"]
            log(label, {k: r.get(k) for k in fields}, r["failures"])
            if "trace" in r:
                log(r["trace"])
    return results
