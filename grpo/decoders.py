"""The speed paths of generation, kept apart so they read as such.

generate() (grpo/rollout.py) samples one token at a time; a decoder turns the token just drawn into the
logits of the next. HFDecoder works for any causal LM through its own forward and cache. GPT2Decoder
(plain GPT-2) and LlamaDecoder (Llama, Qwen2 and Mistral without sliding windows) are fast paths: the
model's own modules and math, on K/V buffers preallocated at the final length, with a group's prompt
keys and values kept once and read once per group, in steps of static shapes that torch.compile can
capture (compile=True). fuse_tanh_gelu swaps GPT-2's eight-op tanh GELU for PyTorch's fused kernel of
the same function. Each is tested against the generic path and HF generate (tests/core/test_decoders.py).
"""
import sys

import torch


def fuse_tanh_gelu(model) -> None:
    """Swap GPT-2's gelu_new (the tanh GELU written as eight elementwise ops) for PyTorch's fused
    kernel of the same function (equal to float rounding, ~2e-7): about half the activation's time
    in forward and backward. The config says so too, so a saved checkpoint describes the model."""
    from transformers.activations import ACT2FN, NewGELUActivation
    swapped = False
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, ACT2FN["gelu_pytorch_tanh"])
                swapped = True
    if swapped and getattr(model.config, "activation_function", None) == "gelu_new":
        model.config.activation_function = "gelu_pytorch_tanh"


