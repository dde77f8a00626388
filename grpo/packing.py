"""Real tokens only: a batch's rows laid end to end, without their padding, through the ordinary
transformers model (docs/algorithm.md, "Real tokens only").

Every projection and MLP runs on the rows' real tokens alone ([1, real tokens, width]); attention,
the one place tokens meet, is an attention function registered with transformers
(AttentionInterface; a model that packs keeps it as its implementation, and every forward without
a layout goes on to SDPA as before) that lays each layer's queries, keys and values out as dense
rows again:
each distinct prompt once (causal), each completion over its prompt's keys and its own (causal),
trimmed to the longest real row. A group's rows thus share one prompt forward, as the padded path's
KV cache did, and the padding never enters a matmul outside attention.

The layout depends on the rows' lengths and prompts alone: it is built on the host from one read of
them (a read waits for the device), then moved to the device without waiting (non_blocking).
"""
import dataclasses
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "lean_packed"


class NotPackable(RuntimeError):
    """A model whose attention asks for something the packed function does not do (a sliding
    window, logit soft-capping, sinks): its forwards stay padded."""


@dataclasses.dataclass
class Layout:
    """Where each packed token goes in the dense attention rows, as indices into the packed tokens:
    heads (distinct prompts, or whole rows) [S, Wh], their queries' rows; tails (completions) [R,
    Wt], whose keys and values are their head's then their own [R, Wh + Wt]; each block's boolean
    attention mask; and `back`, where each packed token's output lies in the blocks' outputs laid
    end to end."""
    head: torch.Tensor
    head_mask: torch.Tensor
    back: torch.Tensor
    tail: torch.Tensor = None
    tail_keys: torch.Tensor = None
    tail_mask: torch.Tensor = None

    def to(self, device) -> "Layout":
        """This layout on `device`, its copies queued (host tensors: staged before it returns)."""
        return Layout(**{k: None if t is None else t.to(device, non_blocking=True)
                         for k, t in vars(self).items()})


def bucket(n: int) -> int:
    """The width a block of n > 0 columns is padded to where widths are bucketed: a multiple of 16
    up to 256 (at most 15 more columns: a completion capped at a multiple of 16, as 144 is, keeps
    its width), then of a sixteenth of the next power of two (under 1/8 more)."""
    step = max(16, 1 << max(0, (n - 1).bit_length() - 4))
    return -(-n // step) * step


def _dense(lengths: torch.Tensor, start: int, total: int, buckets: bool = False):
    """(index [S, W], valid [S, W]) of segments of `lengths` packed from `start`, W the longest
    (buckets: bucket() of it); an invalid slot points at a real token (its value is unused)."""
    width = int(lengths.max()) if lengths.numel() else 0
    width = bucket(width) if buckets and width else width
    offsets = start + torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(width)
    return (offsets[:, None] + cols).clamp_max(total - 1), cols < lengths[:, None]


def _causal(valid: torch.Tensor) -> torch.Tensor:
    """[S, 1, W, W]: a query sees the valid keys at or before it; a padding query sees every key
    (its output is dropped, and a row with no key would be NaN)."""
    tril = torch.ones(valid.shape[1], valid.shape[1], dtype=torch.bool).tril()
    return ((tril & valid[:, None, :]) | ~valid[:, :, None])[:, None]


def layout(head_len, tail_len=None, parent=None, buckets: bool = False) -> Layout:
    """The Layout of heads of head_len [S] tokens packed first, then tails of tail_len [R] (None:
    none), tail r attending to head parent[r] then itself; buckets: bucket() the blocks' widths."""
    n_head = int(head_len.sum())
    n_tail = 0 if tail_len is None else int(tail_len.sum())
    index, valid = _dense(head_len, 0, n_head + n_tail, buckets)
    out = Layout(index, _causal(valid), valid.flatten().nonzero().squeeze(1))
    if n_tail:
        t_index, t_valid = _dense(tail_len, n_head, n_head + n_tail, buckets)
        prompt = valid[parent][:, None, None, :] | ~t_valid[:, None, :, None]
        out.tail, out.tail_keys = t_index, torch.cat([index[parent], t_index], 1)
        out.tail_mask = torch.cat([prompt, _causal(t_valid)], -1)
        out.back = torch.cat([out.back, index.numel() + t_valid.flatten().nonzero().squeeze(1)])
    return out


def _rows(t, index):
    """t [N, heads, D] at index [S, W], as attention reads it: [S, heads, W, D]."""
    return t.index_select(0, index.flatten()).view(*index.shape, *t.shape[1:]).transpose(1, 2)


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     lean_layout: Layout = None, **kwargs):
    """query [1, H, N, D], key and value [1, H_kv, N, D] of N packed tokens -> [1, N, H, D] as the
    layout says. Without one (sampling, evaluation: padded rows, their mask): the model's SDPA."""
    if lean_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotPackable(f"the model's attention takes {name}")
    lo = lean_layout
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [N, heads, D]
    if k.shape[1] != q.shape[1]:   # grouped-query attention: each K/V head serves several
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    blocks = [(lo.head, lo.head, lo.head_mask), (lo.tail, lo.tail_keys, lo.tail_mask)]
    outs = [torch.nn.functional.scaled_dot_product_attention(
        _rows(q, queries), _rows(k, keys), _rows(v, keys), attn_mask=mask, scale=scaling
    ).transpose(1, 2).flatten(0, 1) for queries, keys, mask in blocks if queries is not None]
    return torch.cat(outs).index_select(0, lo.back)[None], None


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)   # a padded forward's mask, as under SDPA
# given as the attention mask of a packed forward: transformers passes a 4-D mask on as it is (the
# layout carries the real one), where it would otherwise build one over every packed token
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def packed_hidden(model, input_ids, attention_mask, split: int, keep, buckets: bool = None):
    """(hidden [K, width], kept [K]): the last hidden states of the rows' real tokens, packed, at
    the K columns keep [B, W] marks, and their indices into [B, W] flattened (host). Columns before
    split: the prompt, each distinct one run once (a head); split 0: every row whole. buckets:
    bucket() the widths (default on CUDA: a new shape costs cuDNN a plan; a CPU rounds anew)."""
    (batch, width), device = attention_mask.shape, input_ids.device
    buckets = device.type == "cuda" if buckets is None else buckets
    # one read from the device: the prompts, the mask and keep
    host = torch.cat([input_ids[:, :split], attention_mask.long(), keep.long()], 1).cpu()
    mask, keep = host[:, split:split + width], host[:, split + width:].bool()
    valid, flat = mask.bool(), torch.arange(batch * width).view(batch, width)
    if split > 0:
        prompts, parent = torch.unique(torch.cat([host[:, :split], mask[:, :split]], 1), dim=0,
                                       return_inverse=True)
        # a head runs its last row's prompt; twin [B, W]: the column whose packed token each is
        head = parent.new_empty(prompts.shape[0]).scatter_(0, parent, torch.arange(batch))
        head_valid, tail_valid = valid[head, :split], valid[:, split:]
        lo = layout(head_valid.sum(1), tail_valid.sum(1), parent, buckets)
        source = torch.cat([flat[head, :split][head_valid], flat[:, split:][tail_valid]])
        twin = torch.cat([flat[head[parent], :split], flat[:, split:]], 1)
    else:
        lo, source, twin = layout(valid.sum(1), buckets=buckets), flat[valid], flat
    packed = torch.zeros(batch * width, dtype=torch.long)   # a source column's packed index
    packed[source] = torch.arange(source.numel())
    pos = (mask.cumsum(-1) - 1).clamp_min(0).view(-1)[source]
    ids, pos, at = (t.to(device, non_blocking=True) for t in (source, pos, packed[twin[keep]]))
    hidden = model.base_model(input_ids=input_ids.reshape(-1)[ids][None], position_ids=pos[None],
                              attention_mask=_NO_MASK, lean_layout=lo.to(device),
                              use_cache=False).last_hidden_state[0]
    return hidden[at], flat[keep]


