"""permute's routing inputs (bool maps, top-1 indices, probabilities, capacity, num_out_tokens)
and unpermute's dense probabilities, against float64 loop references."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from grouped_linear.ops.permutation import TRACEABLE, permute, unpermute


# --------------------------------------------------------------------------- reference
@dataclass
class Routed:
    """What the loop reference expects: the layout, its sizes, each slot's row, and the
    probability of every row."""

    x_perm: torch.Tensor
    m_splits: list[int]
    row_map: list[list[int]]
    row_probs: list[float] = field(default_factory=list)


def slots_of(routing: torch.Tensor, num_experts: int) -> list[list[int]]:
    """Each token's slot experts as lists (-1 dropped): a bool map's slot (t, e) is e where
    set; top-1 indices are one slot per token."""
    if routing.dtype == torch.bool:
        return [[e if bool(routing[t, e]) else -1 for e in range(num_experts)]
                for t in range(routing.shape[0])]
    if routing.dim() == 1:
        return [[int(e)] for e in routing]
    return [[int(e) for e in row] for row in routing]


def ref_route(x: torch.Tensor, routing: torch.Tensor, num_experts: int, multiple: int = 1,
              probs: torch.Tensor | None = None, capacity: int | None = None,
              policy: str = "probs", num_out_tokens: int | None = None,
              pad_to_capacity: bool = False) -> Routed:
    slots = slots_of(routing, num_experts)
    k = routing.shape[1] if routing.dim() == 2 else 1
    flat_probs = [] if probs is None else probs.reshape(len(slots), k).double().tolist()
    by_expert: list[list[tuple[int, int]]] = [[] for _ in range(num_experts)]
    for t, row in enumerate(slots):
        for j, e in enumerate(row):
            if 0 <= e < num_experts:
                by_expert[e].append((t, j))
    if capacity is not None:
        for e, group in enumerate(by_expert):
            if policy == "probs":  # highest probability first, then the lower slot t*k + j
                chosen = sorted(group, key=lambda s: (-flat_probs[s[0]][s[1]], s[0] * k + s[1]))
            else:
                chosen = group
            by_expert[e] = sorted(chosen[:capacity])
    if num_out_tokens is not None:
        left = num_out_tokens
        for e, group in enumerate(by_expert):
            by_expert[e] = group[:max(left, 0)]
            left -= len(group)
    row_map = [[-1] * k for _ in slots]
    rows: list[torch.Tensor] = []
    row_probs: list[float] = []
    sizes = []
    zero = torch.zeros(x.shape[1], dtype=torch.float64)
    for group in by_expert:
        for t, j in group:
            row_map[t][j] = len(rows)
            rows.append(x[t].double())
            row_probs.append(flat_probs[t][j] if flat_probs else 0.0)
        size = capacity if pad_to_capacity else -(-len(group) // multiple) * multiple
        rows.extend([zero] * (size - len(group)))
        row_probs.extend([0.0] * (size - len(group)))
        sizes.append(size)
    x_perm = torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=torch.float64)
    return Routed(x_perm, sizes, row_map, row_probs)


def ref_combine(y: torch.Tensor, row_map: list[list[int]], weights: list[list[float]] | None
                ) -> torch.Tensor:
    out = torch.zeros(len(row_map), y.shape[1], dtype=torch.float64)
    for t, row in enumerate(row_map):
        for j, r in enumerate(row):
            if r >= 0:
                out[t] += (1.0 if weights is None else weights[t][j]) * y[r].double()
    return out


def check(got: tuple, want: Routed, probs: torch.Tensor | None = None) -> None:
    x_perm, m_splits, row_map = got[:3]
    assert m_splits.dtype == torch.int64 and m_splits.tolist() == want.m_splits
    assert row_map.dtype == torch.int64 and row_map.tolist() == want.row_map
    torch.testing.assert_close(x_perm.double(), want.x_perm, rtol=0, atol=0)
    assert len(got) == (3 if probs is None else 4)
    if probs is not None:
        assert got[3].dtype == probs.dtype and got[3].shape == (x_perm.shape[0],)
        assert got[3].double().tolist() == want.row_probs


def routing_case(seed: int, tokens: int = 13, k: int = 3, num_experts: int = 5,
                 ties: bool = False):
    gen = torch.Generator().manual_seed(seed)
    topk = torch.randint(-1, num_experts, (tokens, k), generator=gen)
    probs = torch.rand(tokens, k, generator=gen, dtype=torch.float64)
    if ties:  # few distinct values: many equal probabilities within an expert
        probs = (probs * 3).floor() / 4
    x = torch.randn(tokens, 4, generator=gen, dtype=torch.float64)
    return x, topk, probs


# --------------------------------------------------------------------------- routing forms
@pytest.mark.parametrize("multiple", [1, 4])
def test_routing_map_equals_its_indices(multiple):
    """A bool (T, E) map routes as the (T, E) indices that name e where set: same layout,
    sizes and (T, E) row map; dense probabilities line up with the row map."""
    gen = torch.Generator().manual_seed(1)
    routing_map = torch.rand(9, 6, generator=gen) < 0.4
    routing_map[2] = False  # a token routed nowhere
    x = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    probs = torch.rand(9, 6, generator=gen, dtype=torch.float64)
    as_indices = torch.where(routing_map, torch.arange(6), -1)
    got = permute(x, routing_map, 6, multiple, probs=probs)
    want = permute(x, as_indices, 6, multiple, probs=probs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    check(got, ref_route(x, routing_map, 6, multiple, probs), probs)
    assert got[2].shape == (9, 6)
    y = torch.randn(got[0].shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(unpermute(y, got[2], probs),
                               ref_combine(y, got[2].tolist(), probs.tolist()))


def test_integer_indices_like_a_mask_route_as_indices_below_three_experts():
    """Integer (T, E) indices of only 0 and 1 are taken for a mask given without .bool() from
    three experts on (refused in the errors below); with two experts, or k != E, they route
    as indices, repeats included; the mask as .bool() routes as a map."""
    x = torch.randn(3, 4, dtype=torch.float64)
    for topk, num_experts in ((torch.tensor([[0, 1], [1, 1], [0, 0]]), 2),
                              (torch.tensor([[1, 1, 0]] * 3, dtype=torch.int32), 4),
                              (torch.tensor([[1, 1, -1]] * 3), 3)):
        check(permute(x, topk, num_experts), ref_route(x, topk, num_experts))
    check(permute(x, MAP.to(torch.int32).bool(), 3), ref_route(x, MAP, 3))


def test_top1_indices():
    gen = torch.Generator().manual_seed(2)
    top1 = torch.randint(-1, 4, (10,), generator=gen, dtype=torch.int32)
    x = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    probs = torch.rand(10, generator=gen, dtype=torch.float64)
    got = permute(x, top1, 4, 2, probs=probs)
    assert got[2].shape == (10, 1)
    check(got, ref_route(x, top1, 4, 2, probs), probs)
    for a, b in zip(got, permute(x, top1[:, None], 4, 2, probs=probs[:, None]), strict=True):
        assert torch.equal(a, b)
    y = torch.randn(got[0].shape, generator=gen, dtype=torch.float64)
    want = ref_combine(y, got[2].tolist(), probs[:, None].tolist())
    torch.testing.assert_close(unpermute(y, got[2], probs), want)  # (T,) probs, (T, 1) map


def test_permuted_probs_gradient():
    """permuted_probs is each row's slot probability; its gradient reaches probs at the
    slot's row (0 for dropped slots), in float64 gradcheck too."""
    x, topk, probs = routing_case(3)
    probs.requires_grad_()
    _, _, row_map, permuted = permute(x, topk, 5, 2, probs=probs)
    grad = torch.randn(permuted.shape, dtype=torch.float64)
    permuted.backward(grad)
    want = torch.zeros_like(probs)
    for t, row in enumerate(row_map.tolist()):
        for j, r in enumerate(row):
            if r >= 0:
                want[t, j] = grad[r]
    assert torch.equal(probs.grad, want)
    for options in ({}, {"capacity": 2}, {"capacity": 3, "pad_to_capacity": True},
                    {"num_out_tokens": 7}):
        assert torch.autograd.gradcheck(
            lambda p, o=options: permute(x, topk, 5, probs=p, **o)[3], (probs.detach().clone()
                                                                       .requires_grad_(),))


