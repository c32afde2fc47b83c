"""Sequence packing into token-bounded micro-batches, balanced across trainer ranks.

A sample is one document: token ids, a loss mask over its tokens, and optional per-token float
fields (RL: advantages, inference logprobs). A micro-batch concatenates documents into one row of
at most ``micro_batch_tokens`` tokens; position ids restart at 0 for each document, which is how
the attention keeps documents apart. Targets are shifted inside each document: position t
predicts token t+1 of the same document, and every per-token field is shifted the same way, so
``loss_mask[t]`` says whether the *target* token is trained.

Legend (docs/conventions.md; local letter of this file: P packed tokens, the length of a micro-batch's one
row, which the trainer calls T once the row is its batch, ``input_ids_BT`` with B = 1): S documents, T tokens
of a document row (``RowLayout``: the longest document), D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prime_spmd.data.sample import Sample
from prime_spmd.models.vision import VisionInputs


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    input_ids: torch.Tensor
    """[1, P] int64"""
    position_ids: torch.Tensor
    """[1, P] int64, restarting at 0 per document"""
    targets: torch.Tensor
    """[P] int64: the next token of the same document (0 where there is none)"""
    loss_mask: torch.Tensor
    """[P] bool: the target at this position is trained"""
    fields: dict[str, torch.Tensor]
    """[P] float32 each, aligned with targets"""
    num_docs: int
    vision: list[tuple[int, VisionInputs]] = field(default_factory=list)
    """(document index in the row, its images) of the documents with images (vision-language models)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            targets=self.targets.to(device),
            loss_mask=self.loss_mask.to(device),
            fields={k: v.to(device) for k, v in self.fields.items()},
            num_docs=self.num_docs,
            vision=[(d, v.to(device)) for d, v in self.vision],
        )


def _collate(docs: list[Sample], field_names: list[str]) -> MicroBatch:
    ids, pos, tgt, mask = [], [], [], []
    fields: dict[str, list[float]] = {k: [] for k in field_names}
    vision = []
    for i, d in enumerate(docs):
        n = len(d.input_ids)
        ids += d.input_ids
        pos += list(range(n))
        tgt += d.input_ids[1:] + [0]
        trained = [bool(m) for m in d.loss_mask[1:]] + [False]
        if d.vision is not None:  # the images' tokens are inputs, never targets
            vision.append((i, d.vision.without_images()))
            takes_image = d.vision.image_token_mask(torch.tensor(d.input_ids)).tolist()
            trained = [m and not f for m, f in zip(trained, takes_image[1:] + [False])]
        mask += trained
        for k in field_names:
            vals = d.fields[k]
            fields[k] += list(vals[1:]) + [0.0]
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        fields={k: torch.tensor(v, dtype=torch.float32) for k, v in fields.items()},
        num_docs=len(docs),
        vision=vision,
    )


def dummy_microbatch(field_names: list[str]) -> MicroBatch:
    """A one-token micro-batch with nothing trained: keeps FSDP collectives in step on a rank with no data."""
    return _collate(
        [Sample(input_ids=[0, 0], loss_mask=[0, 0], fields={k: [0.0, 0.0] for k in field_names})], field_names
    )