_FITS = weakref.WeakKeyDictionary()   # model -> (packs, why not)


def packs(model) -> bool:
    """Whether the model's forward takes packed rows (fit: checked once per model)."""
    return (_FITS.get(model) or fit(model))[0]


def fit(model) -> tuple:
    """(whether the model's forward takes packed rows, why not), checked now and kept: its attention
    is SDPA's (then the packed function's, which is SDPA without a layout) and the packed forward
    gives the padded one's hidden states on a small probe (a prompt shared by two rows of different
    lengths, and a row alone). Else the model keeps its own attention."""
    config = model.config
    before = config._attn_implementation
    why = None if before in ("sdpa", NAME) else f"its attention is {before}, not SDPA"
    if why is None:
        padded = _probe(model, None)
        config._attn_implementation = NAME
        why = _probe(model, padded)
    config._attn_implementation = NAME if why is None else before
    _FITS[model] = (why is None, why)
    return _FITS[model]


def describe(model) -> str:
    """How the update's forwards run on `model`, in words (the run's header)."""
    if packs(model):
        return "real tokens only (packed: each prompt once, no padding in a matmul)"
    return f"padded rows ({_FITS[model][1]}: the packed forward does not fit)"


def _probe(model, padded):
    """The probe's padded hidden states (padded None), or why the packed ones differ (None: they
    are equal)."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 0], [0, 0, 7, 8, 9, 1]],
                       device=device) % vocab
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]],
                        device=device)
    real = mask.bool()
    with torch.no_grad():
        if padded is None:
            return model.base_model(input_ids=ids, attention_mask=mask,
                                    position_ids=(mask.cumsum(-1) - 1).clamp_min(0)
                                    ).last_hidden_state[real]
        try:
            hidden, _ = packed_hidden(model, ids, mask, 3, real)
        except NotPackable as e:
            return str(e)
    if not torch.allclose(hidden, padded, atol=1e-4, rtol=1e-4):
        return "its packed hidden states differ from its padded ones"
    return None