# --------------------------------------------------------------------------- capacity
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity", [1, 2, 4, 100, 0.5, 1.0, 1.25])
@pytest.mark.parametrize("ties", [False, True])
def test_capacity(policy, capacity, ties):
    x, topk, probs = routing_case(4, ties=ties)
    tokens, k = topk.shape
    count = (capacity if isinstance(capacity, int)
             else math.ceil(Fraction(capacity) * tokens * k / 5))
    for multiple in (1, 3):
        got = permute(x, topk, 5, multiple, probs=probs, capacity=capacity, drop_policy=policy)
        check(got, ref_route(x, topk, 5, multiple, probs, count, policy), probs)
    if count % 3 == 0 or count == 1:
        multiple = 3 if count % 3 == 0 else 1
        got = permute(x, topk, 5, multiple, probs=probs, capacity=capacity, drop_policy=policy,
                      pad_to_capacity=True)
        assert got[0].shape[0] == 5 * count and got[1].tolist() == [count] * 5
        check(got, ref_route(x, topk, 5, multiple, probs, count, policy, pad_to_capacity=True),
              probs)


def test_capacity_ties_keep_the_lower_slot():
    """Equal probabilities: the lower slot t*k + j stays, whatever the slots' order in a
    sort would be; a higher probability beats a lower slot."""
    x = torch.randn(4, 2, dtype=torch.float64)
    topk = torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1]])
    probs = torch.tensor([[0.5, 0.25], [0.25, 0.5], [0.5, 0.75], [0.25, 0.25]],
                         dtype=torch.float64)
    _, _, row_map, _ = permute(x, topk, 2, probs=probs, capacity=2)
    # expert 0: slots (0,0) .5, (1,1) .5, (2,0) .5, (2,1) .75 -> (2,1) then (0,0)
    # expert 1: slots (0,1) .25, (1,0) .25, (3,0) .25, (3,1) .25 -> (0,1), (1,0)
    assert row_map.tolist() == [[0, 2], [3, -1], [-1, 1], [-1, -1]]
    _, _, by_position = permute(x, topk, 2, capacity=2, drop_policy="position")
    assert by_position.tolist() == [[0, 2], [3, 1], [-1, -1], [-1, -1]]