class PreallocatedDecoder:
    """One-token decode steps on preallocated K/V buffers, for pre-norm decoder-only transformers.

    The same modules and math as the model's forward (so the logprobs match the training forward),
    without what it costs per call: no growing cache (torch.cat of every past key at every step), no
    mask building, no output objects. The rows of a group share their prompt, so its keys and values
    are kept once per group and each group's queries attend to them together: decode attention reads
    the prompt's cache once per group instead of once per row. Attention runs in the cache's dtype
    (fp32 on CPU, where bf16 matmuls are emulated; the model's bf16 on GPU).

    Every step has the same shapes: the new keys and values go into their column of the full-length
    buffer and attention reads the whole buffer under a mask of the columns written so far, and the
    step index is a tensor. So the step compiles once (compile=True) and, on CUDA, replays as a graph.
    A subclass says how its architecture embeds a token and projects q, k, v (_embed, _qkv) and names
    its modules (self.layers, self.final_norm); the block around them is the same for GPT-2 and Llama.
    """
    # prompt columns are padded up to a multiple of this (masked), so that a compiled step sees few shapes
    WIDTH_MULTIPLE = 16

    def __init__(self, model, cache, inverse, prompt_mask, max_new_tokens: int, compile: bool = False):
        self.model = model
        batch, width = prompt_mask.shape
        device = prompt_mask.device
        n_prompts = int(inverse.max()) + 1
        per_group = inverse.view(n_prompts, -1) if batch % n_prompts == 0 else None
        if per_group is None or not (per_group == per_group[:, :1]).all():  # rows not in whole groups
            per_group = inverse.view(batch, 1)
        first = per_group[:, 0]  # prompt of each group, in batch order
        self.groups, self.group = per_group.shape
        dtype = torch.float32 if device.type == "cpu" else cache.layers[0].keys.dtype
        _, kv_heads, _, head_dim = cache.layers[0].keys.shape
        padded = -(-width // self.WIDTH_MULTIPLE) * self.WIDTH_MULTIPLE
        self.prompt_kv = []
        for layer in cache.layers:
            kv = torch.zeros(2, self.groups, kv_heads, padded, head_dim, dtype=dtype, device=device)
            kv[0, ..., :width, :], kv[1, ..., :width, :] = layer.keys[first], layer.values[first]
            self.prompt_kv.append(kv)
        # zeros, not empty: a masked column's weight is exactly 0, and 0 * NaN would not be
        self.new_kv = [torch.zeros(2, batch, kv_heads, max_new_tokens, head_dim, dtype=dtype, device=device)
                       for _ in cache.layers]
        # additive mask over each group's prompt columns: -inf on left padding and on the padded columns
        pad = torch.nn.functional.pad(prompt_mask[::self.group], (0, padded - width))
        bias = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill(pad == 0, float("-inf"))
        self.prompt_bias = bias[:, None, None, :]  # [groups, 1, 1, padded]
        self.position = prompt_mask.sum(-1, keepdim=True)  # each row's first new token
        self.columns = torch.arange(max_new_tokens, device=device)
        self.device_type = device.type
        self._step = self._forward
        if compile:
            if device.type == "cuda":  # replayed graphs read the buffers in place: their addresses must not move
                for t in self.prompt_kv + self.new_kv:
                    torch._dynamo.mark_static_address(t)
            self._step = torch.compile(self._forward, fullgraph=True,
                                       mode="reduce-overhead" if device.type == "cuda" else None)

    def __call__(self, token, step: int):
        if self._step is not self._forward and self.device_type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits have been consumed
        return self._step(token, self.columns[step])

    def _forward(self, token, step):
        x, rotary = self._embed(token, self.position + step)
        for i, (layer, norm_in, out_proj, norm_post, scaling) in enumerate(self.layers):
            q, k, v = self._qkv(layer, norm_in(x), rotary)
            with torch.autocast(self.device_type, enabled=False):
                y = self._attend(i, q, k, v, step, scaling)
            x = x + out_proj(y)
            x = x + layer.mlp(norm_post(x))
        return self.model.lm_head(self.final_norm(x))[:, -1]

    def _attend(self, layer: int, q, k, v, step, scale: float):
        """Softmax attention of q [B, H, 1, D] over its group's prompt and its row's new tokens, after
        writing k, v [B, H_kv, 1, D] at column `step`; H = H_kv x rep query heads share a K/V head
        (grouped-query attention; rep = 1 for GPT-2). Returns [B, 1, H x D]."""
        kv_p, kv_n = self.prompt_kv[layer], self.new_kv[layer]
        kv_n.index_copy_(3, step.view(1), torch.stack([k, v]).to(kv_n.dtype))
        (kp, vp), (kn, vn) = kv_p, kv_n
        batch, heads, _, dim = q.shape
        kv_heads, width = kp.shape[1], kp.shape[2]
        rep = heads // kv_heads
        q = q.to(kn.dtype).view(batch, kv_heads, rep, dim)
        # a group's rows and a K/V head's query heads all read the same prompt keys: one matmul for them
        qg = q.view(self.groups, self.group, kv_heads, rep, dim).transpose(1, 2)
        qg = qg.reshape(self.groups, kv_heads, self.group * rep, dim)
        scores_p = (qg @ kp.transpose(-1, -2)) * scale + self.prompt_bias  # [groups, H_kv, group x rep, width]
        scores_p = scores_p.view(self.groups, kv_heads, self.group, rep, width).transpose(1, 2)
        scores_n = (q @ kn.transpose(-1, -2)) * scale  # [B, H_kv, rep, new]
        scores_n = scores_n.masked_fill(self.columns > step, float("-inf"))
        scores = torch.cat([scores_p.reshape(batch, kv_heads, rep, width), scores_n], -1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kn.dtype)
        probs_p = probs[..., :width].reshape(self.groups, self.group, kv_heads, rep, width).transpose(1, 2)
        out = (probs_p.reshape(self.groups, kv_heads, self.group * rep, width) @ vp)
        out = out.view(self.groups, kv_heads, self.group, rep, dim).transpose(1, 2).reshape(batch, kv_heads, rep, dim)
        out = out + probs[..., width:] @ vn
        return out.reshape(batch, 1, heads * dim)


class GPT2Decoder(PreallocatedDecoder):
    """Plain GPT-2: learned absolute positions, one fused q/k/v projection, LayerNorm, GELU MLP."""

    @staticmethod
    def fits(model) -> bool:
        c = model.config
        return (c.model_type == "gpt2" and c.scale_attn_weights and not c.scale_attn_by_inverse_layer_idx
                and not c.reorder_and_upcast_attn and not c.add_cross_attention)

    def __init__(self, model, *args, **kwargs):
        t = model.transformer
        self.t, self.heads = t, model.config.n_head
        self.layers = [(b, b.ln_1, b.attn.c_proj, b.ln_2, b.attn.scaling) for b in t.h]
        self.final_norm = t.ln_f
        super().__init__(model, *args, **kwargs)

    def _embed(self, token, position):
        return self.t.wte(token[:, None]) + self.t.wpe(position), None

    def _qkv(self, block, h, _):
        q, k, v = block.attn.c_attn(h).view(h.shape[0], 1, 3, self.heads, -1).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class LlamaDecoder(PreallocatedDecoder):
    """Llama-family models: rotary positions from the model's rotary module, grouped-query attention
    (q/k/v biases, as Qwen2 has, are in its modules), RMSNorm, gated MLP."""

    MODEL_TYPES = ("llama", "qwen2", "mistral")
    # rotary variants whose frequencies do not depend on the sequence length ("dynamic" and "longrope"
    # change them with it, which the prefill and the decode steps would then see differently)
    ROPE_TYPES = ("default", "linear", "llama3", "yarn")

    @staticmethod
    def fits(model) -> bool:
        c = model.config
        rope = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
        layer_types = getattr(c, "layer_types", None) or ["full_attention"]
        m = getattr(model, "model", None)
        return (c.model_type in LlamaDecoder.MODEL_TYPES and rope in LlamaDecoder.ROPE_TYPES
                and getattr(c, "sliding_window", None) is None and set(layer_types) == {"full_attention"}
                and hasattr(m, "rotary_emb") and hasattr(model, "lm_head"))

    def __init__(self, model, *args, **kwargs):
        m = model.model
        self.m, self.heads = m, model.config.num_attention_heads
        # the model's own rotation (each family's modeling file has it), so q and k are rotated as in training
        self.apply_rotary = sys.modules[type(m.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.layers = [(l, l.input_layernorm, l.self_attn.o_proj, l.post_attention_layernorm, l.self_attn.scaling)
                       for l in m.layers]
        self.final_norm = m.norm
        super().__init__(model, *args, **kwargs)

    def _embed(self, token, position):
        x = self.m.embed_tokens(token[:, None])
        return x, self.m.rotary_emb(x, position)

    def _qkv(self, layer, h, rotary):
        attn, batch = layer.self_attn, h.shape[0]
        q = attn.q_proj(h).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
        q, k = self.apply_rotary(q, k, *rotary)
        return q, k, v


class HFDecoder:
    """One-token decode steps through the model's own forward and its DynamicCache (any architecture).
    Its cache grows every step, so it runs eagerly whatever `compile` says."""

    def __init__(self, model, cache, inverse, prompt_mask, max_new_tokens: int, compile: bool = False):
        cache.batch_select_indices(inverse)  # one row per completion, in the batch's order
        self.model, self.cache = model, cache
        self.attention = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], max_new_tokens)], 1)
        self.width = prompt_mask.shape[1]
        self.position = prompt_mask.sum(-1, keepdim=True)

    def __call__(self, token, step: int):
        out = self.model(input_ids=token[:, None], attention_mask=self.attention[:, :self.width + step + 1],
                         position_ids=self.position + step, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]


def decoder_for(model, cache, inverse, prompt_mask, max_new_tokens: int, compile: bool = False):
    """The fastest decoder that fits the model: GPT2Decoder, LlamaDecoder, else HFDecoder."""
    cls = next((c for c in (GPT2Decoder, LlamaDecoder) if c.fits(model)), HFDecoder)
    return cls(model, cache, inverse, prompt_mask, max_new_tokens, compile=compile)
