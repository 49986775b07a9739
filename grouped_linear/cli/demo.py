"""``python -m grouped_linear demo``: train a small MoE language model end to end.

The data come from a random sparse second-order Markov chain over a small
vocabulary: the next token depends on the two before it and has only a few
possible values. A model that sees one token at a time cannot do better than
the first-order entropy; one that mixes in the previous token can reach the
chain's entropy rate (the loss floor printed at the end), far below
``log(vocab)``.

The model is ``embedding -> previous-token mixing -> router (top-k softmax)
-> gl.permute -> gl.GroupedMLP (SwiGLU) -> gl.unpermute -> residual -> head``.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import grouped_linear as gl

from .timing import progress

__all__ = ["DemoConfig", "MarkovChain", "TinyMoELM", "run_demo", "resolve_device"]


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the synthetic task, the model and the optimizer."""

    vocab: int = 32
    successors: int = 3
    seq_len: int = 64
    batch: int = 32
    d_model: int = 64
    ffn_hidden: int = 128
    num_experts: int = 8
    top_k: int = 2
    lr: float = 3e-3
    aux_loss_coef: float = 1e-2
    eval_batch: int = 128


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; ``"cuda"`` without a GPU raises."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} is not one of 'auto', 'cpu', 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for but CUDA is not available")
    return dev