def test_capacity_with_routing_map():
    gen = torch.Generator().manual_seed(5)
    routing_map = torch.rand(12, 4, generator=gen) < 0.6
    x = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    probs = torch.rand(12, 4, generator=gen, dtype=torch.float64)
    for policy in ("probs", "position"):
        got = permute(x, routing_map, 4, probs=probs, capacity=3, drop_policy=policy,
                      pad_to_capacity=True)
        check(got, ref_route(x, routing_map, 4, 1, probs, 3, policy, pad_to_capacity=True), probs)


@pytest.mark.parametrize("capacity", [39, 40, 2**63 - 1, 2**63, 2**70, 3.0, 1e19, 1e300])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_past_the_slots_keeps_every_slot(capacity, policy):
    """Without pad_to_capacity a capacity at or above the T*k = 39 slots, however large (past
    int64, a huge factor), drops nothing: the layout without a capacity, for indices and
    (given as a count) for a routing map."""
    x, topk, probs = routing_case(7)
    got = permute(x, topk, 5, probs=probs, capacity=capacity, drop_policy=policy)
    check(got, ref_route(x, topk, 5, 1, probs), probs)
    if isinstance(capacity, int):
        routing_map = torch.zeros(13, 5, dtype=torch.bool)
        routing_map[topk[:, 0] >= 0, topk[topk[:, 0] >= 0, 0]] = True
        dense = torch.rand(13, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        got = permute(x, routing_map, 5, probs=dense, capacity=capacity, drop_policy=policy)
        check(got, ref_route(x, routing_map, 5, 1, dense), dense)


# --------------------------------------------------------------------------- num_out_tokens
@pytest.mark.parametrize("num_out_tokens", [0, 1, 6, 20, 39])
def test_num_out_tokens(num_out_tokens):
    x, topk, probs = routing_case(6)
    got = permute(x, topk, 5, probs=probs, num_out_tokens=num_out_tokens)
    want = ref_route(x, topk, 5, 1, probs, num_out_tokens=num_out_tokens)
    check(got, want, probs)
    assert got[0].shape[0] == min(num_out_tokens, int((topk >= 0).sum()))
    got = permute(x, topk, 5, probs=probs, num_out_tokens=num_out_tokens, capacity=3)
    check(got, ref_route(x, topk, 5, 1, probs, 3, num_out_tokens=num_out_tokens), probs)


# --------------------------------------------------------------------------- unpermute
def test_unpermute_gathers_dense_probs():
    """Dense (T, E) probs with a (T, k) row map are taken at each slot's expert; the map
    route and the index route of the same choice combine to the same rows."""
    gen = torch.Generator().manual_seed(7)
    topk = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(8)])
    topk[3, 1] = -1
    dense = torch.rand(8, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    x_perm, _, row_map = permute(x, topk, 6)
    y = (x_perm * 2).requires_grad_()
    out = unpermute(y, row_map, dense, topk_indices=topk)
    weights = [[float(dense.detach()[t, e]) if e >= 0 else 0.0 for e in row]
               for t, row in enumerate(topk.tolist())]
    torch.testing.assert_close(out, ref_combine(y.detach(), row_map.tolist(), weights))
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad)
    want = torch.zeros_like(dense)
    for t, row in enumerate(topk.tolist()):
        for j, e in enumerate(row):
            if e >= 0:
                want[t, e] = (grad[t] * y[row_map[t, j]]).sum()
    torch.testing.assert_close(dense.grad, want)
    assert torch.autograd.gradcheck(
        lambda p: unpermute(y.detach(), row_map, p, topk_indices=topk), (dense.detach().clone()
                                                                         .requires_grad_(),))
    # the same choice as a map (a spare column takes the dropped slot, then goes)
    spare = torch.where(topk >= 0, topk, 6)
    routing_map = torch.zeros(8, 7, dtype=torch.bool).scatter_(1, spare, True)[:, :6]
    m_perm, _, m_rows = permute(x, routing_map, 6)
    by_map = unpermute(m_perm * 2, m_rows, dense.detach())
    assert torch.equal(by_map, unpermute(m_perm * 2, m_rows, dense.detach(),
                                         topk_indices=routing_map))
    torch.testing.assert_close(by_map, out.detach(), rtol=1e-12, atol=1e-12)


