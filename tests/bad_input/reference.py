"""Float64 references written with plain torch loops, independent of the library."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           sizes: list[int]) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ weight[g]^T + bias[g]``, group by group, in float64
    (differentiable: torch's autograd of these plain ops gives the reference gradients)."""
    x, weight = x.double(), weight.double()
    rows, start = [], 0
    for g, size in enumerate(sizes):
        part = x[start:start + size] @ weight[g].t()
        if bias is not None:
            part = part + bias[g].double()
        rows.append(part)
        start += size
    rows.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
    return torch.cat(rows)


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def pad(x: torch.Tensor, sizes: list[int], multiple: int) -> tuple[torch.Tensor, list[int]]:
    """Each group's rows followed by zero rows up to a multiple of ``multiple``."""
    parts, padded, start = [], [], 0
    for size in sizes:
        padded.append(round_up(size, multiple))
        parts.append(x[start:start + size].double())
        parts.append(x.new_zeros(padded[-1] - size, x.shape[1], dtype=torch.float64))
        start += size
    return torch.cat(parts), padded


def unpad(yp: torch.Tensor, sizes: list[int], padded: list[int]) -> torch.Tensor:
    """Each padded group's first ``sizes[g]`` rows."""
    parts, start = [], 0
    for size, rows in zip(sizes, padded):
        parts.append(yp[start:start + size].double())
        start += rows
    return torch.cat(parts) if parts else yp.new_zeros(0, yp.shape[1], dtype=torch.float64)


def permute(x: torch.Tensor, topk: torch.Tensor, num_experts: int, multiple: int
            ) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """Rows of the routed slots expert by expert (slots ``t*k + j`` ascending), each group
    padded with zero rows; the padded sizes; the row of every slot (``-1``: dropped)."""
    tokens, k = topk.shape
    experts = [[int(v) for v in row] for row in topk.tolist()]
    rows: list[torch.Tensor] = []
    row_map = [[-1] * k for _ in range(tokens)]
    sizes = []
    for e in range(num_experts):
        count = 0
        for t in range(tokens):
            for j in range(k):
                if experts[t][j] == e:
                    row_map[t][j] = len(rows)
                    rows.append(x[t].double())
                    count += 1
        sizes.append(round_up(count, multiple))
        rows.extend(x.new_zeros(x.shape[1], dtype=torch.float64)
                    for _ in range(sizes[-1] - count))
    out = torch.stack(rows) if rows else x[:0].double()  # no slot routed: no padding either
    return out, sizes, row_map


def unpermute(y: torch.Tensor, row_map: list[list[int]], probs: torch.Tensor | None
              ) -> torch.Tensor:
    """``out[t] = sum_j probs[t, j] * y[row_map[t][j]]`` over the slots with a row."""
    out = y.new_zeros(len(row_map), y.shape[1], dtype=torch.float64)
    for t, slots in enumerate(row_map):
        for j, row in enumerate(slots):
            if row >= 0:
                weight = 1.0 if probs is None else probs[t, j].double()
                out[t] += weight * y[row].double()
    return out


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def mlp(x: torch.Tensor, sizes: list[int], fc1: tuple[torch.Tensor, torch.Tensor | None],
        fc2: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """``fc2(swiglu(fc1(x)))`` group by group in float64."""
    return linear(swiglu(linear(x, fc1[0], fc1[1], sizes)), fc2[0], fc2[1], sizes)


def moe(x: torch.Tensor, router: torch.Tensor, top_k: int,
        fc1: tuple[torch.Tensor, torch.Tensor | None],
        fc2: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """Token by token: softmax router, top-k experts, probabilities renormalised, the sum of
    the chosen experts' ``fc2(swiglu(fc1(x_t)))`` weighted by them."""
    out = x.new_zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        row = x[t:t + 1].double()
        probs = torch.softmax(row @ router.double().t(), dim=-1)[0]
        top = torch.topk(probs, top_k)
        weights = top.values / top.values.sum()
        for weight, e in zip(weights, top.indices.tolist()):
            h = row @ fc1[0][e].double().t() + (fc1[1][e].double() if fc1[1] is not None else 0)
            y = swiglu(h) @ fc2[0][e].double().t() + (fc2[1][e].double()
                                                      if fc2[1] is not None else 0)
            out[t] += weight * y[0]
    return out