# --------------------------------------------------------------------------- data
class MarkovChain:
    """A random sparse second-order Markov chain over ``vocab`` tokens.

    Each context ``(a, b)`` of the two latest tokens allows ``successors``
    distinct next tokens with random (Dirichlet) probabilities; all other
    tokens have probability zero.
    """

    def __init__(self, vocab: int, successors: int, generator: torch.Generator) -> None:
        self.vocab = vocab
        contexts = vocab * vocab
        scores = torch.rand(contexts, vocab, generator=generator)
        allowed = scores.topk(successors, dim=1).indices
        # Dirichlet(1, ..., 1) weights, drawn from the seeded generator.
        gamma = -torch.log(torch.rand(contexts, successors, generator=generator))
        weights = gamma / gamma.sum(1, keepdim=True)
        self.probs = torch.zeros(contexts, vocab, dtype=torch.float64)
        self.probs.scatter_(1, allowed, weights.to(torch.float64))

    def sample(self, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """``(batch, seq_len)`` int64 token sequences; the first two tokens are uniform."""
        tokens = torch.empty(batch, seq_len, dtype=torch.int64)
        tokens[:, :2] = torch.randint(self.vocab, (batch, 2), generator=generator)
        for t in range(2, seq_len):
            context = tokens[:, t - 2] * self.vocab + tokens[:, t - 1]
            tokens[:, t] = torch.multinomial(self.probs[context], 1, generator=generator)[:, 0]
        return tokens

    def nll(self, tokens: torch.Tensor) -> float:
        """Mean ``-log p(token | two before)`` under the true chain: the loss floor on ``tokens``."""
        tokens = tokens.cpu()
        context = tokens[:, :-2] * self.vocab + tokens[:, 1:-1]
        p = self.probs[context.reshape(-1), tokens[:, 2:].reshape(-1)]
        return float(-torch.log(p).mean())


# --------------------------------------------------------------------------- model
class TinyMoELM(nn.Module):
    """A one-layer Mixture-of-Experts language model built on :class:`gl.GroupedMLP`."""

    def __init__(self, cfg: DemoConfig, device: torch.device) -> None:
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, d, device=device)
        # Cheap context mixing: each position sees its own and the previous token.
        self.mix = nn.Linear(2 * d, d, device=device)
        self.norm = nn.LayerNorm(d, device=device)
        # Router -> permute -> (dispatch to the expert-parallel ranks) -> GroupedMLP -> back.
        self.moe = gl.ExpertParallelMoE(d, cfg.ffn_hidden, cfg.num_experts, cfg.top_k,
                                        activation="swiglu", bias=True, device=device)
        self.out_norm = nn.LayerNorm(d, device=device)
        self.head = nn.Linear(d, cfg.vocab, device=device)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(logits (B, L, V), load-balancing loss, tokens per expert (E,))``."""
        cfg = self.cfg
        batch, seq_len = tokens.shape
        emb = self.embed(tokens)
        prev = F.pad(emb[:, :-1], (0, 0, 1, 0))
        h = self.mix(torch.cat([emb, prev], dim=-1)).reshape(batch * seq_len, cfg.d_model)

        moe, router_probs, m_splits = self.moe.forward_routed(self.norm(h))

        # Switch-Transformer load balancing: E * sum_e (token fraction_e * mean prob_e).
        fraction = m_splits.to(router_probs.dtype) / (batch * seq_len * cfg.top_k)
        aux = cfg.num_experts * (fraction * router_probs.mean(dim=0)).sum()

        out = h + moe.to(h.dtype)
        logits = self.head(self.out_norm(out)).view(batch, seq_len, cfg.vocab)
        return logits, aux, m_splits


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting token ``t`` from positions ``< t``, for ``t >= 2``."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, 1:-1].reshape(-1, vocab).float(), tokens[:, 2:].reshape(-1))


# --------------------------------------------------------------------------- training
def run_demo(
    steps: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    quiet: bool = False,
    config: DemoConfig | None = None,
    ep: int = 1,
) -> dict:
    """Train the demo model and return its losses.

    Args:
        steps: optimizer steps (default: 400 on CPU, 1000 on CUDA).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        seed: seeds the chain, the data and the model: same seed, same run.
        quiet: print nothing (no progress bar, no summary).
        config: sizes; :class:`DemoConfig` defaults when ``None``.
        ep: expert-parallel processes; above 1 the demo spawns that many CPU
            processes (gloo), each holding ``num_experts / ep`` experts and its
            own data, and reports rank 0's losses.

    Returns:
        A dict with ``initial_loss`` and ``final_loss`` (cross-entropy in nats
        on a fixed held-out batch before and after training), ``floor`` (the
        true chain's loss on that batch), ``uniform`` (``log(vocab)``),
        ``steps``, ``seconds``, ``device`` and ``expert_load`` (fraction of
        routed tokens per expert on the held-out batch after training).
    """
    if ep > 1:
        return _run_expert_parallel(ep, steps, device, seed, quiet, config)
    return _train(steps, device, seed, quiet, config)


def _run_expert_parallel(ep, steps, device, seed, quiet, config) -> dict:
    if resolve_device(device).type != "cpu":
        raise ValueError("the expert-parallel demo runs CPU processes over gloo: use --device cpu")
    cfg = config or DemoConfig()
    if cfg.num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={cfg.num_experts}")
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ep_worker, args=(ep, port, results, steps, seed, quiet, cfg), nprocs=ep, join=True)
    return results.get()


def _ep_worker(rank, ep, port, results, steps, seed, quiet, cfg) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ep)
    try:
        result = _train(steps, "cpu", seed, quiet or rank > 0, cfg, rank=rank, world=ep)
        if rank == 0:
            results.put(result)
        dist.barrier()  # no rank tears its process group down while another still talks
    finally:
        dist.destroy_process_group()


def _average_gradients(model: TinyMoELM, world: int) -> None:
    """Replicated parameters: mean over ranks. Local experts already hold the sum of every
    rank's contribution (through the all-to-all), so they are divided by the ranks."""
    expert_params = {id(p) for p in model.moe.experts.parameters()}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in expert_params:
            dist.all_reduce(p.grad)
        p.grad.div_(world)


def _train(steps, device, seed, quiet, config, rank: int = 0, world: int = 1) -> dict:
    cfg = config or DemoConfig()
    dev = resolve_device(device)
    if steps is None:
        steps = 1000 if dev.type == "cuda" else 400
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")

    start = time.perf_counter()
    torch.manual_seed(seed)
    chain_gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1 + 7919 * rank)  # each rank its own data
    eval_gen = torch.Generator().manual_seed(seed + 2)
    chain = MarkovChain(cfg.vocab, cfg.successors, chain_gen)
    eval_tokens = chain.sample(cfg.eval_batch, cfg.seq_len, eval_gen).to(dev)
    floor = chain.nll(eval_tokens)

    model = TinyMoELM(cfg, dev)
    if world > 1:  # replicated layers start equal; each rank's experts are its own
        torch.manual_seed(seed + 1000 + rank)
        model.moe.experts.fc1.reset_parameters()
        model.moe.experts.fc2.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    use_bf16 = dev.type == "cuda"

    def autocast():
        return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_bf16)

    @torch.no_grad()
    def evaluate() -> tuple[float, torch.Tensor]:
        model.eval()
        with autocast():
            logits, _, m_splits = model(eval_tokens)
        model.train()
        load = m_splits.float() / m_splits.sum().clamp(min=1)
        return float(_next_token_loss(logits, eval_tokens)), load.cpu()

    initial_loss, _ = evaluate()
    bar = progress(steps, desc=f"demo ({dev.type})", disable=quiet)
    running = None
    for step in range(steps):
        tokens = chain.sample(cfg.batch, cfg.seq_len, data_gen).to(dev, non_blocking=True)
        with autocast():
            logits, aux, _ = model(tokens)
            loss = _next_token_loss(logits, tokens)
        optimizer.zero_grad(set_to_none=True)
        (loss + cfg.aux_loss_coef * aux).backward()
        if world > 1:
            _average_gradients(model, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 10 == 0 or step == steps - 1:
            value = float(loss.detach())  # a host sync: only every few steps
            running = value if running is None else 0.7 * running + 0.3 * value
            bar.set_postfix_str(f"loss {running:.3f}")
        bar.update(1)
    bar.close()
    final_loss, load = evaluate()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start

    result = {
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        "floor": floor,
        "uniform": math.log(cfg.vocab),
        "steps": steps,
        "seconds": seconds,
        "device": str(dev) if world == 1 else f"{world} CPU processes (expert parallel)",
        "expert_load": [round(float(v), 4) for v in load],
        "config": asdict(cfg),
    }
    if not quiet:
        _print_summary(result)
    return result


def _print_summary(result: dict) -> None:
    cfg = result["config"]
    load = result["expert_load"]
    print(
        f"MoE LM: vocab {cfg['vocab']}, d_model {cfg['d_model']}, {cfg['num_experts']} experts "
        f"(top-{cfg['top_k']}, SwiGLU, ffn {cfg['ffn_hidden']}), {result['steps']} steps "
        f"of {cfg['batch']}x{cfg['seq_len']} tokens on {result['device']}"
    )
    print(f"  initial loss  {result['initial_loss']:.3f} nats   (uniform guess log V = "
          f"{result['uniform']:.3f})")
    print(f"  final loss    {result['final_loss']:.3f} nats")
    print(f"  floor         {result['floor']:.3f} nats   (entropy of the chain on the eval batch)")
    print(f"  expert load   min {min(load):.1%}  max {max(load):.1%} of routed tokens")
    print(f"  wall time     {result['seconds']:.1f} s")
