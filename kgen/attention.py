"""Attention in a Dynamo graph as PyTorch's one fused call for it (``F.scaled_dot_product_attention``).

Written out, attention materializes its [..., T, S] weights several times (the product, its scale, the mask,
the softmax, the dropout), each a pass over memory that grows with the square of the sequence; PyTorch's
fused call (flash or memory-efficient attention on a GPU) never writes them. The backend rewrites two forms
before it partitions the graph; the fused call then runs as PyTorch runs it, and the projections around it
stay kgen's partitions:

- ``softmax(q @ k.transpose(-2, -1) * scale [masked_fill(causal mask, -inf)]) [dropout] @ v`` (MinGPT), where
  no other call reads the weights. A mask is taken only where it is computed from the model's buffers and
  constants alone (``self.bias[:, :, :T, :T] == 0``) and is, when the graph is compiled, exactly the causal
  mask: the call gets ``is_causal=True``. (The buffer's values are read then; a model that changes its mask
  buffer later would need a recompile.)
- ``F.multi_head_attention_forward`` (nn.MultiheadAttention) whose averaged weights nothing reads: asked
  with ``need_weights=False``, PyTorch computes it with the fused call itself.
"""
from __future__ import annotations

import inspect
import math
import operator
import re
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn.functional as F

_MATMULS = (operator.matmul, torch.matmul, torch.bmm)
_SOFTMAX = inspect.signature(F.softmax)
_DROPOUT = inspect.signature(F.dropout)
_MHA = inspect.signature(F.multi_head_attention_forward)
_MAX_MASK_NODES = 16  # a mask's own computation, evaluated at compile time, is a few calls on a buffer
_UNKNOWN = object()  # a value not known at compile time


def rewrite_attention(gm: fx.GraphModule, state: dict) -> list[str]:
    """Rewrite ``gm``'s attention in place (see the module's doc); ``state`` maps the placeholders that are
    parameters or buffers to their tensors. Returns one line per rewrite."""
    done = []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is F.multi_head_attention_forward:
            if _mha_without_weights(n):
                done.append(f"{_where(n)}: multi_head_attention_forward without its unread weights (need_weights=False)")
        elif _is_call(n, _MATMULS, "matmul"):
            line = _fused(gm, n, state)
            if line:
                done.append(line)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _where(n: fx.Node) -> str:
    """The model's source line of a call (the last frame Dynamo recorded for it: ``file.py:12``), else its name."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', n.meta.get("stack_trace") or "")
    return f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else n.name


def _is_call(n, functions, method: str) -> bool:
    return isinstance(n, fx.Node) and (n.op == "call_function" and n.target in functions
                                       or n.op == "call_method" and n.target == method)


def _only_user(n: fx.Node, of: fx.Node) -> bool:
    return list(n.users) == [of]


def _mha_without_weights(n: fx.Node) -> bool:
    if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in n.users):
        return False
    try:
        bound = _MHA.bind(*n.args, **n.kwargs)
    except TypeError:
        return False
    if bound.arguments.get("need_weights", True) is False:
        return False
    bound.arguments["need_weights"] = False
    n.args, n.kwargs = bound.args, bound.kwargs
    return True


def _softmax_input(n: fx.Node):
    """x where ``n`` is a softmax over the last dim of x (without a dtype), else None."""
    if n.op == "call_function" and n.target in (F.softmax, torch.softmax):
        try:
            b = _SOFTMAX.bind(*n.args, **n.kwargs).arguments
        except TypeError:
            return None
        x, dim, dtype = b.get("input"), b.get("dim"), b.get("dtype")
    elif n.op == "call_method" and n.target == "softmax":
        x = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        dtype = n.kwargs.get("dtype")
    else:
        return None
    rank = _rank(x)
    return x if dtype is None and isinstance(dim, int) and rank and dim % rank == rank - 1 else None


def _rank(n) -> int:
    ex = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return ex.dim() if isinstance(ex, torch.Tensor) else 0


def _transposed_last(n) -> fx.Node | None:
    """k where ``n`` is k with its last two dims swapped (``k.transpose(-2, -1)``), else None."""
    if not isinstance(n, fx.Node) or n.op not in ("call_method", "call_function"):
        return None
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    rank = _rank(n)
    if name in ("transpose", "swapaxes", "swapdims") and len(n.args) == 3 and rank >= 2:
        return n.args[0] if {n.args[1] % rank, n.args[2] % rank} == {rank - 2, rank - 1} else None
    return None


def _fused(gm: fx.GraphModule, out: fx.Node, state: dict) -> str | None:
    """``out = P @ v`` where P is attention's weights computed only for it: out replaced by the fused call."""
    probs, v = out.args[0], out.args[1] if len(out.args) > 1 else None
    if not isinstance(probs, fx.Node) or not isinstance(v, fx.Node) or not _only_user(probs, out):
        return None
    chain = [probs]
    dropout_p = 0.0
    if probs.op == "call_function" and probs.target is F.dropout:
        try:
            b = _DROPOUT.bind(*probs.args, **probs.kwargs).arguments
        except TypeError:
            return None
        if b.get("inplace", False) or not isinstance(b.get("training", True), bool):
            return None
        if b.get("training", True):
            dropout_p = b.get("p", 0.5)
        probs = b["input"]
        if not isinstance(probs, fx.Node) or not _only_user(probs, chain[-1]):
            return None
        chain.append(probs)
    scores = _softmax_input(probs)
    if not isinstance(scores, fx.Node) or not _only_user(scores, probs):
        return None
    chain.append(scores)
    causal, mask = False, None
    if scores.op == "call_method" and scores.target == "masked_fill":
        mask, fill = (scores.args[1:3] if len(scores.args) >= 3 else (None, None))
        if fill != -math.inf or not _is_causal_mask(mask, state, _shape(scores)):
            return None
        causal = True
        scores = scores.args[0]
        if not isinstance(scores, fx.Node) or not _only_user(scores, chain[-1]):
            return None
        chain.append(scores)
    scale = 1.0
    if scores.op == "call_function" and scores.target in (operator.mul, operator.truediv) and \
            isinstance(scores.args[1], float) and scores.args[1] != 0:
        scale = scores.args[1] if scores.target is operator.mul else 1.0 / scores.args[1]
        scores = scores.args[0]
        if not isinstance(scores, fx.Node) or not _only_user(scores, chain[-1]):
            return None
        chain.append(scores)
    if not _is_call(scores, _MATMULS, "matmul") or len(scores.args) != 2:
        return None
    q, kt = scores.args
    k = _transposed_last(kt)
    if k is None or not isinstance(q, fx.Node) or not (_rank(q) == _rank(k) == _rank(v) >= 3):
        return None
    if _only_user(kt, scores):
        chain.append(kt)
    with gm.graph.inserting_before(out):
        fused = gm.graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                       {"dropout_p": dropout_p, "is_causal": causal, "scale": scale})
    fused.meta.update(out.meta)
    out.replace_all_uses_with(fused)
    for n in [out] + chain:  # the written-out attention, the last call first
        if not n.users:
            gm.graph.erase_node(n)
    _erase_unread(gm, mask)
    return f"{_where(out)}: softmax(q @ k^T){' with the causal mask' if causal else ''} @ v as scaled_dot_product_attention"


