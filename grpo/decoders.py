"""Decoding: generate() samples completions token by token with a KV cache (for grpo/rollout.py).
A decoder turns the token just drawn into the next logits: HFDecoder any causal LM; GPT2Decoder and
LlamaDecoder (Llama, Qwen2, Mistral without sliding windows) are fast paths on preallocated K/V
buffers (docs/algorithm.md, "Decoding"), each tested against HFDecoder and HF generate.
"""
import bisect
import dataclasses
import functools
import math
import operator
import sys
import weakref

import torch
from transformers.pytorch_utils import Conv1D

from grpo.graphs import graph_for
from grpo.model import (head_multiple, logprob_temperature, padded_head,
                        position_ids_from_mask)

# a compiled step's K/V buffers, kept from one generate() to the next by model and shape: a CUDA
# graph replays on the addresses it was recorded with, so new buffers every call would record a
# new graph
_BUFFERS = weakref.WeakKeyDictionary()


def _zeros(model, name, shape, dtype, device, keep: bool, reuse=None):
    """A zeroed tensor: with keep, _kept; else in reuse's memory where it fits (no page faults)."""
    if keep:
        return _kept(model, name, shape, dtype, device)
    if reuse is not None and reuse.dtype == dtype and reuse.numel() >= math.prod(shape):
        return reuse.view(-1)[:math.prod(shape)].view(shape).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def _kept(model, name, shape, dtype, device):
    """A zeroed tensor, the same one for the same model, name and shape at every call."""
    kept = _BUFFERS.setdefault(model, {})
    key = (name, tuple(shape), dtype, str(device))
    if key not in kept:
        kept[key] = torch.empty(shape, dtype=dtype, device=device)
        if device.type == "cuda":  # read in place by the replayed graphs
            torch._dynamo.mark_static_address(kept[key])
    return kept[key].zero_()


def _index(values: list, device) -> torch.Tensor:
    """values as an index tensor on device, copied without waiting (on a GPU from pinned memory)."""
    host = torch.tensor(values, dtype=torch.long)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


# compilations of the decode step a process may make (model x shape bucket; torch's default: 8)
RECOMPILE_LIMIT = 64
_LIMIT_HIT = []   # not empty once it was reached


class Decoder:
    """What generate() asks of a decoder: advance(), one decode step and the draw after it."""
    compiled, static = None, False   # static: its step's tensors are _kept

    graph = None   # "capture": a replayed CUDA graph; "check": its stand-in (grpo/graphs.py)

    def advance(self, draws, step: int, banned):
        """Feed the token drawn at column `step`; draw column step + 1 from the logits it gives."""
        if self.compiled is not None:
            return self._advance_compiled(draws, step, banned)
        if self.graph is not None:
            return self._advance_graphed(draws, step, banned)
        draws.draw(self(draws.last_at(step), step), draws.columns[step + 1], banned)

    def select(self, rows: list, prefill, step: int):
        """This decoder for its `rows` alone (indices of its own rows, a host list), the columns
        before `step` written; prefill: generate()'s own prompt cache."""
        raise NotImplementedError


