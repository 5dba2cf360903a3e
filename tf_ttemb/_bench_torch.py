"""torch's side of `python -m tf_ttemb bench`: the data of its EmbeddingBag cases, and
`torch.nn.functional.embedding_bag` timed on it, in the bench's process (the CPU) or in
a child process that the bench starts (a GPU).

This module imports the standard library, numpy and tf_ttemb/_timing.py (from its file;
torch inside the functions that use it), so that it also runs as a script in a fresh
interpreter that never loads TensorFlow or the tf_ttemb package: torch initialising CUDA
in a process that already ran TensorFlow on the GPU died of SIGFPE on the H200 machine.
The child's protocol is `tf_ttemb._timing.run_worker`'s: the bench runs

    python .../tf_ttemb/_bench_torch.py --_worker SPEC

with SPEC a JSON object (`worker_spec` builds it; `run_worker` adds `result_path`), and
the child writes its JSON result to that file (see `measure`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import numpy as np

# The value dtypes the bench asks torch for (torch's names are the same).
DTYPES = ("float16", "bfloat16", "float32", "float64")
# Bags whose output (and weights gradient) the child returns, for the agreement check.
CHECK_BAGS = 8


def bag_data(
    seed: Sequence[int], rows: int, dim: int, bags: int, bag_size: int, batches: int = 1
) -> Dict[str, Any]:
    """The data of one weighted-sum EmbeddingBag case, the same in every process.

    Each array comes from its own generator, seeded `[*seed, k]`, so a process that needs
    only the first batch of ids draws exactly the same ones as one that draws many.

    Args:
      seed: The case's seed (the bench's `--seed`, the case's and the dtype's index).
      rows: Rows of the table.
      dim: Columns of the table.
      bags: Bags per batch.
      bag_size: Ids per bag.
      batches: Batches of ids (the first is the one timed per call).

    Returns:
      `table` float32 [rows, dim] (standard normal), `ids`: a list of `batches` int64
      [bags, bag_size] arrays (uniform in [0, rows)), `weights` float32 [bags, bag_size]
      (uniform in [0.5, 1.5)), `upstream` float32 [bags, dim] (standard normal).
    """
    table_rng, ids_rng, weights_rng, upstream_rng = (
        np.random.default_rng([*seed, k]) for k in range(4)
    )
    return {
        "table": table_rng.standard_normal((rows, dim), dtype=np.float32),
        "ids": [
            ids_rng.integers(0, rows, size=(bags, bag_size), dtype=np.int64) for _ in range(batches)
        ],
        "weights": weights_rng.uniform(0.5, 1.5, size=(bags, bag_size)).astype(np.float32),
        "upstream": upstream_rng.standard_normal((bags, dim), dtype=np.float32),
    }


def embedding_bag_steps(
    torch: Any, data: Mapping[str, Any], dtype: str, device: str
) -> Tuple[Callable[[], Any], Callable[[], List[Any]]]:
    """`fwd()` and `fwd_bwd()` of `torch.nn.functional.embedding_bag(mode="sum",
    per_sample_weights=w, sparse=True)` on `data` (its first batch of ids).

    `fwd` runs under `torch.no_grad()`; `fwd_bwd` returns the output, the sparse table
    gradient and the weights gradient of `data["upstream"]`.
    """
    dt = getattr(torch, dtype)
    table = torch.nn.Parameter(torch.from_numpy(data["table"]).to(device=device, dtype=dt))
    ids = torch.from_numpy(data["ids"][0]).to(device)
    weights = torch.from_numpy(data["weights"]).to(device=device, dtype=dt)
    weights.requires_grad_(True)
    upstream = torch.from_numpy(data["upstream"]).to(device=device, dtype=dt)

    def forward():
        return torch.nn.functional.embedding_bag(
            ids, table, mode="sum", per_sample_weights=weights, sparse=True
        )

    def fwd():
        with torch.no_grad():
            return forward()

    def fwd_bwd():
        out = forward()
        table_grad, weights_grad = torch.autograd.grad(out, [table, weights], upstream)
        return [out, table_grad, weights_grad]

    return fwd, fwd_bwd


def worker_spec(
    cases: Sequence[Mapping[str, Any]], device: str, warmup: int, repeats: int, threads: Any
) -> Dict[str, Any]:
    """The child's SPEC: `cases` are dicts with `key` (any string, to find the result),
    `seed`, `rows`, `dim`, `bags`, `bag_size` and `dtype`; `device` is torch's ("cuda:0",
    "cpu"); `threads` torch's intra-op threads on the CPU (None: torch's choice)."""
    return {
        "cases": [dict(c) for c in cases],
        "device": device,
        "warmup": warmup,
        "repeats": repeats,
        "threads": threads,
    }


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _timing_module() -> Any:
    """tf_ttemb/_timing.py, loaded from its file (as python/bench/_bench_util.py loads it):
    as a script, this module must not import the package, which imports TensorFlow."""
    name = "tf_ttemb_timing"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_timing.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while building
        spec.loader.exec_module(module)
    return sys.modules[name]


def _time_calls(torch: Any, fn: Callable[[], Any], cuda: bool, warmup: int, repeats: int) -> dict:
    """{"median_ms", "min_ms", "repeats"} of `fn()`: CUDA events around each call on a GPU
    (the device's time from the call's first kernel to its last), the wall clock on the
    CPU (torch's CPU ops have finished when they return)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    with _timing_module().collector_paused():  # as our side's timed calls
        for _ in range(repeats):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(float(start.elapsed_time(end)))
            else:
                begin = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - begin) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "repeats": repeats}