def _erase_unread(gm: fx.GraphModule, n) -> None:
    """The mask's own calls (a slice of a buffer, a comparison: evaluated at compile time, so free of side
    effects), now that nothing reads them."""
    if isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and not n.users:
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        for a in inputs:
            _erase_unread(gm, a)


def _shape(n) -> tuple:
    ex = n.meta.get("example_value")
    return tuple(ex.shape) if isinstance(ex, torch.Tensor) else ()


def _is_causal_mask(mask, state: dict, scores_shape: tuple) -> bool:
    """Whether ``mask`` (True where a score is dropped) is computed from buffers and constants alone and is
    the causal mask of scores of shape [..., T, S] (True above the diagonal) at compile time."""
    value = _constant_value(mask, state, [0])
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or len(scores_shape) < 2:
        return False
    t, s = scores_shape[-2:]
    if not all(isinstance(d, int) for d in (t, s)) or value.dim() < 2 or tuple(value.shape[-2:]) != (t, s) \
            or any(d != 1 for d in value.shape[:-2]):
        return False
    causal = torch.ones(t, s, dtype=torch.bool, device=value.device).triu(1)
    return bool(torch.equal(value.reshape(t, s), causal))


def _constant_value(n, state: dict, count: list):
    """The value of ``n`` computed from the model's buffers and constants (``_UNKNOWN`` where it needs anything
    else: an input, a run-time size, more than a few calls)."""
    if isinstance(n, (tuple, list)):
        vals = [_constant_value(a, state, count) for a in n]
        return _UNKNOWN if any(v is _UNKNOWN for v in vals) else type(n)(vals)
    if isinstance(n, slice):
        parts = [_constant_value(a, state, count) for a in (n.start, n.stop, n.step)]
        return _UNKNOWN if any(v is _UNKNOWN for v in parts) else slice(*parts)
    if not isinstance(n, fx.Node):
        return _UNKNOWN if isinstance(n, torch.SymInt) else n
    if n in state:
        return state[n]
    ex = n.meta.get("example_value")
    if isinstance(ex, (int, float, bool)) and not isinstance(ex, (torch.SymInt, torch.SymFloat)):
        return ex  # a size Dynamo compiled in (the sequence length T)
    count[0] += 1
    if count[0] > _MAX_MASK_NODES or n.op not in ("call_function", "call_method") or \
            not isinstance(ex, torch.Tensor):
        return _UNKNOWN
    args = _constant_value(n.args, state, count)
    kwargs = {k: _constant_value(v, state, count) for k, v in n.kwargs.items()}
    if args is _UNKNOWN or any(v is _UNKNOWN for v in kwargs.values()):
        return _UNKNOWN
    with torch.no_grad():
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        return n.target(*args, **kwargs)

