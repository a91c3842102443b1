"""Scoring continuations: each one's log-probability after its context, and whether greedy decoding
would produce it. A shared context runs through the blocks once, its keys and values reused by every
ending; truncation is the harness ``hf`` model's."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpt_lightning.model import GPT, Block, in_window, windowed_attention


def score_continuations(
    model: GPT,
    requests: list[tuple[list[int], list[int]]],
    batch_size: int,
    device: torch.device,
    on_batch: Callable[[list[int], list[tuple[float, bool]]], None] | None = None,
) -> list[tuple[float, bool]]:
    """(summed log-probability, greedy) of each (context tokens, continuation tokens) request,
    ``batch_size`` endings a forward pass; ``on_batch(indices, answers)`` after each batch."""
    groups = _groups(requests, model.config.block_size)
    # Longest first, as the harness orders them: similar lengths share a batch and pad little.
    order = sorted(groups, key=lambda ctx: (-len(ctx) - max(len(requests[i][1]) for i in groups[ctx]), ctx))
    answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    batch: list[tuple[tuple[int, ...], list[int]]] = []
    for context in order:
        members = groups[context]
        for start in range(0, len(members), batch_size):
            piece = members[start : start + batch_size]
            if batch and sum(len(m) for _, m in batch) + len(piece) > batch_size:
                _score_batch(model, batch, requests, answers, device, on_batch)
                batch = []
            batch.append((context, piece))
    if batch:
        _score_batch(model, batch, requests, answers, device, on_batch)
    return answers


def _groups(requests: list[tuple[list[int], list[int]]], block_size: int) -> dict[tuple[int, ...], list[int]]:
    """Each context as the model sees it (truncated from the left) -> the indices of its requests."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (context, continuation) in enumerate(requests):
        if not context or not 0 < len(continuation) <= block_size:
            raise ValueError(f"request {index}: needs a context and a continuation of 1..{block_size} tokens.")
        whole = (context + continuation)[-(block_size + 1) :]
        groups.setdefault(tuple(whole[: -len(continuation)]), []).append(index)
    return groups


def _score_batch(model, batch, requests, answers, device, on_batch=None) -> None:
    """Score the requests of ``batch``, (context, request indices) pairs, into ``answers``."""
    block_size = model.config.block_size
    pad = 0  # padding token: read by nothing that is scored
    contexts = [list(context) for context, _ in batch]
    lengths = torch.tensor([len(c) for c in contexts], device=device)  # (G,)
    width = max(len(c) for c in contexts)
    ctx = torch.tensor([c + [pad] * (width - len(c)) for c in contexts], device=device)  # (G, P)
    x, kv = model.embed(ctx, torch.arange(width, device=device)), []  # (G, P, C)
    x = _trunk(model, x, ctx, torch.arange(width, device=device), None, None, kv)  # (G, P, C)
    last = x[torch.arange(len(contexts), device=device), lengths - 1]  # (G, C): predicts each first token

    # The endings: every continuation token but the last, on top of its context.
    rows = [
        (g, requests[i][1][:-1]) for g, (_, members) in enumerate(batch) for i in members if len(requests[i][1]) > 1
    ]
    hidden = last
    if rows:
        length = max(len(tokens) for _, tokens in rows)
        owner = torch.tensor([g for g, _ in rows], device=device)  # (R,)
        ends = torch.tensor([t + [pad] * (length - len(t)) for _, t in rows], device=device)  # (R, T)
        pos = (lengths[owner, None] + torch.arange(length, device=device)).clamp(max=block_size - 1)  # (R, T)
        to_context = (torch.arange(width, device=device) < lengths[owner, None])[:, None, :]  # (R, 1, P)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # (T, T)
        visible = torch.cat((to_context.expand(-1, length, -1), causal.expand(len(rows), -1, -1)), dim=2)[:, None]
        y = model.embed(ends, pos)  # (R, T, C)
        prefix = [(k.index_select(0, owner), v.index_select(0, owner)) for k, v in kv]
        y = _trunk(model, y, ends, pos, prefix, visible, [])  # (R, T, C)
        hidden = torch.cat((last, y.reshape(-1, y.size(-1))))  # (G + R*T, C)

    # Each request's scored positions in `hidden`, and the tokens they predict.
    where, targets, counts, row = [], [], [], 0
    for g, (_, members) in enumerate(batch):
        for i in members:
            continuation = requests[i][1]
            where.append(g)
            if len(continuation) > 1:
                first = len(batch) + row * length
                where.extend(range(first, first + len(continuation) - 1))
                row += 1
            targets.extend(continuation)
            counts.append(len(continuation))
    logits = model.logits(hidden[torch.tensor(where, device=device)])  # (N, V)
    targets = torch.tensor(targets, device=device)  # (N,)
    logprobs = F.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)  # (N,)
    greedy = logits.argmax(dim=-1) == targets  # (N,)
    members = [i for _, m in batch for i in m]
    for i, lp, ok in zip(members, logprobs.split(counts), greedy.split(counts)):
        answers[i] = (float(lp.sum()), bool(ok.all()))
    if on_batch is not None:
        on_batch(members, answers)


def _trunk(
    model: GPT, x: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, prefix, visible, kv: list
) -> torch.Tensor:
    """The blocks on ``x`` (B, T, C) as ``_block`` runs them (``prefix``: a (keys, values) per block, or
    None), with the switches between them (``GPT.trunk``); each block's keys and values appended to ``kv``."""

    def run(i: int, x: torch.Tensor) -> torch.Tensor:
        x, keys_values = _block(model.transformer.h[i], x, idx, pos, None if prefix is None else prefix[i], visible)
        kv.append(keys_values)
        return x

    return model.trunk(x, run)


def _block(block: Block, x: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, prefix, visible):
    """``block`` on ``x`` (B, T, C), also returning its keys and values (B, nh, T, hs): causal
    attention within ``x``, or, with ``prefix`` (keys, values of a context, (B, nh, P, hs)), over
    the context and ``x`` as ``visible`` (B, 1, T, P + T) allows."""
    B, T, C = x.shape
    window = block.attn.window  # None: the whole causal context
    q, k, v = block.attn.heads(block.ln_1(x), idx, pos)  # 3 x (B, nh, T, hs)
    if prefix is None and window is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
    elif prefix is None:
        y = windowed_attention(q, k, v, window, 0.0)  # (B, nh, T, hs)
    else:
        keys, values = torch.cat((prefix[0], k), dim=2), torch.cat((prefix[1], v), dim=2)  # (B, nh, P + T, hs)
        if window is not None:  # a windowed block: only the keys at most `window` positions back
            context = torch.arange(prefix[0].size(2), device=x.device).expand(B, -1)  # (B, P)
            key_pos = torch.cat((context, pos), dim=1)  # (B, P + T): the context's positions, then the ending's
            visible = visible & in_window(pos[:, :, None], key_pos[:, None, :], window)[:, None]  # (B, 1, T, P + T)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)  # (B, nh, T, hs)
    x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))  # heads side by side
    return x + block.mlp(block.ln_2(x)), (k, v)
