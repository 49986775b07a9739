"""``python -m grouped_linear bench --suite layouts``: the row-relayout ops against a plain copy.

Measured in one process, bf16 on CUDA (hidden ``H`` in 4096 and 7168, about 65536
and 131072 routed rows), float32 on CPU at tiny sizes (a smoke test only):

1. **copy**: ``dst.copy_(src)`` on a buffer as large as the largest case's ``(rows, H)``;
   bytes = ``2 * nbytes`` (read + write). Every op below is reported as GB/s and as
   a fraction of this copy GB/s.
2. **layout ops** per ``(H, rows)`` on a random top-8 routing over 64 experts
   (``T = rows // 8`` tokens, experts from ``randn(T, 64).topk(8)``, probs the
   softmax of the top-8 logits, group sizes read to the host once before timing).
   With ``e`` bytes per element, ``M = T*8`` routed rows, ``P`` the padded rows,
   ``N`` the rows of ``permute``'s output (``M`` plus padding; on CUDA the upper
   bound ``M + 64*(multiple-1)``), bytes moved are:

   ============================  ==========================  ==========================
   op                            forward                     backward (w.r.t. the input)
   ============================  ==========================  ==========================
   pad_groups (128)              ``(M + P) * H * e``         ``2 * M * H * e`` (an unpad)
   unpad_groups                  ``2 * M * H * e``           ``(M + P) * H * e`` (a pad)
   permute (1 and 16)            ``(T + N) * H * e``         ``(M + T) * H * e`` (k-way sum)
   permute (map)                 ``(T + N) * H * e``         ``(M + T) * H * e``
   permute (capacity)            ``(T + N) * H * e``         ``(N + T) * H * e``
   permute (capacity, position)  ``(T + N) * H * e``         ``(N + T) * H * e``
   permute (pad_to_capacity)     ``(T + N) * H * e``         ``(K + T) * H * e``
   permute (num_out_tokens)      ``(T + N) * H * e``         ``(N + T) * H * e``
   unpermute                     ``(M + T) * H * e``         ``(T + N) * H * e`` (weighted gather)
   sort_chunks                   ``2 * M * H * e``           ``2 * M * H * e``
   ============================  ==========================  ==========================

   ``permute (map)`` takes the same routing as a boolean ``(T, 64)`` map with
   ``num_out_tokens=T*8`` (the rows' bound, as TransformerEngine requires of a map); ``permute
   (capacity)`` a capacity factor of 1 (``C = ceil(T*8/64)`` slots per expert, the rest dropped
   by probability; ``N`` the kept rows), ``permute (capacity, position)`` the same capacity
   with ``drop_policy="position"`` (the earliest slots kept), ``permute (pad_to_capacity)``
   the same with every group padded to ``C`` rows (``N = 64*C``; backward reads only the
   ``K`` kept rows); ``permute (num_out_tokens)`` the indices with ``num_out_tokens=3*M//4``
   (``N`` those rows); ``sort_chunks`` reorders the ``M`` routed rows' 64 expert chunks into
   a random order.

   The bytes an op must move: every input row it needs read once (``permute`` and
   ``unpermute``'s backward read each token's row once, though k slots use it) and every
   output row written once; routing metadata, ``probs`` and the index
   tensors are not counted. Forward runs with inputs that require grad, as in
   training. Backward is timed alone: one forward builds the graph, then
   ``torch.autograd.grad(out, inp, grad, retain_graph=True)`` is timed (no
   ``fwd_bwd - fwd`` subtraction, which is noisy and can go negative). ``unpermute``'s
   backward is taken w.r.t. ``y_perm`` only (``probs`` do not require grad); the row
   ``unpermute (probs grad)`` takes it w.r.t. ``probs`` only (``y_perm`` fixed), which
   must read every slot's row and each token's gradient row: ``(M + T) * H * e``.
3. **GroupedMLP overhead**: for the ``dsv3_ep32`` and ``qwen35_397b_ep64`` fc1/fc2
   pairs of ``shapes.json`` (scaled down on CPU), forward+backward of
   ``GroupedMLP(G, hidden, ffn, "swiglu", bias=False)`` against forward+backward
   of the two GEMMs alone (``F.grouped_mm``, or a loop of ``torch.matmul`` where
   grouped_mm does not run): ``ratio = mlp_ms / (fc1_ms + fc2_ms)``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import grouped_linear as gl

from .bench import Shape, load_shapes, scale_for_cpu
from .demo import resolve_device
from .timing import copy_bandwidth, format_table, median_seconds, progress, randn

__all__ = ["run_layouts_bench", "render_layouts_table"]

TOP_K = 8
NUM_EXPERTS = 64
PAD_MULTIPLE = 128
PERMUTE_MULTIPLES = (1, 16)
CASES = {"cuda": ((4096, 7168), (65536, 131072)), "cpu": ((64,), (2048,))}  # hidden, rows
MLP_PAIRS = ("dsv3_ep32", "qwen35_397b_ep64")


@dataclass
class _Op:
    """One layout op on one case: how to run it and the rows it moves."""

    name: str
    forward: Callable[[], torch.Tensor]
    inp: torch.Tensor
    traffic: Callable[[int], tuple[int, int]]  # output rows -> rows moved (forward, backward)



def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _routing(tokens: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random top-k routing: expert indices ``(T, k)``, probs ``(T, k)`` and host group sizes."""
    top, indices = torch.randn(tokens, NUM_EXPERTS, device=dev).topk(TOP_K, dim=-1)
    counts = torch.bincount(indices.reshape(-1), minlength=NUM_EXPERTS).tolist()
    return indices, top.softmax(dim=-1), counts