def test_unpermute_top1_dense_probs():
    top1 = torch.tensor([2, 0, -1, 2])
    x = torch.randn(4, 3, dtype=torch.float64)
    dense = torch.rand(4, 3, dtype=torch.float64)
    x_perm, _, row_map = permute(x, top1, 3)
    out = unpermute(x_perm, row_map, dense, topk_indices=top1)
    want = torch.stack([dense[t, e] * x[t] if e >= 0 else torch.zeros(3, dtype=torch.float64)
                        for t, e in enumerate(top1.tolist())])
    torch.testing.assert_close(out, want)


# --------------------------------------------------------------------------- round trip
@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 10), k=st.integers(1, 4), num_experts=st.integers(1, 5),
       form=st.sampled_from(["indices", "map", "top1"]),
       capacity=st.one_of(st.none(), st.integers(1, 6), st.sampled_from([0.5, 1.0, 1.5])),
       policy=st.sampled_from(["probs", "position"]), pad=st.booleans(),
       num_out_tokens=st.one_of(st.none(), st.integers(0, 12)), seed=st.integers(0, 2**16))
@example(tokens=1, k=3, num_experts=3, form="indices", capacity=None, policy="probs", pad=False,
         num_out_tokens=None, seed=32767)  # [[0, 1, 1]]: k == E and only 0 and 1
