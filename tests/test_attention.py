"""Attention written out in a Dynamo graph rewritten as F.scaled_dot_product_attention (kgen/attention.py):
which graphs are rewritten, which are left alone, and that the rewritten graph computes what the model does."""
from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kgen.attention import rewrite_attention


class CausalAttention(nn.Module):
    """MinGPT's attention (KernelBench level 3 #43) in small; ``mask`` picks the buffer it masks with."""

    def __init__(self, mask: str = "causal", read_weights: bool = False, dropout: float = 0.0):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(16, 48), nn.Linear(16, 16), 2
        self.read_weights, self.dropout = read_weights, nn.Dropout(dropout)
        ones = torch.ones(12, 12)
        bias = {"causal": ones.tril(), "banded": ones.tril() - ones.tril(-3), "none": ones}[mask]
        self.register_buffer("bias", bias.view(1, 1, 12, 12))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        y = self.proj(y)
        return (y, att.sum(-1)) if self.read_weights else y


class Plain(nn.Module):
    """Attention without a mask, the scale a division (``q @ k^T / sqrt(d)``), the softmax a method."""

    def forward(self, q, k, v):
        return (q @ k.transpose(-1, -2) / 4.0).softmax(-1) @ v


class VisionAttention(nn.Module):
    """nn.MultiheadAttention whose weights the caller drops or returns (KernelBench level 3 #31)."""

    def __init__(self, return_weights: bool = False):
        super().__init__()
        self.attn, self.return_weights = nn.MultiheadAttention(16, 2), return_weights

    def forward(self, x):
        out, w = self.attn(x, x, x)
        return (out, w) if self.return_weights else out


def _rewritten(model, *inputs) -> tuple[list[str], list]:
    """What rewrite_attention does to ``model``'s Dynamo graph, and the rewritten graph's targets; the compiled
    model (running the rewritten graph) equals eager on ``inputs``."""
    lines, targets = [], []

    def backend(gm, example_inputs):
        places = [n for n in gm.graph.nodes if n.op == "placeholder"]
        state = {n: t for n, t in zip(places, example_inputs)
                 if isinstance(t, torch.Tensor) and "self" in n.name.lower()}
        lines.extend(rewrite_attention(gm, state))
        targets.extend(n.target for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(*inputs)
        want = model(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return lines, targets


def test_causal_attention_is_the_fused_call_with_is_causal():
    torch.manual_seed(0)
    lines, targets = _rewritten(CausalAttention().eval(), torch.randn(3, 12, 16))
    assert len(lines) == 1 and "causal mask" in lines[0], lines
    line = next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if "y = (att @ v)" in t)
    assert lines[0].startswith(f"test_attention.py:{line}: "), lines  # the model's line that ends the attention
    assert F.scaled_dot_product_attention in targets and F.softmax not in targets and "masked_fill" not in targets
    assert operator.eq not in targets  # the mask's comparison is gone with it


def test_a_shorter_sequence_slices_the_mask_buffer_and_is_still_causal():
    torch.manual_seed(0)
    lines, _ = _rewritten(CausalAttention().eval(), torch.randn(2, 7, 16))
    assert len(lines) == 1 and "causal mask" in lines[0], lines


@pytest.mark.parametrize("mask", ["banded", "none"])
def test_a_mask_that_is_not_causal_is_left_written_out(mask):
    """A banded mask, or one that masks nothing: the graph keeps its softmax (the rewrite takes the causal mask
    only)."""
    torch.manual_seed(0)
    lines, targets = _rewritten(CausalAttention(mask).eval(), torch.randn(2, 12, 16))
    assert lines == [] and F.softmax in targets


def test_weights_read_elsewhere_are_left_written_out():
    torch.manual_seed(0)
    lines, targets = _rewritten(CausalAttention(read_weights=True).eval(), torch.randn(2, 12, 16))
    assert lines == [] and F.scaled_dot_product_attention not in targets


def test_unmasked_attention_with_a_divided_scale():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 5)
    lines, targets = _rewritten(Plain(), q, k, v)
    assert len(lines) == 1 and "causal" not in lines[0] and F.scaled_dot_product_attention in targets, lines


def test_dropout_in_training_mode_becomes_the_fused_calls_dropout():
    """Dropout of the weights in training mode is the fused call's dropout_p (random either way: the graph is
    checked for the call's argument, and at p = 0 for the values)."""
    captured = {}

    def backend(gm, example_inputs):
        places = [n for n in gm.graph.nodes if n.op == "placeholder"]
        state = {n: t for n, t in zip(places, example_inputs) if "self" in n.name.lower()}
        rewrite_attention(gm, state)
        captured["sdpa"] = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
        return gm.forward

    torch._dynamo.reset()
    torch.compile(CausalAttention(dropout=0.25).train(), backend=backend, dynamic=False)(torch.randn(2, 12, 16))
    (sdpa,) = captured["sdpa"]
    p = sdpa.kwargs["dropout_p"]
    assert p == 0.25 or (hasattr(p, "meta") and p.meta.get("example_value") == 0.25), sdpa.kwargs


def test_multihead_attention_whose_weights_are_dropped_is_asked_without_them():
    torch.manual_seed(0)
    x = torch.randn(6, 2, 16)
    lines, _ = _rewritten(VisionAttention().eval(), x)
    assert len(lines) == 1 and "need_weights=False" in lines[0], lines
    lines, _ = _rewritten(VisionAttention(return_weights=True).eval(), x)
    assert lines == []