def _check_rows(value: Any, count: int) -> List[List[float]]:
    return value[:count].detach().double().cpu().tolist()


def measure(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """The child's measurement: each case of `spec` timed forward and forward + backward.

    Returns:
      `{"ok": True, "torch_version", "device", "device_name", "timer", "results"}` with
      `results[key]` = `{"fwd": timing, "fwd_bwd": timing, "check": {"fwd": [the output's
      first CHECK_BAGS bags], "fwd_bwd": [those bags' output, their weights gradient]},
      "errors": {kind: "Type: message"}}` (a kind that failed has an error and no timing),
      or `{"ok": False, "error": ...}` when torch cannot run there at all.
    """
    import torch

    device = spec["device"]
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        return {
            "ok": False,
            "error": f"torch {torch.__version__} sees no CUDA device "
            "(torch.cuda.is_available() is False)",
        }
    if not cuda and spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    results = {}
    for case in spec["cases"]:
        entry: Dict[str, Any] = {"check": {}, "errors": {}}
        try:
            data = bag_data(case["seed"], case["rows"], case["dim"], case["bags"], case["bag_size"])
            steps = embedding_bag_steps(torch, data, case["dtype"], device)
            del data
        except Exception as e:  # noqa: BLE001 -- reported in the bench's output
            entry["errors"] = {kind: _first_line(e) for kind in ("fwd", "fwd_bwd")}
            results[case["key"]] = entry
            continue
        for kind, fn in zip(("fwd", "fwd_bwd"), steps):
            try:
                result = fn()
                if kind == "fwd":
                    entry["check"][kind] = [_check_rows(result, CHECK_BAGS)]
                else:
                    entry["check"][kind] = [
                        _check_rows(result[0], CHECK_BAGS),
                        _check_rows(result[2], CHECK_BAGS),
                    ]
                del result
                entry[kind] = _time_calls(torch, fn, cuda, spec["warmup"], spec["repeats"])
            except Exception as e:  # noqa: BLE001 -- reported in the bench's output
                entry["errors"][kind] = _first_line(e)
        del steps
        if cuda:
            torch.cuda.empty_cache()
        results[case["key"]] = entry
    return {
        "ok": True,
        "torch_version": torch.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
        "timer": "CUDA events" if cuda else "wall clock",
        "results": results,
    }


def _worker_main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != "--_worker":
        print("usage: _bench_torch.py --_worker SPEC (started by python -m tf_ttemb bench)")
        return 2
    spec = json.loads(argv[1])
    try:
        result = measure(spec)
    except Exception as e:  # noqa: BLE001 -- reported in the bench's output
        result = {"ok": False, "error": _first_line(e)}
    with open(spec["result_path"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
