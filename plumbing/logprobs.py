"""How the scoring rule's log-probs are computed fast (a learner may skip): padding, one prefill
per prompt whose KV cache its K responses share, and each distinct response scored once.

``tba.group_token_logprobs`` is the rule (which tokens, what temperature, fp32 log-softmax);
this module hands it the logits that predict each response token, computed as cheaply as the
rule allows, and the transformers engine (engines.HFEngine) decodes from the same prefill.
Equal to one forward per prompt + response up to float rounding, gradients included
(test_tba.py and tests/test_trainer.py compare them).
"""

from __future__ import annotations

import torch


def pad(
    rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu", left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (B, W) of token rows padded on the right, or on the
    left so that every row ends at the last column (where generation, or a response, goes on).
    With left padding, pass ``positions(mask)`` as ``position_ids``."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.long)
        mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count a left-padded row's real tokens from 0, as without padding."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def pad_sequences(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt + response rows: ``input_ids``, ``attention_mask`` and
    ``response_mask`` (B, L), the last 1 on response tokens only."""
    ids, attn = pad(
        [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)], pad_id, device
    )
    columns = torch.arange(ids.shape[1], device=ids.device)
    starts = torch.tensor([len(p) for p in prompts], device=ids.device)
    return ids, attn, attn * (columns[None] >= starts[:, None])


def prefill(
    model: torch.nn.Module,
    prompts: list[list[int]],
    repeat: int,
    pad_id: int,
    device: torch.device | str = "cpu",
):
    """Run each prompt once and repeat its KV cache ``repeat`` times, for the ``repeat``
    responses that follow it (rows i * repeat .. of prompt i). Returns the logits at the last
    prompt position (B repeat, V), which predict each response's first token, the cache, and
    the prompts' left-padded attention mask (B repeat, W). Generation (engines.HFEngine) and
    scoring (``response_logits``) both start here, so a prompt longer than its answers is
    computed once, not K times."""
    from transformers import DynamicCache

    ids, attn = pad(prompts, pad_id, device, left=True)
    cache = DynamicCache(config=model.config)
    last = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=positions(attn),
        past_key_values=cache,
        use_cache=True,
    ).logits[:, -1]
    cache.batch_repeat_interleave(repeat)
    return last.repeat_interleave(repeat, 0), cache, attn.repeat_interleave(repeat, 0)


def distinct_responses(
    responses: list[list[list[int]]],
) -> tuple[list[list[list[int]]], torch.Tensor | None]:
    """Each group's distinct responses in order of first appearance, padded with its first to
    the largest count D over the groups (rectangular, for ``prefill``), and the rows of the
    (P D)-row result that hold the P K ``responses`` in order; None when no group repeats a
    response (the result is already in order). A group drawn with replacement from fewer than
    K stored responses, or a sampler that repeats itself (a peaked policy on short answers),
    repeats responses: each is scored once and its row copied, the same values and the same
    gradient, which flows back through each copy."""
    distinct = []
    slots = []  # of each response, its index among its group's distinct ones
    for group in responses:
        where: dict[tuple[int, ...], int] = {}
        kept = []
        for response in group:
            key = tuple(response)
            if key not in where:
                where[key] = len(kept)
                kept.append(response)
            slots.append(where[key])
        distinct.append(kept)
    width = max(len(kept) for kept in distinct)
    size = len(responses[0])
    if width == size:
        return responses, None
    padded = [kept + kept[:1] * (width - len(kept)) for kept in distinct]
    rows = [i * width + slots[i * size + k] for i in range(len(responses)) for k in range(size)]
    return padded, torch.tensor(rows)


def response_logits(
    model: torch.nn.Module,
    prompts: list[list[int]],
    targets: list[list[int]],
    pad_id: int,
    share_prompt: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict each token of ``targets`` (B = P R rows, prompt-major: R rows
    follow each of the P ``prompts``): logits (B, L, V), the targets right-padded (B, L) and
    their mask (B, L), L the longest row.

    ``share_prompt``: each prompt runs once and its KV cache is repeated for its R rows
    (``prefill``), instead of R forwards of prompt + response: faster where prompts are longer
    than answers (OPERATIONS.md has the figure). Turn it off under gradient checkpointing,
    which drops the cache.
    """
    repeat = len(targets) // len(prompts)
    ids, mask = pad(targets, pad_id, device)
    if not share_prompt:
        rows = [p for p in prompts for _ in range(repeat)]
        full, attn, _ = pad_sequences(rows, targets, pad_id, device)
        logits = model(input_ids=full, attention_mask=attn).logits
        starts = torch.tensor([len(p) - 1 for p in rows], device=logits.device)
        columns = starts[:, None] + torch.arange(mask.shape[1], device=logits.device)
        columns = columns.clamp(max=logits.shape[1] - 1)  # column c predicts token c + 1
        index = columns[:, :, None].expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index), ids, mask
    first, cache, attn = prefill(model, prompts, repeat, pad_id, device)
    logits = model(
        input_ids=ids,
        attention_mask=torch.cat([attn, mask], dim=1),
        position_ids=attn.sum(1, keepdim=True) + torch.arange(mask.shape[1], device=mask.device),
        past_key_values=cache,
        use_cache=True,
    ).logits[:, :-1]
    return torch.cat([first[:, None], logits], dim=1), ids, mask


def group_passes(num_groups: int, group_size: int, micro_batch_size: int) -> list[slice]:
    """The forward passes over ``num_groups`` prompt groups of ``group_size`` sequences each:
    ``micro_batch_size`` sequences a pass, rounded down to whole groups (at least one group; the
    trainer's log Z and the shared prompt prefill are per group), or all in one pass when 0."""
    per_pass = max(1, micro_batch_size // group_size) if micro_batch_size else num_groups
    return [slice(i, min(i + per_pass, num_groups)) for i in range(0, num_groups, per_pass)]
