"""The speed paths of generation, kept apart so they read as such.

generate() (grpo/rollout.py) samples one token at a time; a decoder turns the token just drawn into the
logits of the next. HFDecoder works for any causal LM through its own forward and cache. GPT2Decoder
is a fast path for plain GPT-2: the same modules and math, on preallocated K/V buffers, with a group's
prompt keys and values read once. fuse_tanh_gelu swaps GPT-2's eight-op tanh GELU for PyTorch's fused
kernel of the same function. Each is tested against the generic path (tests/core/test_decoders.py).
"""
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


class GPT2Decoder:
    """One-token decode steps for GPT-2 on preallocated K/V buffers.

    The same modules and math as GPT2Model's forward (so the logprobs match the training forward),
    without what it costs per call: no growing cache (torch.cat of every past key at every step), no
    mask building, no output objects. The rows of a group share their prompt, so its keys and values
    are kept once per group and each group's queries attend to them together: decode attention reads
    the prompt's cache once per group instead of once per row. Attention runs in the cache's dtype
    (fp32 on CPU, where bf16 matmuls are emulated; the model's bf16 on GPU). Anything that is not a
    plain GPT-2 goes through the model's own forward with a DynamicCache instead (HFDecoder).
    """

    @staticmethod
    def fits(model) -> bool:
        c = model.config
        return (c.model_type == "gpt2" and c.scale_attn_weights and not c.scale_attn_by_inverse_layer_idx
                and not c.reorder_and_upcast_attn and not c.add_cross_attention)

    def __init__(self, model, cache, inverse, prompt_mask, max_new_tokens: int):
        self.model, self.t = model, model.transformer
        batch, width = prompt_mask.shape
        n_prompts = int(inverse.max()) + 1
        per_group = inverse.view(n_prompts, -1) if batch % n_prompts == 0 else None
        if per_group is None or not (per_group == per_group[:, :1]).all():  # rows not in whole groups
            per_group = inverse.view(batch, 1)
        first = per_group[:, 0]  # prompt of each group, in batch order
        self.groups, self.group = per_group.shape
        self.heads = model.config.n_head
        dtype = torch.float32 if prompt_mask.device.type == "cpu" else cache.layers[0].keys.dtype
        self.prompt_kv = [(layer.keys[first].to(dtype), layer.values[first].to(dtype)) for layer in cache.layers]
        head_dim = self.prompt_kv[0][0].shape[-1]
        self.new_kv = [(torch.empty(batch, self.heads, max_new_tokens, head_dim, dtype=dtype, device=prompt_mask.device),
                        torch.empty(batch, self.heads, max_new_tokens, head_dim, dtype=dtype, device=prompt_mask.device))
                       for _ in cache.layers]
        # additive mask over each group's prompt columns: -inf on left padding
        pad = prompt_mask[::self.group]
        self.prompt_bias = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill(pad == 0, float("-inf"))
        self.prompt_bias = self.prompt_bias[:, None, None, :]  # [groups, 1, 1, width]
        self.position = prompt_mask.sum(-1, keepdim=True)  # each row's first new token
        self.device_type = prompt_mask.device.type

    def _attend(self, q, layer: int, step: int, scale: float):
        """Softmax attention of q [B, H, 1, D] over its group's prompt and its own new tokens."""
        (kp, vp), (kn, vn) = self.prompt_kv[layer], self.new_kv[layer]
        batch, heads, _, dim = q.shape
        qg = q.view(self.groups, self.group, heads, dim).transpose(1, 2)  # [groups, H, group, D]
        scores_p = (qg @ kp.transpose(-1, -2)) * scale + self.prompt_bias  # [groups, H, group, width]
        scores_n = (q @ kn[:, :, :step + 1].transpose(-1, -2)) * scale  # [B, H, 1, new]
        width = scores_p.shape[-1]
        scores_p = scores_p.transpose(1, 2).reshape(batch, heads, 1, width)
        probs = torch.softmax(torch.cat([scores_p, scores_n], -1), dim=-1, dtype=torch.float32).to(vn.dtype)
        probs_p = probs[..., :width].reshape(self.groups, self.group, heads, width).transpose(1, 2)
        out = (probs_p @ vp).transpose(1, 2).reshape(batch, heads, 1, dim)
        return out + probs[..., width:] @ vn[:, :, :step + 1]

    def __call__(self, token, step: int):
        t = self.t
        x = t.wte(token[:, None]) + t.wpe(self.position + step)
        batch = x.shape[0]
        for i, block in enumerate(t.h):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(x)).view(batch, 1, 3, self.heads, -1).unbind(2)
            kn, vn = self.new_kv[i]
            kn[:, :, step], vn[:, :, step] = k[:, 0], v[:, 0]
            with torch.autocast(self.device_type, enabled=False):
                y = self._attend(q.transpose(1, 2).to(kn.dtype), i, step, attn.scaling)
            x = x + attn.c_proj(y.transpose(1, 2).reshape(batch, 1, -1))
            x = x + block.mlp(block.ln_2(x))
        return self.model.lm_head(t.ln_f(x))[:, -1]


class HFDecoder:
    """One-token decode steps through the model's own forward and its DynamicCache (any architecture)."""

    def __init__(self, model, cache, inverse, prompt_mask, max_new_tokens: int):
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


def decoder_for(model, cache, inverse, prompt_mask, max_new_tokens: int):
    """The fastest decoder that fits the model: GPT2Decoder for plain GPT-2, else HFDecoder."""
    cls = GPT2Decoder if GPT2Decoder.fits(model) else HFDecoder
    return cls(model, cache, inverse, prompt_mask, max_new_tokens)