def first_fit(sizes: list[int], capacity: int, sizes2: list[int] | None = None, capacity2: int = 0) -> list[list[int]]:
    """First fit, in the given order, of items of ``sizes`` into bins of ``capacity`` (an item larger than it
    gets a bin of its own): the item indices of each bin, bins in opening order. With ``sizes2`` a bin also
    holds at most ``capacity2`` of those (a second measure of the same items)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    loads2: list[int] = []
    for i, n in enumerate(sizes):
        n2 = sizes2[i] if sizes2 is not None else 0
        ok = (
            b for b in range(len(bins)) if loads[b] + n <= capacity and (sizes2 is None or loads2[b] + n2 <= capacity2)
        )
        b = next(ok, None)
        if b is None:
            bins.append([])
            loads.append(0)
            loads2.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += n
        loads2[b] += n2
    return bins


def pack(
    samples: list[Sample], micro_batch_tokens: int, num_ranks: int, share_prompts: bool = False
) -> list[list[MicroBatch]]:
    """Pack samples into micro-batches and deal them to ``num_ranks`` ranks.

    First-fit decreasing by size into bins of ``micro_batch_tokens``, of units that keep a share group
    (samples with the same tokens before their first trained token: a GRPO group's prompt) in one
    micro-batch, so that the trainer can forward its prompt once (``ShareLayout``); a group longer than a
    bin is cut into bin-sized units. ``share_prompts`` (the trainer forwards shared prompts once): a unit
    costs the tokens the model runs, its group's prompt counted once, so a bin holds up to
    ``micro_batch_tokens`` of those and at most twice that many packed tokens (what an unshared forward of
    the row would run, should the row not share). Bins go to the rank with the fewest tokens so far; ranks
    with fewer bins get dummy micro-batches so every rank runs the same number of forward/backward passes.
    Deterministic for a given input order.
    """
    field_names = sorted(samples[0].fields) if samples else []
    for i, s in enumerate(samples):
        if len(s.input_ids) > micro_batch_tokens:
            raise ValueError(
                f"sample {i} has {len(s.input_ids)} tokens, more than --trainer.micro_batch_tokens={micro_batch_tokens}"
            )
        if len(s.loss_mask) != len(s.input_ids) or any(len(v) != len(s.input_ids) for v in s.fields.values()):
            raise ValueError(f"sample {i}: loss_mask/fields length differs from input_ids ({len(s.input_ids)})")
        if sorted(s.fields) != field_names:
            raise ValueError(f"sample {i}: fields {sorted(s.fields)} differ from the first sample's {field_names}")
    units = list(_share_units(samples, micro_batch_tokens, share_prompts))
    packed = [sum(len(samples[i].input_ids) for i in u) for u in units]
    if share_prompts:
        cost = [_unit_cost(samples, u, True) for u in units]
        unit_bins = first_fit(cost, micro_batch_tokens, packed, 2 * micro_batch_tokens)
    else:
        unit_bins = first_fit(packed, micro_batch_tokens)
    bins = [[i for u in ub for i in units[u]] for ub in unit_bins]
    loads = [sum(len(samples[i].input_ids) for i in b) for b in bins]
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_tokens = [0] * num_ranks
    for b in sorted(range(len(bins)), key=lambda b: (-loads[b], b)):
        r = min(range(num_ranks), key=lambda r: (rank_tokens[r], len(per_rank[r]), r))
        per_rank[r].append(b)
        rank_tokens[r] += loads[b]
    depth = max(1, max(len(p) for p in per_rank))
    out = []
    for r in range(num_ranks):
        mbs = [_collate([samples[i] for i in sorted(bins[b])], field_names) for b in per_rank[r]]
        mbs += [dummy_microbatch(field_names) for _ in range(depth - len(mbs))]
        out.append(mbs)
    return out


def _prompt_len(s: Sample) -> int | None:
    """Tokens before the first trained one (a share group's key), or None when nothing is trained."""
    return next((t for t, m in enumerate(s.loss_mask) if m), None)


def _unit_cost(samples: list[Sample], unit: list[int], shared: bool) -> int:
    """Tokens a unit puts through the model: all of them, or with ``shared`` its group's prompt once."""
    total = sum(len(samples[i].input_ids) for i in unit)
    f = _prompt_len(samples[unit[0]])
    return total - (len(unit) - 1) * f if shared and f is not None else total


def _share_units(samples: list[Sample], capacity: int, shared: bool = False) -> list[list[int]]:
    """Sample indices in packing units, costliest unit first: one unit per share group (``pack``), a group
    costing more than ``capacity`` tokens (``_unit_cost``; packed tokens are held to twice ``capacity`` when
    ``shared``) cut greedily, its samples longest first. Samples with nothing trained are units of their own.
    Deterministic for a given input order."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        f = _prompt_len(s)
        groups.setdefault(("solo", i) if f is None else ("prefix", tuple(s.input_ids[:f])), []).append(i)
    units: list[list[int]] = []
    for members in groups.values():
        unit: list[int] = []
        load = packed = 0
        for i in sorted(members, key=lambda i: (-len(samples[i].input_ids), i)):
            n = len(samples[i].input_ids)
            extra = n - (_prompt_len(samples[i]) or 0) if shared and unit else n  # the prompt is in the unit already
            if unit and (load + extra > capacity or (shared and packed + n > 2 * capacity)):
                units.append(unit)
                unit, load, packed, extra = [], 0, 0, n
            unit.append(i)
            load += extra
            packed += n
        units.append(unit)
    cost = [_unit_cost(samples, u, shared) for u in units]
    return [units[u] for u in sorted(range(len(units)), key=lambda u: (-cost[u], units[u][0]))]


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Where the P tokens of a packed row go in a right-padded [S, T] batch of one document per row.

    Attention over a packed row needs a block-diagonal [P, P] mask, and SDPA then does O(P^2) work
    (with a mask no fused causal kernel runs): on the CPU demo (4 layers, P = 2029 tokens of ~35-token
    documents, 2 threads) masked attention forward + backward took 85-94 ms per layer against 7.5 ms
    for the same documents as causal rows. Right padding is harmless under causal attention: no real
    token attends to a later pad. S documents (rows), T = longest document, P packed tokens.
    """

    flat_index_P: torch.Tensor
    """[P] int64: position of each packed token in the flattened [S * T] batch"""
    position_ids_ST: torch.Tensor
    """[S, T] int64: each row's positions, continued through its padding (so the row reads as one document)"""
    num_rows: int
    row_len: int

    def to_rows(self, x_1P: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """[1, P] -> [S, T], pads filled with ``pad``."""
        out_ST = x_1P.new_full((self.num_rows * self.row_len,), pad)
        out_ST[self.flat_index_P] = x_1P[0]
        return out_ST.view(self.num_rows, self.row_len)

    def from_rows(self, x_STD: torch.Tensor) -> torch.Tensor:
        """[S, T, D] -> [P, D] in packed order (any trailing dim D; differentiable: the backward scatters into
        the rows)."""
        return x_STD.reshape(self.num_rows * self.row_len, -1)[self.flat_index_P]


def row_layout(position_ids_1P: torch.Tensor, max_pad_factor: float = 2.0, row_multiple: int = 1) -> RowLayout | None:
    """The ``RowLayout`` of a packed row, or None when it holds one document or when padding to the
    longest document would make more than ``max_pad_factor * P`` tokens (the MLPs then do more extra
    work than the attention saves). Documents start where the position is not the previous plus one
    (``models/common/attention.py``). Rows are right-padded to the longest document rounded up to a multiple of
    ``row_multiple`` (``policy.COMPILED_ROW_MULTIPLE``: compiled blocks). Syncs with the host once (the document
    lengths)."""
    pos_P = position_ids_1P[0]
    P = pos_P.numel()
    starts_P = torch.ones_like(pos_P, dtype=torch.bool)
    starts_P[1:] = pos_P[1:] - pos_P[:-1] != 1
    start_idx_S = starts_P.nonzero().flatten()
    lengths = torch.diff(start_idx_S, append=start_idx_S.new_tensor([P])).tolist()
    S, T = len(lengths), max(lengths)
    T += -T % row_multiple
    if S == 1 or S * T > max_pad_factor * P:
        return None
    doc_P = starts_P.cumsum(0) - 1
    col_P = torch.arange(P, device=pos_P.device) - start_idx_S[doc_P]
    first_pos_S = pos_P[start_idx_S]
    position_ids_ST = first_pos_S[:, None] + torch.arange(T, device=pos_P.device)[None, :]
    return RowLayout(flat_index_P=doc_P * T + col_P, position_ids_ST=position_ids_ST, num_rows=S, row_len=T)


@dataclass(frozen=True, slots=True)
class ShareLayout:
    """A packed row with shared prompts: the documents of a share group (same positions and tokens before
    their first trained token) become one row segment [prefix, suffix_1, ..., suffix_k], the prefix being the
    group's longest common prefix, forwarded once; documents without a partner keep their whole tokens as
    their own segment. Segments are laid out first-fit decreasing into R rows of W tokens (W: the longest
    segment), right-padded. Token i of a row attends token j iff j <= i, both in one segment and j in the
    prefix or in i's own suffix; a pad attends only itself (so that no softmax row is empty). A packed
    token at document position t < p reads the prefix's hidden state, t >= p its own suffix's: attention
    sees exactly the keys it sees unpacked, so the hidden states (hence logprobs, entropy, loss) are the
    packed path's up to rounding, and the prefix's gradient is the sum over the group (the gather's
    backward adds). Local letters: R rows, W tokens of a row (the model's B and T), P packed tokens.
    """

    flat_index_P: torch.Tensor
    """[P] int64: where each packed token's hidden state is in the flattened [R * W] rows"""
    input_ids_RW: torch.Tensor
    """[R, W] int64 (pads 0)"""
    position_ids_RW: torch.Tensor
    """[R, W] int64: each token's position in its document (pads 0)"""
    attn_mask_RWW: torch.Tensor
    """[R, W, W] bool, True = query attends key"""
    num_shared_tokens: int
    """Tokens the packed row holds that the rows do not (prompt copies left out)"""

    def from_rows(self, x_RWD: torch.Tensor) -> torch.Tensor:
        """[R, W, D] -> [P, D] in packed order (differentiable: the backward sums into the shared prefix)."""
        return x_RWD.reshape(-1, x_RWD.shape[-1])[self.flat_index_P]


def _doc_bounds(pos: list[int]) -> list[tuple[int, int]]:
    starts = [0] + [t for t in range(1, len(pos)) if pos[t] != pos[t - 1] + 1]
    return list(zip(starts, starts[1:] + [len(pos)]))


def _first_trained(trained: list[bool], a: int, b: int) -> int | None:
    """Document-relative index of the first trained token of document [a, b) (the target of position t
    is token t + 1, so ``trained[t]`` marks token t + 1); None when nothing is trained."""
    return next((t - a + 1 for t in range(a, b - 1) if trained[t]), None)


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if any(s[i] != seqs[0][i] for s in seqs[1:])), n)


MAX_SHARE_MASK_ELEMENTS = 2**26
"""Largest [R, W, W] attention mask ``share_layout`` builds (64 Mi entries: one 8k-token row); SDPA turns a
bool mask into an additive bias of the compute dtype, so beyond this the dense mask costs more memory than
sharing saves and the row goes the unshared way."""


def share_layout(
    input_ids_1P: torch.Tensor,
    position_ids_1P: torch.Tensor,
    loss_mask_P: torch.Tensor,
    max_mask_elements: int = MAX_SHARE_MASK_ELEMENTS,
    row_multiple: int = 1,
) -> ShareLayout | None:
    """The ``ShareLayout`` of a packed row, or None when no two documents share their untrained prefix
    (nothing to gain) or the mask would hold more than ``max_mask_elements`` entries. ``loss_mask_P`` as ``MicroBatch.loss_mask`` (bool or 0/1 float: the target of
    position t is trained). Documents start where the position is not the previous plus one. Copies the
    row to the host once (Python loops over P tokens: about 2 ms for P = 2k on the CPU VM). ``row_multiple``: W is
    rounded up to a multiple of it (``policy.COMPILED_ROW_MULTIPLE``: compiled blocks)."""
    return _segment_layout(input_ids_1P, position_ids_1P, loss_mask_P, max_mask_elements, row_multiple)


def fill_layout(
    input_ids_1P: torch.Tensor,
    position_ids_1P: torch.Tensor,
    max_mask_elements: int = MAX_SHARE_MASK_ELEMENTS,
    row_multiple: int = 1,
) -> ShareLayout | None:
    """A packed row's documents, unshared, laid first-fit decreasing into rows of W tokens (W: the longest
    document), several to a row under a block-diagonal causal mask: ``ShareLayout``'s rows with every document a
    segment of its own: 1.14-1.19x P where ``RowLayout`` pads every document to the longest, 1.5x P (simulated
    micro-batches of the learning benchmark's 280-1,030-token samples). None when the mask would hold more than
    ``max_mask_elements`` entries."""
    return _segment_layout(input_ids_1P, position_ids_1P, None, max_mask_elements, row_multiple)


def _segment_layout(
    input_ids_1P: torch.Tensor,
    position_ids_1P: torch.Tensor,
    loss_mask_P: torch.Tensor | None,
    max_mask_elements: int,
    row_multiple: int,
) -> ShareLayout | None:
    """``share_layout`` (``loss_mask_P`` given: documents sharing their untrained prefix form one segment; None when
    none does) or ``fill_layout`` (None: every document a segment)."""
    ids, pos = input_ids_1P[0].tolist(), position_ids_1P[0].tolist()
    bounds = _doc_bounds(pos)
    groups: dict[tuple, list[int]] = {}
    trained = None if loss_mask_P is None else (loss_mask_P > 0).tolist()
    for d, (a, b) in enumerate(bounds):
        f = None if trained is None else _first_trained(trained, a, b)
        key = ("solo", d) if f is None else (pos[a], tuple(ids[a : a + f]))
        groups.setdefault(key, []).append(d)
    if all(len(g) == 1 for g in groups.values()) and (trained is not None or len(bounds) == 1):
        return None  # nothing shared (share_layout), or one document (fill_layout: no mask needed)
    segments = []  # (docs, prefix length, segment length)
    for docs in groups.values():
        p = _common_prefix([ids[bounds[d][0] : bounds[d][1]] for d in docs])
        segments.append((docs, p, p + sum(bounds[d][1] - bounds[d][0] - p for d in docs)))
    W = -(-max(s[2] for s in segments) // row_multiple) * row_multiple  # trailing pads: their own segments
    order = sorted(range(len(segments)), key=lambda s: (-segments[s][2], s))  # first-fit decreasing
    rows = [[order[k] for k in r] for r in first_fit([segments[s][2] for s in order], W)]  # segments per row
    R, P = len(rows), len(ids)
    if R * W * W > max_mask_elements:
        return None
    row_ids, row_pos = [0] * (R * W), [0] * (R * W)
    seg_of = list(range(-1, -R * W - 1, -1))  # pads: a segment of their own
    part_of = [0] * (R * W)  # 0 prefix, 1 + k the k-th suffix of the segment
    flat_index = [0] * P
    for r, segs in enumerate(rows):
        o = r * W
        for s in segs:
            docs, p, n_seg = segments[s]
            a0 = bounds[docs[0]][0]
            row_ids[o : o + p], row_pos[o : o + p] = ids[a0 : a0 + p], pos[a0 : a0 + p]
            seg_of[o : o + n_seg] = [s] * n_seg
            q = o + p
            for k, d in enumerate(docs):
                a, b = bounds[d]
                flat_index[a : a + p] = range(o, o + p)
                flat_index[a + p : b] = range(q, q + b - a - p)
                row_ids[q : q + b - a - p], row_pos[q : q + b - a - p] = ids[a + p : b], pos[a + p : b]
                part_of[q : q + b - a - p] = [1 + k] * (b - a - p)
                q += b - a - p
            o += n_seg
    dev = input_ids_1P.device
    seg_RW = torch.tensor(seg_of, device=dev).view(R, W)
    part_RW = torch.tensor(part_of, device=dev).view(R, W)
    causal_WW = torch.ones(W, W, dtype=torch.bool, device=dev).tril()
    mask_RWW = (
        causal_WW
        & (seg_RW[:, :, None] == seg_RW[:, None, :])
        & ((part_RW[:, None, :] == 0) | (part_RW[:, :, None] == part_RW[:, None, :]))
    )
    return ShareLayout(
        flat_index_P=torch.tensor(flat_index, device=dev),
        input_ids_RW=torch.tensor(row_ids, device=dev).view(R, W),
        position_ids_RW=torch.tensor(row_pos, device=dev).view(R, W),
        attn_mask_RWW=mask_RWW,
        num_shared_tokens=P - sum(s[2] for s in segments),
    )