def _case_ops(hidden: int, rows: int, dev: torch.device, dtype: torch.dtype) -> list[_Op]:
    """The layout ops of one ``(hidden, rows)`` case with their byte counts (in rows)."""
    tokens = rows // TOP_K
    m = tokens * TOP_K
    indices, probs, counts = _routing(tokens, dev)
    padded = [_round_up(c, PAD_MULTIPLE) for c in counts]
    p = sum(padded)
    x = randn(m, hidden, device=dev, dtype=dtype, requires_grad=True)
    yp = randn(p, hidden, device=dev, dtype=dtype, requires_grad=True)
    x_tok = randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        routed, _, row_map = gl.permute(x_tok, indices, NUM_EXPERTS, multiple=1)
    y_perm = randn(*routed.shape, device=dev, dtype=dtype, requires_grad=True)
    n_unperm = y_perm.shape[0]
    y_fixed = y_perm.detach()
    # A new leaf: ``probs`` itself stays without grad for the ``unpermute`` row (``.float()`` of
    # a float32 tensor would return the same tensor and mark it).
    probs_leaf = probs.detach().float().requires_grad_()

    def permute_op(multiple: int) -> _Op:
        return _Op(f"permute(multiple={multiple})",
                   lambda: gl.permute(x_tok, indices, NUM_EXPERTS, multiple=multiple)[0],
                   x_tok, lambda n: (tokens + n, m + tokens))

    routing_map = torch.zeros(tokens, NUM_EXPERTS, dtype=torch.bool, device=dev)
    routing_map.scatter_(1, indices, True)
    capacity = -(-m // NUM_EXPERTS)  # the slots per expert of a capacity factor of 1
    kept_at_capacity = sum(min(c, capacity) for c in counts)
    num_out = 3 * m // 4
    chunk_order = torch.randperm(NUM_EXPERTS, device=dev)
    chunk_sizes = torch.tensor(counts, device=dev)
    return [
        _Op(f"pad_groups({PAD_MULTIPLE})",
            lambda: gl.pad_groups(x, counts, multiple=PAD_MULTIPLE)[0], x, lambda n: (m + n, 2 * m)),
        _Op("unpad_groups", lambda: gl.unpad_groups(yp, counts, padded), yp,
            lambda n: (2 * m, m + p)),
        *(permute_op(k) for k in PERMUTE_MULTIPLES),
        _Op("permute(map)", lambda: gl.permute(x_tok, routing_map, NUM_EXPERTS,
                                               num_out_tokens=m)[0], x_tok,
            lambda n: (tokens + n, m + tokens)),
        _Op("permute(capacity)", lambda: gl.permute(x_tok, indices, NUM_EXPERTS, probs=probs,
                                                    capacity=1.0)[0],
            x_tok, lambda n: (tokens + n, n + tokens)),
        _Op("permute(capacity, position)",
            lambda: gl.permute(x_tok, indices, NUM_EXPERTS, capacity=1.0,
                               drop_policy="position")[0],
            x_tok, lambda n: (tokens + n, n + tokens)),
        # every group padded to the capacity: backward reads only the kept rows
        _Op("permute(pad_to_capacity)",
            lambda: gl.permute(x_tok, indices, NUM_EXPERTS, probs=probs, capacity=1.0,
                               pad_to_capacity=True)[0],
            x_tok, lambda n: (tokens + n, kept_at_capacity + tokens)),
        _Op("permute(num_out_tokens)",
            lambda: gl.permute(x_tok, indices, NUM_EXPERTS, num_out_tokens=num_out)[0],
            x_tok, lambda n: (tokens + n, n + tokens)),
        _Op("sort_chunks", lambda: gl.sort_chunks_by_index(x, chunk_sizes, chunk_order), x,
            lambda n: (2 * m, 2 * m)),
        _Op("unpermute", lambda: gl.unpermute(y_perm, row_map, probs), y_perm,
            lambda n: (m + n, tokens + n_unperm)),
        # the router's gradient: each slot's row dotted with its token's gradient row
        _Op("unpermute (probs grad)", lambda: gl.unpermute(y_fixed, row_map, probs_leaf),
            probs_leaf, lambda n: (m + n, m + n)),
    ]


def _measure_op(op: _Op, hidden: int, rows: int, dev: torch.device, copy_gbps: float,
                reps: int) -> list[dict]:
    """Forward and backward rows of one op (backward timed alone on a retained graph)."""
    out = op.forward()
    grad = torch.randn_like(out)
    fwd_rows, bwd_rows = op.traffic(out.shape[0])
    elem = out.element_size()
    fwd_s = median_seconds(op.forward, dev, reps=reps)
    bwd_s = median_seconds(lambda: torch.autograd.grad(out, op.inp, grad, retain_graph=True),
                           dev, reps=reps)
    results = []
    for direction, seconds, moved in (("fwd", fwd_s, fwd_rows), ("bwd", bwd_s, bwd_rows)):
        nbytes = moved * hidden * elem
        gbps = _gbps(nbytes, seconds)
        results.append({"op": op.name, "direction": direction, "hidden": hidden, "rows": rows,
                        "bytes": nbytes, "ms": seconds * 1e3, "gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps})
    return results


# --------------------------------------------------------------------------- GroupedMLP
def _mlp_pairs(dev: torch.device) -> list[tuple[str, Shape, Shape]]:
    """The packaged fc1/fc2 pairs that form a swiglu MLP (scaled down on CPU)."""
    shapes = load_shapes()
    pairs = []
    for name in MLP_PAIRS:
        fc1, fc2 = shapes.get(f"{name}_fc1"), shapes.get(f"{name}_fc2")
        if fc1 is None or fc2 is None:
            continue
        if dev.type == "cpu":
            fc1, fc2 = scale_for_cpu(fc1), scale_for_cpu(fc2)
        if fc1.N == 2 * fc2.K and fc2.N == fc1.K and fc1.splits == fc2.splits:
            pairs.append((name, fc1, fc2))
    return pairs


def _grouped_mm_runs(dev: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs forward and backward for ``dtype`` on ``dev``."""
    try:
        x = randn(32, 16, device=dev, dtype=dtype, requires_grad=True)
        w = randn(2, 16, 16, device=dev, dtype=dtype, requires_grad=True)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=dev)
        F.grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(torch.ones_like(x))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def _gemm_seconds(splits: tuple[int, ...], k: int, n: int, dev: torch.device,
                  dtype: torch.dtype, grouped: bool, reps: int) -> float:
    """Forward+backward seconds of one grouped GEMM ``(M, k) -> (M, n)`` with a ``(G, n, k)`` weight."""
    x = randn(sum(splits), k, device=dev, dtype=dtype, requires_grad=True)
    w = randn(len(splits), n, k, device=dev, dtype=dtype, scale=k ** -0.5, requires_grad=True)
    grad = randn(sum(splits), n, device=dev, dtype=dtype)
    offs = torch.tensor(splits, dtype=torch.int64).cumsum(0).to(dev, torch.int32)
    sizes = list(splits)

    def fwd_bwd() -> None:
        if grouped:
            y = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
        else:
            y = torch.cat([p @ wi.t() for p, wi in zip(x.split(sizes), w.unbind(0))])
        y.backward(grad)

    return median_seconds(fwd_bwd, dev, grad_to_none=[x, w], reps=reps)


def _mlp_seconds(fc1: Shape, fc2: Shape, dev: torch.device, dtype: torch.dtype, reps: int) -> float:
    """Forward+backward seconds of ``GroupedMLP(G, hidden, ffn, "swiglu", bias=False)``."""
    G, hidden, ffn, M = fc1.G, fc1.K, fc2.K, fc1.M
    mlp = gl.GroupedMLP(G, hidden, ffn, activation="swiglu", bias=False, params_dtype=dtype,
                        device=dev)
    with torch.no_grad():
        mlp.fc1.weight.copy_(randn(G, 2 * ffn, hidden, device=dev, dtype=dtype, scale=hidden ** -0.5))
        mlp.fc2.weight.copy_(randn(G, hidden, ffn, device=dev, dtype=dtype, scale=ffn ** -0.5))
    x = randn(M, hidden, device=dev, dtype=dtype, requires_grad=True)
    grad = randn(M, hidden, device=dev, dtype=dtype)
    splits = torch.tensor(fc1.splits, dtype=torch.int64, device=dev)
    return median_seconds(lambda: mlp(x, splits).backward(grad), dev,
                          grad_to_none=[x, *mlp.parameters()], reps=reps)


def _measure_mlp(name: str, fc1: Shape, fc2: Shape, dev: torch.device, dtype: torch.dtype,
                 grouped: bool, reps: int) -> dict:
    """GroupedMLP forward+backward against its two GEMMs alone."""
    G, hidden, ffn, M = fc1.G, fc1.K, fc2.K, fc1.M
    mlp_s = _mlp_seconds(fc1, fc2, dev, dtype, reps)
    fc1_s = _gemm_seconds(fc1.splits, hidden, 2 * ffn, dev, dtype, grouped, reps)
    fc2_s = _gemm_seconds(fc2.splits, ffn, hidden, dev, dtype, grouped, reps)
    return {"shape": name, "G": G, "M": M, "hidden": hidden, "ffn": ffn,
            "gemm_impl": "grouped_mm" if grouped else "matmul_loop",
            "mlp_ms": mlp_s * 1e3, "fc1_ms": fc1_s * 1e3, "fc2_ms": fc2_s * 1e3,
            "gemm_ms": (fc1_s + fc2_s) * 1e3, "ratio": mlp_s / (fc1_s + fc2_s)}


# --------------------------------------------------------------------------- driver
def run_layouts_bench(device: str | torch.device = "auto", json_path: str | None = None,
                      quiet: bool = False, reps: int = 5) -> dict:
    """Measure copy bandwidth, the layout ops and the GroupedMLP overhead; print the tables.

    Args:
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        json_path: write the returned dict there as JSON.
        quiet: no progress bar and no table.
        reps: timed repetitions per case on CPU (CUDA uses ``do_bench``'s budget).

    Returns:
        ``{"device", "dtype", "copy_gbps", "rows", "mlp", "table"}``: ``rows`` holds
        ``op, direction, hidden, rows, bytes, ms, gbps, fraction_of_copy`` per op,
        direction and case; ``mlp`` holds ``shape, mlp_ms, gemm_ms, ratio`` (and the
        sizes, ``fc1_ms``, ``fc2_ms`` and ``gemm_impl``) per fc1/fc2 pair.
    """
    dev = resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hiddens, row_counts = CASES[dev.type]
    pairs = _mlp_pairs(dev)
    num_ops = 3 + len(PERMUTE_MULTIPLES)
    bar = progress(1 + len(hiddens) * len(row_counts) * num_ops + len(pairs), desc="layouts",
                   disable=quiet)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # torch warns once when autograd's CUDA thread first creates its cuBLAS handle.
        warnings.filterwarnings("ignore", message=".*no current CUDA context.*")
        bar.set_description("layouts: copy")
        copy_gbps = copy_bandwidth(dev, max(hiddens) * max(row_counts), dtype, reps) / 1e9
        bar.update(1)
        rows: list[dict] = []
        for hidden in hiddens:
            for count in row_counts:
                for op in _case_ops(hidden, count, dev, dtype):
                    bar.set_description(f"layouts H={hidden} rows={count}: {op.name}")
                    rows += _measure_op(op, hidden, count, dev, copy_gbps, reps)
                    bar.update(1)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        grouped = _grouped_mm_runs(dev, dtype)
        mlp = []
        for name, fc1, fc2 in pairs:
            bar.set_description(f"layouts mlp: {name}")
            mlp.append(_measure_mlp(name, fc1, fc2, dev, dtype, grouped, reps))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            bar.update(1)
    bar.close()
    report = {"device": str(dev), "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
              "torch_version": torch.__version__, "copy_gbps": copy_gbps, "rows": rows,
              "mlp": mlp}
    report["table"] = render_layouts_table(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, allow_nan=True)
    if not quiet:
        print(report["table"])
    return report


def render_layouts_table(report: dict) -> str:
    """The text tables of a :func:`run_layouts_bench` report."""
    title = (f"grouped_linear layouts bench on {report['device']}, {report['dtype']}, torch "
             f"{report['torch_version']}: copy {report['copy_gbps']:.1f} GB/s (read + write)")
    rows = [[r["op"], r["direction"], r["hidden"], r["rows"], f"{r['ms']:.3f}",
             f"{r['gbps']:.1f}", f"{r['fraction_of_copy']:.2f}"] for r in report["rows"]]
    parts = [format_table(["op", "dir", "H", "rows", "ms", "GB/s", "of copy"], rows, title=title)]
    if report["mlp"]:
        mlp_rows = [[m["shape"], m["G"], m["M"], m["hidden"], m["ffn"], m["gemm_impl"],
                     f"{m['mlp_ms']:.3f}", f"{m['gemm_ms']:.3f}", f"{m['ratio']:.2f}"]
                    for m in report["mlp"]]
        parts.append(format_table(
            ["shape", "G", "M", "hidden", "ffn", "gemms", "mlp ms", "gemm ms", "ratio"], mlp_rows,
            title="GroupedMLP (swiglu, no bias) forward+backward vs its fc1 + fc2 GEMMs alone"))
    notes = ["bytes: each routed row read once and each output row written once (see the module "
             "docstring); bwd is timed alone on a retained graph"]
    if not report["device"].startswith("cuda"):
        notes.append("CPU: tiny float32 sizes and scaled-down MLP shapes, a smoke test only")
    return "\n".join(parts) + "\n" + "\n".join("note: " + n for n in notes)