class PreallocatedDecoder(Decoder):
    """One-token decode steps on preallocated K/V buffers for pre-norm decoder-only transformers, in
    the model's own math (docs/algorithm.md, "Decoding"). A subclass gives _embed (a token's
    embedding), _qkv (norm, q, k, v projections), _rest (output projection, MLP, residuals) and
    final_norm; the attention between them is the same for GPT-2 and Llama.
    """
    # A step is few ops, each a kernel launch from Python (bench/decode_ops.py counts them): hidden
    # states stay [rows, width], a layer's views are one as_strided each, scores and outputs land in
    # buffers laid out for the next op (out=), all layers' K/V tables are sliced once per token. The
    # same kernels on the same operands as a plain forward: only the number of calls differs.
    # Compiled (compile=True), a step is the model's step and the next draw (_advance_traced; on
    # CUDA one graph, replayed) in fixed shapes: new K/V go into their column of the full-length
    # buffer, attention reads all of it under a mask of the columns written, the step index is a
    # tensor, prompt columns are padded to a power of two times WIDTH_MULTIPLE (padded_width): one
    # compilation per width bucket. Eager, prompt columns are padded to a multiple of WIDTH_MULTIPLE
    # and attention reads the written columns rounded up to a multiple of NEW_MULTIPLE (the same
    # mask, half the columns on average).
    WIDTH_MULTIPLE = 16
    NEW_MULTIPLE = 16

    def __init__(self, model, cache, inverse: list, prompt_mask, max_new_tokens: int,
                 compile: bool = False, group_size: int = None, reuse: dict = None,
                 graph: str = None):
        self.model, self.inverse, self.prompt_mask, self.graph = model, inverse, prompt_mask, graph
        # compiled or graphed, the tensors the step reads are _kept: a replay reads those recorded
        static = self.static = compile or graph is not None
        (batch, width), device, T = prompt_mask.shape, prompt_mask.device, max_new_tokens
        # rows per prompt (compiled: the caller's, so repeated prompts recompile nothing), or 1
        n_prompts = max(inverse) + 1
        group = (static and group_size) or (batch // n_prompts if batch % n_prompts == 0 else 1)
        if batch % group or any(inverse[i] != inverse[i - i % group] for i in range(batch)):
            group = 1
        self.group, groups, layers = group, batch // group, len(cache.layers)
        dtype = torch.float32 if device.type == "cpu" else cache.layers[0].keys.dtype
        _, kv_heads, _, head_dim = cache.layers[0].keys.shape
        self.shape = (groups, kv_heads, group, self.heads // kv_heads, head_dim)
        self.width = padded = padded_width(width, self.WIDTH_MULTIPLE, static)
        zeros = functools.partial(_zeros, model, dtype=dtype, device=device, keep=static)
        # by group, all layers in one table; keys transposed (both score matmuls read them as they
        # lie); zeros: a masked column's weight is then exactly 0 (0 * NaN would not be)
        self.prompt_k = zeros("prompt_k", (layers, groups, kv_heads, head_dim, padded))
        self.prompt_v = zeros("prompt_v", (layers, groups, kv_heads, padded, head_dim))
        first = _index(inverse[::group], device)   # each group's prompt
        for i, layer in enumerate(cache.layers):
            self.prompt_k[i, ..., :width] = layer.keys[first].transpose(-1, -2)
            self.prompt_v[i, ..., :width, :] = layer.values[first]
        reuse, rows = reuse or {}, (layers, *self.shape[:3])
        self.new_k = zeros("new_k", (*rows, head_dim, T), reuse=reuse.get("new_k"))
        self.new_v = zeros("new_v", (*rows, T, head_dim), reuse=reuse.get("new_v"))
        self.prompt_ks, self.prompt_vs, self.new_ks, self.new_vs = (t.unbind(0) for t in (
            self.prompt_k.flatten(1, 2), self.prompt_v, self.new_k, self.new_v))   # per layer
        self._step_tables(prompt_mask, group, width, T, dtype, device)
        # a layer's buffers: scaled queries, output, prompt scores; by K/V head (3), by row (n3)
        self.q5, self.o5 = zeros("q", self.shape), zeros("o", self.shape)
        self.qk = zeros("qk", (groups, kv_heads, group * self.shape[3], padded))
        self.q3, self.qn3 = self.q5.flatten(2, 3).flatten(0, 1), self.q5.flatten(0, 2)
        self.qk3, self.o = self.qk.flatten(0, 1), self.o5.flatten(2, 3)
        self.y = zeros("y", (batch, self.heads * head_dim))
        self.y5 = self.y.view(groups, group, kv_heads, -1, head_dim).transpose(1, 2)
        self._eager, self.device_type = (None,), device.type   # __call__'s window
        head = model.get_output_embeddings()   # padded as in training (on a GPU only)
        self.vocab = head.weight.shape[0]
        self.head = self._matmul_tensors("head", [padded_head(head, head_multiple(device))])[0]
        self.compiled = _compiled(type(self), device) if compile and not _LIMIT_HIT else None

    def select(self, rows: list, prefill, step: int):
        """A decoder of the same class for `rows` (its prompts' keys from the prefill, the new
        columns before `step` copied), laid out by row unless the rows are whole groups."""
        index = _index(rows, self.prompt_mask.device)
        # [layers, groups, K/V heads, group, ...] -> by row: the chosen rows' written columns
        written = [old.narrow(dim + 1, 0, step).transpose(2, 3).flatten(1, 2)[:, index]
                   for old, dim in ((self.new_k, 4), (self.new_v, 3))]
        # eager, the new buffers reuse this one's memory
        new = type(self)(self.model, prefill, [self.inverse[r] for r in rows],
                         self.prompt_mask[index],
                         self.new_k.shape[-1], compile=self.compiled is not None,
                         reuse=None if self.static else {"new_k": self.new_k, "new_v": self.new_v},
                         graph=self.graph)
        for by_row, kept, dim in zip(written, (new.new_k, new.new_v), (4, 3)):
            kept.transpose(2, 3).narrow(dim + 1, 0, step).copy_(   # regrouped as the new layout
                by_row.view(kept.shape[0], kept.shape[1], kept.shape[3], *by_row.shape[2:]))
        return new

    def _step_tables(self, prompt_mask, group, width, T, dtype, device):
        """Masks, -inf where not read: prompt_bias [groups x H_kv, 1, columns], new_bias [T, 1, 1,
        T] (a row a step); positions [T, rows]; columns; column (graphed); at: each step's."""
        prompt = torch.nn.functional.pad(prompt_mask[::group], (0, self.width - width)) != 0
        seen = (prompt.repeat_interleave(self.shape[1], 0)[:, None],
                torch.ones(T, T, dtype=torch.bool, device=device).tril().view(T, 1, 1, T))
        prompt_bias, new_bias = (torch.zeros(s.shape, dtype=dtype, device=device).masked_fill(
            ~s, -math.inf) for s in seen)
        positions = prompt_mask.sum(-1) + torch.arange(T, device=device)[:, None]
        self.prompt_bias, self.new_bias, self.positions, self.columns = (
            _kept(self.model, name, t.shape, t.dtype, device).copy_(t) if self.static else t
            for name, t in (("prompt_bias", prompt_bias), ("new_bias", new_bias),
                            ("positions", positions), ("columns", torch.arange(T, device=device))))
        self.column = _kept(self.model, "column", (1,), torch.long, device) if self.graph else None
        self.at = tuple(zip(self.columns.split(1), self.positions.unbind(0)))

    def __call__(self, token, step: int):
        """The eager step: the logits after `token`, written at column `step`."""
        new = min(len(self.columns), -(-(step + 1) // self.NEW_MULTIPLE) * self.NEW_MULTIPLE)
        if self._eager[0] != new:
            self._eager = new, self.new_bias[..., :new], self._window(new)
        _, bias, window = self._eager
        return self._forward(token, *self.at[step], bias[step], window)

    def _window(self, new: int) -> tuple:
        """_attend's buffers, each layer's new keys and values, over `new` columns."""
        scores, fresh = (self.q5.new_empty(*self.shape[:-1], n) for n in (self.width + new, new))
        return ((scores.flatten(2, 3), scores.flatten(2, 3)[..., :self.width],
                 scores[..., self.width:], fresh.flatten(0, 2), fresh.flatten(2, 3)),
                self.new_k[..., :new].flatten(1, 3).unbind(0), self.new_v[..., :new, :].unbind(0))

    def _step(self, token, column, position, bias):
        """The logits after `token`, written at `column` (a one-element index)."""
        return self._forward(token, column, position, bias, self._window(len(self.columns)))

    def _advance_graphed(self, draws, step: int, banned):
        """advance() by _graphed_step replayed: one graph per shape and setting (graph_key), made
        on first use and kept from call to call; the column it writes is set before each replay."""
        self.column.fill_(step)
        key = (type(self), self.prompt_k.shape, self.new_k.shape, draws.key(), banned,
               torch.is_autocast_enabled(self.device_type),
               torch.get_autocast_dtype(self.device_type))
        graph_for(self.model, key, self.graph)(lambda: self._graphed_step(draws, banned))

    def _graphed_step(self, draws, banned):
        """The eager step and the draw after it in the shapes of every step: attention over every
        new column under the mask of those written, the column and its rows' positions and mask
        read through the column tensor."""
        column = self.column
        logits = self._step(draws.last(column), column, self.positions.index_select(0, column)[0],
                            self.new_bias.index_select(0, column)[0])
        draws.draw(logits, column + 1, banned)

    def _advance_compiled(self, draws, step: int, banned):
        """advance() by the compiled step; eager from the first time torch.compile's limit of
        compilations is reached."""
        if self.device_type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        try:
            self.compiled(self, draws, *self.at[step], self.new_bias[step], banned)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # said, then eager: same values, slower
            print(f"note: the decode step reached torch.compile's limit of {RECOMPILE_LIMIT} "
                  f"compilations; decoding goes on eagerly in this process", file=sys.stderr,
                  flush=True)
            _LIMIT_HIT.append(True)
            self.compiled = None
            self.advance(draws, step, banned)

    def _advance_traced(self, draws, column, position, bias, banned):
        """advance() as one compiled step: the model's step, the sampling and the bookkeeping of the
        draw (on CUDA one graph, replayed). It reads the last token from draws and writes the next
        there."""
        token = draws.last(column)
        draws.draw(self._forward(token, column, position, bias), column + 1, banned)

    def _forward(self, token, column, position, bias, window=None):
        """The logits after token; bias: the step's new_bias row; window: _window's, or None."""
        x, rotary = self._embed(token, position)
        attend = self._attend_traced if window is None else self._attend
        for i, (layer, scale) in enumerate(zip(self.layers, self.scales)):
            q, k, v = self._qkv(layer, x, rotary, window is None)
            if {q.dtype, v.dtype} != {self.y.dtype}:   # bf16 autocast on a CPU: attention in fp32
                q, k, v = [t.to(self.y.dtype) for t in (q, k, v)]
            with torch.autocast(self.device_type, enabled=False):
                y = attend(i, q, k, v, column, bias, window, scale)
            x = self._rest(layer, x, y)
        logits = torch.nn.functional.linear(self.final_norm(x), *self.head)
        return logits if logits.shape[-1] == self.vocab else logits[:, :self.vocab]

    def _matmul_tensors(self, name, pairs: list) -> list:
        """(weight, bias) pairs as the step reads them: themselves, or (autocast, GPU) _copies."""
        device = self.prompt_mask.device
        if torch.is_autocast_enabled(device.type) and decode_copies(device):
            flat = _copies(self.model, name, [t for pair in pairs for t in pair],
                           torch.get_autocast_dtype(device.type), device, self.static)
            pairs = list(zip(flat[::2], flat[1::2]))
        return pairs

    def _projections(self, modules: list, kind: type) -> list:
        """Each layer's projections as _matmul_tensors' pairs, or modules where LoRA wraps them."""
        if all(type(m) is kind for m in modules):
            modules = self._matmul_tensors(kind.__name__, [(m.weight, m.bias) for m in modules])
        n = len(modules) // len(self.layers)
        return [modules[i:i + n] for i in range(0, len(modules), n)]

    def _views(self, *qkv) -> tuple:
        """q, k, v (each an output and the column its heads start at) as views [groups, H_kv,
        group, ...]: q [.., rep, D], k [.., D, 1] (transposed), v [.., 1, D]."""
        g, kv, group, rep, dim = self.shape
        layouts = ((self.shape, rep * dim, (dim, 1)), ((g, kv, group, dim, 1), dim, (1, dim)),
                   ((g, kv, group, 1, dim), dim, (dim, 1)))
        return tuple(t.as_strided(shape, (group * t.stride(0), head, t.stride(0), *inner), offset)
                     for (t, offset), (shape, head, inner) in zip(qkv, layouts))

    def _attend(self, i, q, k, v, column, bias, window, scale: float):
        """Layer i's attention over its group's prompt and its row's new tokens, into self.y."""
        self.new_ks[i].index_copy_(4, column, k)
        self.new_vs[i].index_copy_(3, column, v)
        (scores, prompt, new, fresh3, fresh), kn, vn = window
        # a group's rows and query heads in one matmul (they read the same keys); scores plus mask
        # (baddbmm) into buffers of their own, then one cat (out= on a strided view: slow on CPU)
        torch.mul(q, scale, out=self.q5)
        torch.baddbmm(self.prompt_bias, self.q3, self.prompt_ks[i], out=self.qk3)
        torch.baddbmm(bias, self.qn3, kn[i], out=fresh3)
        torch.cat([self.qk, fresh], -1, out=scores)
        torch.softmax(scores, -1, out=scores)   # in place (accumulating in fp32 in any dtype)
        torch.matmul(prompt, self.prompt_vs[i], out=self.o)
        torch.add(self.o5, new @ vn[i], out=self.y5)
        return self.y

    def _attend_traced(self, i, q, k, v, column, bias, _, scale: float):
        """_attend's math without its out= buffers, which torch.compile cannot trace (its outputs
        are strided views); compiled, the ops fuse anyway."""
        g, kv, group, rep, dim = self.shape
        kn, vn = self.new_ks[i], self.new_vs[i]
        kn.index_copy_(4, column, k)
        vn.index_copy_(3, column, v)
        q = q * scale
        prompt = torch.baddbmm(self.prompt_bias, q.reshape(g * kv, group * rep, dim),
                               self.prompt_ks[i])
        new = torch.baddbmm(bias, q.reshape(-1, rep, dim), kn.flatten(0, 2))
        probs = torch.softmax(torch.cat([t.view(*self.shape[:-1], -1) for t in (prompt, new)], -1),
                              -1, dtype=torch.float32).to(vn.dtype)
        out = (probs.flatten(2, 3)[..., :self.width] @ self.prompt_vs[i]).view(self.shape)
        return (out + probs[..., self.width:] @ vn).transpose(1, 2).reshape(self.y.shape)


def _compiled(cls, device):
    """cls's _advance_traced, compiled (on CUDA, its graphs replayed). The class's function, called
    with self: a bound method stored on self would be a reference cycle, its K/V buffers then left
    to wait for the cycle collector."""
    # every decoder's step is one code object to torch.compile: each model and shape bucket
    # compiled counts against one limit (8 by default), past which a fullgraph compile fails
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    return torch.compile(cls._advance_traced, fullgraph=True, dynamic=False,
                         mode="reduce-overhead" if device.type == "cuda" else None)


def decode_copies(device) -> bool:
    """Whether decoding reads bf16 copies of the matmul weights under bf16 autocast: on a GPU (on a
    CPU, eager autocast's own cache of casts does the same)."""
    return device.type == "cuda"


def _copies(model, name, tensors, dtype, device, keep: bool) -> list:
    """tensors in dtype (None stays None), made once per generate(), where autocast would cast them
    again at every compiled step; with keep (compiled), kept from call to call and refreshed in
    place (a replayed graph reads them where it was recorded)."""
    real = [t for t in tensors if t is not None]
    if keep:
        copies = [_kept(model, f"{name}{i}", t.shape, dtype, device)
                  for i, t in enumerate(real)]
        torch._foreach_copy_(copies, real)
    else:
        copies = [t.to(dtype) for t in real]
    return [None if t is None else copies.pop(0) for t in tensors]


def compile_counts() -> dict:
    """In this process so far: the graphs torch.compile compiled (each decode step shape: one), and
    the times inductor ran a graph without CUDA graphs (mode reduce-overhead skipped them: each
    token then launches its kernels one by one; TORCH_LOGS=cudagraphs says why)."""
    counters = torch._dynamo.utils.counters
    return {"decode_compiles": counters["stats"]["unique_graphs"],
            "decode_graph_skips": counters["inductor"]["cudagraph_skips"]}


def padded_width(width: int, multiple: int, compile: bool) -> int:
    """width rounded up to a multiple; compiled, to a power of two times it (a compile a bucket)."""
    multiples = -(-width // multiple)
    return multiple * (2 ** max(0, (multiples - 1).bit_length()) if compile else multiples)


def _project(projection, x):
    """A GPT-2 projection of x: Conv1D's own addmm on (weight, bias), or the module's forward."""
    return (torch.addmm(projection[1], x, projection[0]) if type(projection) is tuple
            else projection(x))


def _linear(projection, x):
    """A Linear projection of x: F.linear on (weight, bias), as nn.Linear computes it, or the
    module's forward."""
    return (torch.nn.functional.linear(x, *projection) if type(projection) is tuple
            else projection(x))


class GPT2Decoder(PreallocatedDecoder):
    """Plain GPT-2: learned absolute positions, one fused q/k/v projection, LayerNorm, GELU MLP. Its
    projections are Conv1D's own addmm, called directly (Conv1D reshapes around it; dropout is off
    in eval)."""
    qkv = None   # eager: the buffer q, k, v are written into

    @staticmethod
    def fits(model) -> bool:
        c = model.config
        return c.model_type == "gpt2" and c.scale_attn_weights and not (
            c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn or c.add_cross_attention)

    def __init__(self, model, *args, **kwargs):
        t = self.t = model.transformer
        self.heads, self.layers, self.final_norm = model.config.n_head, list(t.h), t.ln_f
        self.scales = [b.attn.scaling for b in t.h]
        super().__init__(model, *args, **kwargs)
        self.mats = self._projections([m for b in t.h for m in (b.attn.c_attn, b.attn.c_proj,
                                                                b.mlp.c_fc, b.mlp.c_proj)], Conv1D)
        # eager, no autocast (casts): q, k, v written into one buffer by addmm, views made once
        if type(self.mats[0][0]) is tuple and not torch.is_autocast_enabled(self.device_type):
            self.qkv = _zeros(model, "qkv", (self.y.shape[0], 3 * t.embed_dim),
                              self.mats[0][0][0].dtype, self.y.device, self.static)
            self.qkv_views = self._views(*((self.qkv, i * t.embed_dim) for i in range(3)))

    def _embed(self, token, position):
        return self.t.wte(token) + self.t.wpe(position), None

    def _qkv(self, block, x, _, traced: bool):
        projection = self.mats[block.attn.layer_idx][0]
        if self.qkv is not None and not traced:
            torch.addmm(projection[1], block.ln_1(x), projection[0], out=self.qkv)
            return self.qkv_views
        qkv = _project(projection, block.ln_1(x))
        return self._views(*((qkv, i * x.shape[-1]) for i in range(3)))

    def _rest(self, block, x, y):
        _, proj, fc, out = self.mats[block.attn.layer_idx]
        x = x + _project(proj, y)
        return x + _project(out, block.mlp.act(_project(fc, block.ln_2(x))))


class LlamaDecoder(PreallocatedDecoder):
    """Llama-family models: rotary positions from the model's rotary module, grouped-query attention
    (q/k/v biases, as Qwen2 has, are in its modules), RMSNorm, gated MLP."""

    MODEL_TYPES = ("llama", "qwen2", "mistral")
    # rotary variants whose frequencies do not depend on the sequence length ("dynamic" and
    # "longrope" change them with it, so the prefill and the decode steps would see them differ)
    ROPE_TYPES = ("default", "linear", "llama3", "yarn")

    @staticmethod
    def fits(model) -> bool:
        c = model.config
        rope = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
        layer_types = getattr(c, "layer_types", None) or ["full_attention"]
        m = getattr(model, "model", None)
        return (c.model_type in LlamaDecoder.MODEL_TYPES and rope in LlamaDecoder.ROPE_TYPES
                and getattr(c, "sliding_window", None) is None
                and set(layer_types) == {"full_attention"}
                and hasattr(m, "rotary_emb") and hasattr(model, "lm_head"))

    def __init__(self, model, *args, **kwargs):
        m = model.model
        self.m, self.heads, self.final_norm = m, model.config.num_attention_heads, m.norm
        # the model's own rotation (each family's modeling file has it): q, k rotated as in training
        self.apply_rotary = sys.modules[type(m.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.layers, self.scales = list(m.layers), [l.self_attn.scaling for l in m.layers]
        super().__init__(model, *args, **kwargs)
        self.mats = self._projections([p for l in m.layers for p in (
            l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj, l.self_attn.o_proj,
            l.mlp.gate_proj, l.mlp.up_proj, l.mlp.down_proj)], torch.nn.Linear)

    def _embed(self, token, position):
        x = self.m.embed_tokens(token)
        return x, self.m.rotary_emb(x, position[:, None])

    def _qkv(self, layer, x, rotary, _):
        (q, k, v), dim = self.mats[layer.self_attn.layer_idx][:3], layer.self_attn.head_dim
        h = layer.input_layernorm(x)
        q = _linear(q, h).view(h.shape[0], 1, -1, dim)
        k = _linear(k, h).view(h.shape[0], 1, -1, dim)
        # q, k: [B, 1, heads, D]; cos, sin: [B, 1, D]
        q, k = self.apply_rotary(q, k, *rotary, unsqueeze_dim=2)
        return self._views((q, 0), (k, 0), (_linear(v, h), 0))

    def _rest(self, layer, x, y):
        o, gate, up, down = self.mats[layer.self_attn.layer_idx][3:]
        x = x + _linear(o, y)
        h = layer.post_attention_layernorm(x)   # the MLP as the family's own forward computes it
        return x + _linear(down, layer.mlp.act_fn(_linear(gate, h)) * _linear(up, h))


class HFDecoder(Decoder):
    """One-token decode steps through the model's own forward and its DynamicCache (any
    architecture). Its cache grows every step, so it runs eagerly whatever `compile` says."""

    def __init__(self, model, cache, inverse: list, prompt_mask, max_new_tokens: int,
                 compile: bool = False, group_size: int = None, graph: str = None):
        # one row per completion, in the batch's order
        cache.batch_select_indices(_index(inverse, prompt_mask.device))
        self.model, self.cache = model, cache
        self.attention = torch.cat(
            [prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], max_new_tokens)], 1)
        self.width = prompt_mask.shape[1]
        self.position = prompt_mask.sum(-1, keepdim=True)

    def select(self, rows: list, prefill, step: int):
        rows = _index(rows, self.attention.device)
        self.cache.batch_select_indices(rows)
        self.attention, self.position = self.attention[rows], self.position[rows]
        return self

    def __call__(self, token, step: int):
        out = self.model(input_ids=token[:, None],
                         attention_mask=self.attention[:, :self.width + step + 1],
                         position_ids=self.position + step, past_key_values=self.cache,
                         use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]


def decoder_class(model) -> type:
    """The fastest decoder that fits the model: GPT2Decoder, LlamaDecoder, else HFDecoder."""
    return next((c for c in (GPT2Decoder, LlamaDecoder) if c.fits(model)), HFDecoder)


# what the start-up header says of each (a model on the generic path runs, only slower)
DECODER_NAMES = {GPT2Decoder: "fast GPT-2 path", LlamaDecoder: "fast Llama-family path",
                 HFDecoder: "generic HF forward (no fast path fits this model; decoding is slower)"}


def graph_mode(choice: str, device, compile: bool):
    """generate()'s graph for --decode-graph `choice`: "capture" on a GPU (auto, unless compiled:
    torch.compile records its own graphs), "check" (the stand-in) wherever asked, else None."""
    if choice == "check":
        return "check"
    return "capture" if choice == "auto" and device.type == "cuda" and not compile else None


def decoder_name(model) -> str:
    """The decoder generation uses for `model`, in words: "GPT2Decoder (fast GPT-2 path)", ..."""
    cls = decoder_class(model)
    return f"{cls.__name__} ({DECODER_NAMES[cls]})"


def decoder_for(model, cache, inverse: list, prompt_mask, max_new_tokens: int,
                compile: bool = False, group_size: int = None, graph: str = None):
    """A decoder_class(model) for one generate(); inverse: each row's prompt (row of the cache)."""
    return decoder_class(model)(model, cache, inverse, prompt_mask, max_new_tokens, compile=compile,
                                group_size=group_size, graph=graph)


# ---- sampling: one token per row, then a whole completion ---------------------------------------

def as_ends(end_ids) -> tuple:
    """end_ids as a tuple: an id, or ids (EOS first, then e.g. a chat template's end of turn)."""
    return (end_ids,) if isinstance(end_ids, int) else tuple(end_ids)


def is_end(ids: torch.Tensor, end_ids) -> torch.Tensor:
    """Where ids is any of end_ids (an id or ids): one comparison per id, no index tensor."""
    return functools.reduce(operator.or_, (ids == end for end in as_ends(end_ids)))


def completion_mask(completion_ids: torch.Tensor, end_ids) -> torch.Tensor:
    """1 up to and including each row's first end, 0 after it (docs/algorithm.md: not `== pad`)."""
    ends = is_end(completion_ids, end_ids).long()
    return (ends.cumsum(1) == ends).long()   # no end before the column


def sample_index(probs: torch.Tensor, rows=None, batch: int = None) -> torch.Tensor:
    """An index per row, drawn by probs; rows: which of `batch` rows probs' are (_noise)."""
    return (race_index if probs.is_cuda else inverse_cdf_index)(probs, rows, batch)


def _noise(rows, batch: int, shape, draw):
    """draw(shape) for every row of the batch, then the chosen rows' (a row draws as with all)."""
    return draw(shape) if rows is None else draw((batch, *shape[1:]))[rows]


def inverse_cdf_index(probs: torch.Tensor, rows=None, batch: int = None) -> torch.Tensor:
    """The first index whose running sum passes a uniform draw: multinomial's law, 1/10 its time."""
    cdf = probs.cumsum(-1)
    u = _noise(rows, batch, (probs.shape[0], 1), functools.partial(
        torch.rand, device=probs.device, dtype=cdf.dtype))
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_max(
        probs.shape[-1] - 1)


def race_index(probs: torch.Tensor, rows=None, batch: int = None) -> torch.Tensor:
    """The exponential race: argmax of p_i / E_i over E_i ~ Exp(1) drawn independently, which index
    i wins with probability p_i / sum(p) (the first of exponential clocks of rates p_i to ring). E
    is drawn in float64: in float32 its smallest values, which decide the rarest tokens' chances,
    are coarse (2^-24 apart)."""
    clocks = _noise(rows, batch, probs.shape, lambda shape: torch.empty(
        shape, dtype=torch.float64, device=probs.device).exponential_())
    return (probs / clocks.clamp_min_(torch.finfo(torch.float64).tiny)).argmax(-1)  # never 0 / 0


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 banned=None, with_sampler: bool = False, rows=None, batch: int = None):
    """Draw one token per row of logits [B, V]: (token, logprob), each [B]. The logprob is the
    policy's own, as the training forward computes it: temperature-scaled, before top-k/top-p and
    `banned` (an id or a tuple of ids not drawable now). with_sampler: a third, the logprob under
    the truncated distribution drawn from (grpo/variants.py mismatch_weight; docs/algorithm.md).
    rows, batch: sample_index's.
    """
    return tuple(t.squeeze(1) for t in _sample(logits, temperature, top_k, top_p, banned,
                                                with_sampler, rows, batch))


def _sample(logits, temperature: float, top_k: int, top_p: float, banned, with_sampler: bool,
            rows, batch: int) -> tuple:
    """sample_token's draws, each [B, 1]: as the decode loop records them (no op to reshape)."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if logprob_temperature(temperature) != 1:  # x / 1 is x: an op a token saved
        logits = logits / logprob_temperature(temperature)
    logprobs = torch.log_softmax(logits, dim=-1)
    # the distribution drawn from: the policy's unless banned ids or (sampling) top-k, top-p cut it
    top_k, top_p = (top_k, top_p) if temperature != 0 else (0, 1.0)
    filtered = (_truncated(logits, banned, top_k, top_p)
                if banned is not None or 0 < top_k < logits.shape[-1] or top_p < 1 else logits)
    if temperature == 0:
        token = filtered.argmax(-1, keepdim=True)
    else:
        probs = logprobs.exp() if filtered is logits else torch.softmax(filtered, dim=-1)
        token = sample_index(probs, rows, batch)[:, None]
    logprob = logprobs.gather(-1, token)
    if not with_sampler:
        return token, logprob
    if temperature == 0 or filtered is logits:   # the distribution drawn from: the policy's
        return token, logprob, logprob
    return token, logprob, torch.log_softmax(filtered, -1).gather(-1, token)


def _truncated(logits, banned, top_k: int, top_p: float):
    """logits, -inf where a token cannot be drawn: banned (an id or ids), outside the top_k, ranked
    past top_p of the mass."""
    filtered = logits
    if banned is not None:
        filtered = filtered.clone()
        for banned_id in as_ends(banned):   # scalar fills: no index tensor copied to the device
            filtered.select(-1, banned_id).fill_(float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return filtered


# On a GPU a check of which rows have finished reads their flags back from the device: a host
# synchronisation, which empties the device's queue of steps. Checks there are at least this many
# steps apart, and at most CHECK_SPREAD times the steps drawn so far; the steps past the end are
# trimmed off (same outputs). On a CPU, where a check costs nothing, every step.
DONE_CHECK_EVERY = 8
CHECK_SPREAD = 0.5


def check_spacing(device) -> tuple:
    """(the fewest steps between two checks, the most as a share of the steps drawn)."""
    return (DONE_CHECK_EVERY, CHECK_SPREAD) if device.type == "cuda" else (1, 0.0)


class Checks:
    """When generate() reads which rows have finished (one read serves the stop and Draws.compact):
    first where a row can have ended (past min_new_tokens), then where the pace at which rows ended
    since the last read predicts the decoder's next move (a compaction, or the stop), within
    check_spacing's bounds. The bounds keep the steps decoded past the last end below
    max(every, spread x the longest completion); docs/algorithm.md, "Decoding"."""

    def __init__(self, device, min_new_tokens: int):
        self.every, self.spread = check_spacing(device)
        self.next = max(self.every, min_new_tokens + 1)   # in columns drawn
        self.last = (0, 0)   # columns drawn, rows finished at the last check

    def due(self, columns: int) -> bool:
        return columns == self.next

    def after(self, columns: int, done: list, running: int):
        """Schedules the next check after one at `columns` (done: each row's; running: the rows)."""
        finished = sum(done)
        live, (then, before), self.last = len(done) - finished, self.last, (columns, finished)
        need = live - running // 2 if live > running // 2 else live   # to the next move
        pace = (finished - before) / (columns - then)
        soon = math.ceil(need / pace) if pace else math.inf
        self.next = columns + max(self.every, min(soon, int(columns * self.spread)))


class Draws:
    """What generate() records of each row, one column per step, in place: the tokens drawn (EOS
    from a row's first on), their logprobs, the sampler's logprobs (with_sampler) and which rows
    have finished. rows: the rows the decoder still runs (None: all), the others' columns left as
    they are (EOS, logprob 0), kept_rows the same on the host. Compiled, the buffers are kept from
    call to call (a replayed graph writes where it was recorded)."""
    rows = kept_rows = None

    def __init__(self, model, batch: int, width: int, end_ids: tuple, sampling: tuple,
                 with_sampler: bool, device, keep: bool):
        self.end_ids, self.with_sampler, self.model, self.keep = end_ids, with_sampler, model, keep
        self.sampling = sampling   # temperature, top_k, top_p
        zeros, shape = functools.partial(_zeros, model, device=device, keep=keep), (batch, width)
        self.tokens = zeros("tokens", shape, torch.long).fill_(end_ids[0])
        self.logprobs = zeros("logprobs", shape, torch.float32)
        self.sampled = zeros("sampled", shape, torch.float32) if with_sampler else None
        self.done = zeros("done", (batch,), torch.bool)
        self.done2 = self.done.view(batch, 1)   # as a column, as draw() reads it
        self.columns = torch.arange(width, device=device).split(1)   # each an index
        self.token_at = self.tokens.unbind(1)

    def key(self) -> tuple:
        """What a recorded draw depends on besides its buffers' shapes: the rows it runs and the
        settings baked into its kernels."""
        rows = None if self.rows is None else len(self.rows)
        return (tuple(self.tokens.shape), rows, self.end_ids, *self.sampling, self.with_sampler)

    def last(self, column):
        """The tokens at `column` (a one-element index) of the rows the decoder runs."""
        token = self.tokens.index_select(1, column).squeeze(1)
        return token if self.rows is None else token[self.rows]

    def last_at(self, step: int):
        """last() at the column `step` given as a number (eager)."""
        return self.token_at[step] if self.rows is None else self.token_at[step][self.rows]

    def draw(self, logits, column, banned):
        """Sample each running row's token at `column` (an index) from logits; finished: EOS."""
        token, logprob, *sampler = _sample(logits, *self.sampling, banned, self.with_sampler,
                                           self.rows, self.done.shape[0])
        done = self.done2 if self.rows is None else self.done2[self.rows]
        token = token.masked_fill(done, self.end_ids[0])
        for kept, drawn in zip((self.tokens, self.logprobs, self.sampled),
                               (token, logprob, *sampler)):   # the sampler's: with_sampler
            if self.rows is None:
                kept.index_copy_(1, column, drawn)
            else:
                kept[self.rows, column] = drawn[:, 0]
        if self.rows is None:
            self.done2 |= is_end(token, self.end_ids)
        else:
            self.done2[self.rows] = done | is_end(token, self.end_ids)

    @property
    def running(self) -> int:
        return self.done.shape[0] if self.rows is None else len(self.kept_rows)

    def compact(self, decoder, prefill, step: int, compiled: bool, done: list):
        """A decoder of the live rows once half of those running are (static: a power of two)."""
        live = [i for i, d in enumerate(done) if not d]
        size = 1 << max(0, (len(live) - 1).bit_length()) if compiled else len(live)
        if size > self.running // 2 or not live:
            return decoder
        if size > len(live):   # finished rows fill the bucket: they draw EOS, unrecorded
            live = sorted(live + [i for i, d in enumerate(done) if d][:size - len(live)])
        # where each is among the rows the decoder runs (both sorted)
        own = live if self.rows is None else [bisect.bisect_left(self.kept_rows, i) for i in live]
        self.kept_rows, device = live, self.done.device
        self.rows = (_kept(self.model, "rows", (size,), torch.long, device).copy_(
            _index(live, device), non_blocking=True) if self.keep else _index(live, device))
        return decoder.select(own, prefill, step)


@dataclasses.dataclass
class Completions:
    """What generate() drew, each [B, T], T <= max_new_tokens: by name, so a caller cannot read
    one tensor for another (the two logprobs have the same shape)."""
    ids: torch.Tensor    # the tokens drawn; end_ids[0] from a row's first end on
    mask: torch.Tensor   # up to and including a row's first end
    # the policy's logprobs of ids, temperature-scaled, before any truncation (PPO's old ones)
    logp: torch.Tensor
    # with_sampler: the logprobs of ids under the distribution drawn from, which top_k, top_p and
    # min_new_tokens truncate and renormalise (sample_token); else None
    sampler_logp: torch.Tensor | None = None


def _distinct_rows(rows: torch.Tensor) -> tuple:
    """(the distinct rows of `rows`, sorted; each row's index among them), from one host read."""
    listed = list(map(tuple, rows.tolist()))
    distinct, first = sorted(set(listed)), {row: i for i, row in reversed(list(enumerate(listed)))}
    return (rows.index_select(0, _index([first[row] for row in distinct], rows.device)),
            [bisect.bisect_left(distinct, row) for row in listed])


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, *, end_ids, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_new_tokens: int = 0,
             autocast=None, compile: bool = False, with_sampler: bool = False,
             group_size: int = None, graph: str = None) -> Completions:
    """Sample a completion per row of a left-padded prompt batch, ending at a row's first of end_ids
    (not before min_new_tokens). Where a preallocated decoder fits: compile, or graph ("capture",
    "check": grpo/graphs.py); group_size: rows per prompt (compiled: kept if prompts repeat)."""
    (batch, width), ends = prompt_ids.shape, as_ends(end_ids)
    # entered once: autocast keeps its bf16 copies of the weights for the whole loop
    with autocast or torch.autocast(prompt_ids.device.type, enabled=False):
        # a group's rows share their prompt: each distinct one is prefilled once, then its KV copied
        prompts, inverse = _distinct_rows(torch.cat([prompt_ids, prompt_mask], 1))
        out = model(input_ids=prompts[:, :width], attention_mask=prompts[:, width:],
                    position_ids=position_ids_from_mask(prompts[:, width:]), use_cache=True,
                    logits_to_keep=1)
        decoder = decoder_for(model, out.past_key_values, inverse, prompt_mask, max_new_tokens,
                              compile=compile, group_size=group_size, graph=graph)
        draws = Draws(model, batch, max_new_tokens, ends, (temperature, top_k, top_p), with_sampler,
                      prompt_ids.device, keep=decoder.static)
        draws.draw(out.logits[_index(inverse, prompt_ids.device), -1], draws.columns[0],
                   ends if min_new_tokens > 0 else None)
        checks = Checks(prompt_ids.device, min_new_tokens)
        for step in range(max_new_tokens - 1):
            if checks.due(step + 1):
                done = draws.done.tolist()   # the check's one read
                if all(done):
                    break
                decoder = draws.compact(decoder, out.past_key_values, step, decoder.static, done)
                checks.after(step + 1, done, draws.running)
            decoder.advance(draws, step, ends if step + 1 < min_new_tokens else None)
    # up to the latest first end: columns not drawn hold end_ids[0] (a row not ended ran them all)
    mask = completion_mask(draws.tokens, ends)
    longest = mask.sum(1).max().tolist()   # one read
    # copies: a compiled decoder's buffers are the next call's too
    return Completions(*(None if t is None else t[:, :longest].clone()
                         for t in (draws.tokens, mask, draws.logprobs, draws.sampled)))