def test_round_trip(tokens, k, num_experts, form, capacity, policy, pad, num_out_tokens, seed):
    """permute -> identity -> unpermute is, for every token, the probability-weighted sum of
    its kept slots; the layout, sizes, row map and permuted probs are the reference's."""
    gen = torch.Generator().manual_seed(seed)
    if form == "map":
        routing = torch.rand(tokens, num_experts, generator=gen) < 0.5
        if isinstance(capacity, float):
            capacity = 2
    else:
        routing = torch.randint(-1, num_experts, (tokens, k if form == "indices" else 1),
                                generator=gen)
        routing = routing[:, 0] if form == "top1" else routing
    slots = routing.numel()
    num_out_tokens = None if num_out_tokens is None else min(num_out_tokens, slots)
    probs = torch.rand(routing.shape, generator=gen, dtype=torch.float64)
    x = torch.randn(tokens, 3, generator=gen, dtype=torch.float64)
    count = capacity
    if isinstance(capacity, float):
        count = math.ceil(Fraction(capacity) * tokens * (k if form == "indices" else 1)
                          / num_experts)
    pad = pad and capacity is not None
    if (form == "indices" and k == num_experts >= 3 and tokens > 0
            and bool(((routing == 0) | (routing == 1)).all())):
        # (T, E) integers of only 0 and 1 read as TransformerEngine's int mask: refused
        with pytest.raises(ValueError, match=r"routing map is passed as topk_indices\.bool\(\)"):
            permute(x, routing, num_experts, probs=probs, capacity=capacity,
                    drop_policy=policy, num_out_tokens=num_out_tokens, pad_to_capacity=pad)
        return
    got = permute(x, routing, num_experts, probs=probs, capacity=capacity, drop_policy=policy,
                  num_out_tokens=num_out_tokens, pad_to_capacity=pad)
    want = ref_route(x, routing, num_experts, 1, probs, count, policy, num_out_tokens, pad)
    check(got, want, probs)
    out = unpermute(got[0], got[2], probs)
    weights = probs.reshape(tokens, routing.shape[1] if routing.dim() == 2 else 1).tolist()
    kept_weight = torch.tensor([sum(w for w, r in zip(ws, rs, strict=True) if r >= 0)
                                for ws, rs in zip(weights, want.row_map, strict=True)],
                               dtype=torch.float64)
    torch.testing.assert_close(out, kept_weight[:, None] * x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options, bound", [
    ({"capacity": 2}, 10),
    ({"capacity": 1.25, "drop_policy": "position"}, 39),  # 5 experts of ceil(1.25*13*3/5) = 10
    ({"capacity": 3, "pad_to_capacity": True}, 15),
    ({"num_out_tokens": 17}, 17),
])
def test_compiled_matches_eager(options, bound):
    """Each option traced whole on CPU: the rows are the upper bound (min(T*k, E*capacity,
    num_out_tokens), or E*capacity when padded to it), zero past the data; values and
    gradients as eager's."""
    torch._dynamo.reset()
    x0, topk, p0 = routing_case(8)

    def step(x, probs):
        x_perm, m_splits, row_map, permuted = permute(x, topk, 5, probs=probs, **options)
        return x_perm, m_splits, row_map, permuted, unpermute(x_perm * 3, row_map, probs)

    compiled = torch.compile(step, fullgraph=TRACEABLE, backend="aot_eager")
    results = []
    for fn in (compiled, step):
        x, probs = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        x_perm, m_splits, row_map, permuted, out = fn(x, probs)
        (out.square().sum() + permuted.sum()).backward()
        results.append((x_perm.detach(), permuted.detach(), m_splits, row_map, out.detach(),
                        x.grad, probs.grad))
    (c_perm, c_probs, *c_rest), (e_perm, e_probs, *e_rest) = results
    rows = e_perm.shape[0]
    if TRACEABLE:
        assert c_perm.shape[0] == bound
    assert torch.equal(c_perm[:rows], e_perm) and not c_perm[rows:].any()
    assert torch.equal(c_probs[:rows], e_probs) and not c_probs[rows:].any()
    for a, b in zip(c_rest, e_rest, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- errors
X = torch.zeros(3, 4, requires_grad=True)
TOPK = torch.tensor([[0, 1], [1, 2], [2, -1]])
PROBS = torch.full((3, 2), 0.5, requires_grad=True)
MAP = torch.tensor([[True, False, True], [False, False, True], [True, True, False]])

PERMUTE_ERRORS = [
    ((X, TOPK.float(), 3), {}, TypeError, "topk_indices has dtype torch.float32"),
    ((X, MAP[0], 3), {}, ValueError, r"topk_indices has shape \(3,\): a bool routing map"),
    ((X, MAP[:, :2], 3), {}, ValueError, r"bool routing map of shape \(3, 2\): expected "
                                         r"\(T, num_experts\) = \(3, 3\)"),
    ((X, TOPK[..., None], 3), {}, ValueError, r"topk_indices has shape \(3, 2, 1\)"),
    ((X, TOPK, 3), {"probs": [[0.5] * 2] * 3}, TypeError, "probs is list"),
    ((X, TOPK, 3), {"probs": TOPK}, TypeError, "probs has dtype torch.int64"),
    ((X, TOPK, 3), {"probs": torch.rand(3, 3)}, ValueError, r"probs has shape \(3, 3\) but "
                                                            r"topk_indices has shape \(3, 2\)"),
    ((X, MAP, 3), {"probs": PROBS}, ValueError, r"probs has shape \(3, 2\)"),
    ((X, TOPK, 3), {"probs": PROBS.detach().to("meta")}, ValueError, "probs is on meta"),
    ((X, TOPK, 3), {"num_out_tokens": -1}, ValueError, "num_out_tokens is -1: must be >= 0"),
    ((X, TOPK, 3), {"num_out_tokens": 7}, ValueError, "num_out_tokens is 7: must be <= 6"),
    ((X, MAP, 3), {"num_out_tokens": 10}, ValueError, "num_out_tokens is 10: must be <= 9"),
    ((X, TOPK, 3), {"num_out_tokens": 2.0}, TypeError, "num_out_tokens is 2.0"),
    ((X, TOPK, 3, 2), {"num_out_tokens": 3}, ValueError, "num_out_tokens is 3 with multiple=2"),
    ((X, TOPK, 3), {"capacity": 0, "probs": PROBS}, ValueError, "capacity is 0: must be >= 1"),
    ((X, TOPK, 3), {"capacity": -2, "probs": PROBS}, ValueError, "capacity is -2"),
    ((X, TOPK, 3), {"capacity": 0.0, "probs": PROBS}, ValueError, "capacity is 0.0: a capacity "
                                                                  "factor must be"),
    ((X, TOPK, 3), {"capacity": float("nan"), "probs": PROBS}, ValueError, "capacity is nan"),
    ((X, TOPK, 3), {"capacity": float("inf"), "probs": PROBS}, ValueError, "capacity is inf"),
    ((X, TOPK, 3), {"capacity": "2", "probs": PROBS}, TypeError, "capacity is '2'"),
    ((X, TOPK, 3), {"capacity": True, "probs": PROBS}, TypeError, "capacity is True"),
    ((X, MAP, 3), {"capacity": 1.0}, ValueError, "capacity is 1.0, a capacity factor, but "
                                                 "topk_indices is a routing map"),
    ((X, TOPK, 3), {"drop_policy": "random"}, ValueError, "drop_policy is 'random'"),
    ((X, TOPK, 3), {"drop_policy": None}, TypeError, "drop_policy is None"),
    ((X, TOPK, 3), {"capacity": 1}, ValueError, "drop_policy is 'probs' but probs is None"),
    ((X, TOPK, 3), {"pad_to_capacity": 1}, TypeError, "pad_to_capacity is 1 of type int"),
    ((X, TOPK, 3), {"pad_to_capacity": True}, ValueError,
     "pad_to_capacity is True but capacity is None"),
    ((X, TOPK, 3, 2), {"capacity": 3, "drop_policy": "position", "pad_to_capacity": True},
     ValueError, "multiple is 2 but capacity is 3"),
    ((X, TOPK, 3), {"capacity": 2**62, "drop_policy": "position", "pad_to_capacity": True},
     ValueError, f"capacity is {2**62}: 3 groups"),
    ((X, TOPK, 3), {"capacity": 2**70, "drop_policy": "position", "pad_to_capacity": True},
     ValueError, f"capacity is {2**70}: 3 groups"),
    ((X, MAP, 3), {"capacity": 2**63, "drop_policy": "position", "pad_to_capacity": True},
     ValueError, f"capacity is {2**63}: 3 groups"),
    ((X, TOPK, 3), {"capacity": 1e19, "probs": PROBS, "pad_to_capacity": True}, ValueError,
     r"capacity is 1e\+19, a capacity factor of 20000000000000000000 rows per expert: 3 groups"),
    ((X, TOPK, 3), {"capacity": 1e300, "drop_policy": "position", "pad_to_capacity": True},
     ValueError, r"capacity is 1e\+300, a capacity factor of \d+ rows per expert"),
    ((X, MAP, 3), {"capacity": 1e19, "drop_policy": "position"}, ValueError,
     r"capacity is 1e\+19, a capacity factor, but topk_indices is a routing map"),
    ((X, TOPK + 1, 3), {"capacity": 1, "drop_policy": "position"}, ValueError,
     r"topk_indices\[1, 1\] is 3: expert indices must be in \[-1, 2\]"),
    ((X, MAP.to(torch.int32), 3), {}, ValueError, r"topk_indices is a torch.int32 tensor of "
     r"shape \(3, 3\) = \(T, num_experts\) holding only 0 and 1: .* passed as "
     r"topk_indices.bool\(\)"),
    ((X, torch.ones(3, 3, dtype=torch.uint8), 3), {"probs": torch.rand(3, 3)}, ValueError,
     r"topk_indices is a torch.uint8 tensor of shape \(3, 3\)"),
]


@pytest.mark.parametrize("args, kwargs, exc, match", PERMUTE_ERRORS)
def test_permute_errors(args, kwargs, exc, match):
    """Each bad argument is named with its value, and the rejected call leaves its inputs
    (values and gradients) as they were."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    before = [t.detach().clone() if t.device.type != "meta" else None for t in tensors]
    with pytest.raises(exc, match=match):
        permute(*args, **kwargs)
    for t, copy in zip(tensors, before, strict=True):
        assert t.grad is None and (copy is None or torch.equal(t, copy))


Y = torch.zeros(5, 4)
ROW_MAP = torch.tensor([[0, 3], [1, -1], [4, 2]])

UNPERMUTE_ERRORS = [
    ((Y, ROW_MAP, torch.rand(3, 4)), {}, ValueError,
     r"probs has shape \(3, 4\) but row_map has shape \(3, 2\).*need topk_indices"),
    ((Y, ROW_MAP, torch.rand(3, 4)), {"topk_indices": TOPK.float()}, TypeError,
     "topk_indices has dtype torch.float32"),
    ((Y, ROW_MAP, torch.rand(3, 4)), {"topk_indices": TOPK.tolist()}, TypeError,
     "topk_indices is list"),
    ((Y, ROW_MAP, torch.rand(3, 4)), {"topk_indices": TOPK[:, 0]}, ValueError,
     r"topk_indices has shape \(3,\) but row_map has shape \(3, 2\)"),
    ((Y, ROW_MAP, torch.rand(3, 4)), {"topk_indices": TOPK[:2]}, ValueError,
     "topk_indices has 2 rows but row_map has 3"),
    ((Y, ROW_MAP, torch.rand(3)), {"topk_indices": TOPK}, ValueError,
     r"probs has shape \(3,\): with topk_indices, expected dense"),
    ((Y, ROW_MAP, torch.rand(3, 2)), {"topk_indices": TOPK}, ValueError,
     r"topk_indices\[1, 1\] is 2: expert indices must be in \[-1, 1\]"),
    ((Y, ROW_MAP[:, :1].clone(), torch.rand(3, 3)), {"topk_indices": MAP[:, :1]}, ValueError,
     r"probs has shape \(3, 3\) but the routing map topk_indices has shape \(3, 1\)"),
    ((Y, ROW_MAP, torch.rand(2)), {}, ValueError, r"probs has shape \(2,\)"),
    ((Y, torch.tensor([[0, -1, 1], [2, -1, -1], [3, 4, -1]]), torch.rand(3, 3)),
     {"topk_indices": MAP.to(torch.int32)}, ValueError,
     r"topk_indices is a torch.int32 tensor of shape \(3, 3\) = \(T, num_experts\) holding "
     r"only 0 and 1"),
]


@pytest.mark.parametrize("args, kwargs, exc, match", UNPERMUTE_ERRORS)
def test_unpermute_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        unpermute(*args, **kwargs)
