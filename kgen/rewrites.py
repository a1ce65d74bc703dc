"""Algebraic rewrites of a pipeline, each with its side conditions.

Every pass looks at the op chain, and at each site where its pattern appears
either fires or records why not; ``kgen explain`` prints those decisions. A
rewrite never changes the output type (``Pipeline.with_ops`` asserts it), and
each one is tested in float64 against the unrewritten pipeline.

Exactness, beyond real arithmetic: every rewrite here keeps NaN propagation
(a NaN input reaches exactly the outputs it reached before). Pool composition,
scalar-through-max and dead-region elimination are exact in floating point too.
Folding an average pool into the weights, moving factors and offsets past it,
and the reduction algebra change the rounding (within float32 accuracy) and how +-inf inputs combine (inf - inf in
the original sum can become +-inf times a folded weight); the sub-pixel form
multiplies exactly the products the transposed convolution does.

In a 16-bit plan eager rounds every op's result to the dtype (``Pipeline.rounds_between_ops``), and
the plan rounds where eager does (kgen.plan.rounding_points). The rewrites that keep those rounding
points run there (``KEEPS_ROUNDING``: rounding is monotone, so a max commutes with it and with a
positive scale; a crop or a sub-pixel phase computes the same rounded values). The others skip
roundings eager does: the result is then closer to the exact one than eager's, by less than a unit of
the dtype, well inside KernelBench's 1e-2 check against eager, unless a later op amplifies eager's
rounding (ops.AMPLIFYING: a norm or an exponential; x + 6 before a group norm in bfloat16 puts eager
4e-2 off float64), so they run only in pipelines without one, or where the spec's
``intermediates: float32`` asks for float32 between ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import SpecError
from .ir import (BatchNorm, BatchStats, Capture, Conv, DerivedTensor, Dropout, Elementwise, Linear, Matmul, Norm, Op, Permute, Pipeline, Pool,
                 Reduce, Reshape, Slice, Expand, Softmax,
                 TensorArg, TensorType, infer_types)
from .lowering import Direct, Folded, LoweredConv, PooledProduct, Subpixel, TapSums, lowered
from .ops import AMPLIFYING

# How much of a convolution's output must be dead before the dead-region pass
# crops it: cropping copies the input once, which a sliver does not pay for.
DEAD_REGION_MIN_FRACTION = 0.05

# Rewrites whose value depends on the sizes: where their side conditions hold
# they are candidates, and the plan chooses (``fire``; kgen.plan), measured by
# `kgen tune` or estimated by the cost model. A tiny strided transposed
# convolution is faster as one cuDNN call than as stride^d phase calls; folding
# and cropping cost a weight transform or an input copy.
TUNABLE = ("avg_pool_folding", "subpixel_conv_transpose", "dead_region", "batch_stats_pass")
NOT_CHOSEN = "not chosen: the plan computes it without this rewrite (kgen explain: choices)"
# The rewrites that compute the values eager rounds, rounded where eager rounds them (module docstring);
# pool_composition only for max pools (a mean of rounded means is not the rounded mean).
KEEPS_ROUNDING = ("scalar_through_max", "pool_composition", "subpixel_conv_transpose", "dead_region", "softmax_through_reshape",
                  "commute_operand_chain", "permute_before_elementwise",
                  "dropout_of_zero")


# Where training mode's batch norms run as eager's calls for eager's bits (Pipeline.eager_batch_norms), the rewrites
# that keep every value's bits: the same operations on the same values (a max commutes with a positive scale and
# with itself; dropout of zero is x). The others change a value's last bit (a folded weight, a mean of means, a
# sum in another order) or a convolution's call (sub-pixel phases, a cropped input: another cuDNN kernel), which
# the next TF32 convolution and norm amplify: DenseNet's transition folded its pool into the convolution and
# failed KernelBench's 1e-4 check against eager.
KEEPS_BITS = ("scalar_through_max", "pool_composition", "softmax_through_reshape", "commute_operand_chain",
              "permute_before_elementwise", "dropout_of_zero")


def rounding_amplifier(pipe: Pipeline) -> Op | None:
    """The first op whose input must hold eager's values: in a 16-bit plan the first that amplifies eager's
    roundings between ops (module docstring), in a float32 plan whose batch norms run as eager's calls the first
    batch norm; then the rewrites outside KEEPS_ROUNDING (KEEPS_BITS) do not run. None where they may (float32
    intermediates, or no such op)."""
    if pipe.eager_batch_norms:
        return next(op for op in pipe.ops if isinstance(op, BatchNorm))
    if not pipe.rounds_between_ops:
        return None
    return next((op for op in pipe.ops if op.op_name in AMPLIFYING), None)


def keeps_eager_values(pipe: Pipeline, rewrite: str) -> bool:
    """Whether ``rewrite`` leaves the values that rounding_amplifier's op needs as eager computes them."""
    return rewrite in (KEEPS_BITS if pipe.eager_batch_norms else KEEPS_ROUNDING)


def _skips_rounding(pipe: Pipeline, amp: Op) -> str:
    if pipe.eager_batch_norms:
        return (f"training mode's batch norms run as eager's calls, on eager's bits, and it would change the bits "
                f"{amp.key} and the norms after it see (spec `intermediates: float32` allows it)")
    return (f"in {pipe.dtype} it would skip roundings to the dtype that eager does between ops, which "
            f"{amp.key} ({amp.op_name}) amplifies (spec `intermediates: float32` allows it)")


def always(rewrite: str, site: str) -> bool:
    """The default ``fire``: every tunable rewrite whose side conditions hold fires."""
    return True


@dataclass(frozen=True)
class Decision:
    rewrite: str
    site: str  # spec keys of the ops involved
    fired: bool
    reason: str


def _site(*ops: Op) -> str:
    return " + ".join(o.key for o in ops)


# ------------------------------------------------------------ pool composition


def pool_composition(pipe: Pipeline):
    """Two adjacent non-overlapping pools of one kind -> one pool with the product kernel.

    max(max) over nested non-overlapping windows is the max over the union;
    for average pools, the mean of equal-sized means is the mean. Needs stride ==
    kernel, no padding or dilation, and floor mode. The floors then always agree:
    floor(floor(L/k1)/k2) == floor(L/(k1*k2)) for positive integers.
    """
    items = list(zip(pipe.ops, pipe.types))  # (op, its input type); a merge keeps the first's
    out, decisions = [], []
    for i, (op, t_in) in enumerate(items):
        nxt = items[i + 1][0] if i + 1 < len(items) else None
        if not (isinstance(op, Pool) and isinstance(nxt, Pool)) or nxt.src is not None:
            out.append(op)
            continue
        why = None
        if op.kind != nxt.kind:
            why = f"{op.kind} pool then {nxt.kind} pool"
        elif op.kind == "avg" and (amp := rounding_amplifier(pipe)):
            why = f"the first pool's means are rounded: {_skips_rounding(pipe, amp)}"
        else:
            for p in (op, nxt):
                if not p.non_overlapping:
                    why = f"{p.key} overlaps or pads (stride {list(p.stride)}, kernel {list(p.kernel)}, padding {list(p.padding)}, ceil_mode {p.ceil_mode})"
                    break
        if why:
            decisions.append(Decision("pool_composition", _site(op, nxt), False, why))
            out.append(op)
            continue
        k = tuple(a * b for a, b in zip(op.kernel, nxt.kernel))
        merged = replace(op, kernel=k, stride=k, sources=op.sources + nxt.sources)
        decisions.append(
            Decision("pool_composition", _site(op, nxt), True, f"{op.kind}_pool k={list(op.kernel)} then k={list(nxt.kernel)} -> k={list(k)}")
        )
        items[i + 1] = (merged, t_in)  # may compose again with the pool after it
    return out, decisions


def _type_at(pipe: Pipeline, op: Op) -> TensorType:
    """Input type of ``op`` in ``pipe`` (its ``src`` value's, else the previous op's result; ops are
    compared by identity)."""
    for i, o in enumerate(pipe.ops):
        if o is op:
            return pipe.in_type(i)
    raise KeyError(op.key)


# ------------------------------------------------------------ scalar through max


def scalar_through_max(pipe: Pipeline):
    """x*c or x/c, then a max (pool or reduction) -> the max first, then the scalar.

    Multiplying by c > 0 is monotone, so it commutes with max, bit for bit
    (rounding is monotone too). For c < 0 it would turn max into min; c = 0
    would map inf to NaN. The max then reads the convolution directly and the
    scalar runs on the (fewer) pooled values.
    """
    ops, decisions, changed = list(pipe.ops), [], True
    while changed:
        changed = False
        for i in range(len(ops) - 1):
            a, b = ops[i], ops[i + 1]
            if not (isinstance(a, Elementwise) and a.fn in ("mul", "div") and a.param is None and a.plain):
                continue
            if not ((isinstance(b, Pool) and b.kind == "max") or (isinstance(b, Reduce) and b.fn == "max")) or b.src:
                continue
            if a.scalar > 0:
                ops[i], ops[i + 1] = b, a
                decisions.append(Decision("scalar_through_max", _site(a, b), True, f"{a.describe()} moved after the max ({a.scalar:g} > 0)"))
                changed = True
                break
            decisions.append(
                Decision("scalar_through_max", _site(a, b), False, f"scalar {a.scalar:g} is not positive: max(c*x) != c*max(x)")
            )
    return ops, _dedupe(decisions)


def _dedupe(decisions):
    seen, out = set(), []
    for d in decisions:
        if (d.rewrite, d.site, d.fired) not in seen:
            seen.add((d.rewrite, d.site, d.fired))
            out.append(d)
    return out


# ------------------------------------------------------------ dropout of zero


def dropout_of_zero(pipe: Pipeline):
    """A dropout with p = 0 is the identity in both modes: gone, so that what it passes on is the op before it's
    output (DenseNet's layers end in one: their new features, written by a convolution, then feed the
    concatenation straight)."""
    ops, decisions = [], []
    for op in pipe.ops:
        if isinstance(op, Dropout) and op.p == 0 and op.src is None and len(pipe.ops) > 1:
            decisions.append(Decision("dropout_of_zero", op.key, True, "p = 0: the identity in both modes"))
        else:
            ops.append(op)
    return ops, decisions


# ------------------------------------------------------------ softmax through reshape


def softmax_through_reshape(pipe: Pipeline):
    """A reshape merging consecutive dims into one, a softmax (or log_softmax) over that dim and the reshape back
    -> the softmax over those dims taken as one (``Softmax.spanned``). The same values, without the two views
    between the softmax and the ops around it, which then fuse with it in one stage (KernelBench #38: a bias and a
    clamp before it, a scale after it: three passes over the tensor and ATen's softmax became one stage)."""
    ops, decisions, i = [], [], 0
    while i < len(pipe.ops):
        a, b, c = (tuple(pipe.ops[i:i + 3]) + (None, None))[:3]
        if not (isinstance(a, Reshape) and isinstance(b, Softmax) and isinstance(c, Reshape)) or b.spanned \
                or b.src is not None or c.src is not None:
            ops.append(a)
            i += 1
            continue
        t = pipe.in_type(i).shape
        k, m = b.dim, len(t) - len(a.shape)  # the merged dims: k .. k + m - 1 of the input
        merged = k >= 1 and m >= 1 and (t[0],) + tuple(a.shape) == t[:k] + (math.prod(t[k:k + m]),) + t[k + m:]
        if not merged or tuple(c.shape) != tuple(t[1:]):
            decisions.append(Decision("softmax_through_reshape", _site(a, b, c), False,
                                      f"{a.describe()} does not merge the dims {b.describe()} normalizes, or "
                                      f"{c.describe()} does not restore them"))
            ops.append(a)
            i += 1
            continue
        ops.append(replace(b, src=a.src, spanned=tuple(t[k:k + m])))
        decisions.append(Decision("softmax_through_reshape", _site(a, b, c), True,
                                  f"{b.describe()} of {a.describe()} is {ops[-1].describe()} of its input"))
        i += 3
    return ops, decisions


# ------------------------------------------------------------ elementwise chains across permutes


VIEWS = (Permute, Slice, Expand, Reshape)  # ops ATen may compute as a view of their input (kgen.plan)


def _value_readers(ops, name: str) -> set[int]:
    """The ops that read value ``name``: by name (``from:``, ``tensor:``), and the op right after its capture
    where that op continues from it (no ``from:``)."""
    out = {j for j, op in enumerate(ops) if op.src == name or name in op.value_names()}
    out |= {c + 1 for c, op in enumerate(ops) if isinstance(op, Capture) and op.name == name
            and c + 1 < len(ops) and ops[c + 1].src is None}
    return out


def _capture_of(ops, name: str, before: int) -> int | None:
    """The index of the capture (``as:``) naming value ``name`` among ops[:before]; None for an input."""
    return next((i for i in range(before) if isinstance(ops[i], Capture) and ops[i].name == name), None)


def _chain_before(ops, end: int) -> int | None:
    """The first index of the elementwise chain ending at ``end`` (inclusive): back over elementwise ops and
    captures that continue from the op before them, to the one that starts from a value (``from:``) or follows an
    op of another kind; None where ``end`` is no elementwise op."""
    if end < 0 or not isinstance(ops[end], Elementwise):
        return None
    a = end
    while a > 0 and ops[a].src is None and isinstance(ops[a - 1], Elementwise):
        a -= 1
    return a


def _elementwise_result(ops, i: int) -> bool:
    """Whether ops[i] is an elementwise op, or a permute of an elementwise op's result (which
    permute_before_elementwise moves the permute before): a chain continuing from it fuses with it."""
    op = ops[i]
    if isinstance(op, Permute):
        if op.src is None:
            return i > 0 and _elementwise_result(ops, i - 1)
        c = _capture_of(ops, op.src, i)
        return c is not None and c > 0 and _elementwise_result(ops, c - 1)
    return isinstance(op, Elementwise) and not isinstance(op, Capture)


def commute_operand_chain(pipe: Pipeline):
    """``f(x, t)`` (``tensor: t``) where only f reads t, t has f's result's shape (x broadcasts to it) and the op
    computing t is elementwise (or a permute) -> ``f(t, x)`` continuing from t (``reverse`` toggled, x the
    operand): the ops computing t and f in one stage, t never written. Where t was computed earlier, its chain (the
    ops from the last one that starts from a value) moves to just before f, and x, where f continued from the op
    before it, is named there: only where that op is no elementwise one (its result is a tensor either way). Mamba2's
    ``C B^T * exp(segsum)`` wrote the exponential and read it back (1.07 GB at the H200's batch); NetVLAD's
    ``(x^T a)^T - a_sum * clusters`` wrote the broadcast product (134 MB). Exact: the same operations on the same
    values."""
    ops, decisions = list(pipe.ops), []
    taken = set(pipe.values)
    types = pipe.types  # (inferred again after each rewrite here)
    commuted = set()  # (an op commuted once is not turned back)
    k = 0
    while k < len(ops):
        op = ops[k]
        c = _capture_of(ops, op.tensor, k) \
            if isinstance(op, Elementwise) and not isinstance(op, Capture) and op.tensor and op.key not in commuted else None
        if c is None or c == 0:
            k += 1
            continue
        t, x = op.tensor, op.src
        a = max((i for i in range(c) if ops[i].src is not None), default=0)  # t's chain: ops[a:c]
        why = None
        if x == t or (x is None and c == k - 1):  # (with no `from:`, f continues from the capture: t itself)
            why = f"{t} is both of its operands"
        elif not op.entry.reversible:
            why = f"{op.fn} takes no reversed operand"
        elif not _elementwise_result(ops, c - 1):
            why = f"{t} is computed by {ops[c - 1].describe()}, a stage of its own either way"
        elif _value_readers(ops, t) != {k} or t in pipe.outputs:
            why = f"{t} is read by other ops too (or returned)"
        elif (tt := types[c + 1]) != (result := types[k + 1]):
            why = f"{t} {tt} broadcasts to the result {result}"
        elif c < k - 1 and not all(isinstance(o, (Elementwise, Reduce) + VIEWS) for o in ops[a:c]):
            why = f"the chain computing {t} has ops other than elementwise ones, views and reductions: it stays in place"
        elif c < k - 1 and x is None and isinstance(ops[k - 1], Elementwise):
            why = f"{op.describe()} continues an elementwise chain: x would be written where it is a register"
        elif c < k - 1 and any(isinstance(o, Capture) and (o.name in pipe.outputs or not _value_readers(ops, o.name) <= set(range(a, c)))
                               for o in ops[a:c]):
            why = f"a value named in the chain computing {t} is read before {op.describe()}"
        if why:
            decisions.append(Decision("commute_operand_chain", op.key, False, why))
            k += 1
            continue
        if x is None:  # f continued from the op before it, whose result is a tensor: named for f's operand
            x = _fresh(f"{op.fn}_operand", taken)
            named = [Capture(key=f"{op.key}.operand", name=x)]
        else:
            named = []
        chain = list(ops[a:c])
        if chain[0].src is None:  # the first op of all: it reads the input
            chain[0] = replace(chain[0], src=pipe.input_names[0])
        ops[a:k + 1] = ops[c + 1:k] + named + chain + [replace(op, src=None, tensor=x, reverse=not op.reverse)]
        types = infer_types(pipe.input, ops, pipe.path, pipe.inputs)[0]
        commuted.add(op.key)
        decisions.append(Decision("commute_operand_chain", op.key, True,
                                  f"{op.describe()} continues from {t}, which only it reads; {x} is the operand"))
    return ops, decisions


def _fresh(name: str, taken: set) -> str:
    out, i = name, 1
    while out in taken:
        out, i = f"{name}_{i}", i + 1
    taken.add(out)
    return out


def _param_stays(pipe: Pipeline, e: Elementwise, p: Permute) -> bool:
    """Whether ``e``'s parameter broadcasts along every dim the permute ``p`` moves (Mamba2's [T, T] mask over the
    last two dims, a permute of the dims before them): the op reads it alike before and after the permute."""
    if e.param_sum_dims:
        return False
    aligned = _aligned_param_shape(pipe, e, len(p.dims))
    return all(aligned[d] == 1 for d, k in enumerate(p.dims) if d != k)


def permute_before_elementwise(pipe: Pipeline):
    """A permute between an elementwise chain and the elementwise op that continues from it -> the permute first,
    of the chain's source, and the chain after it (each tensor operand permuted the same way, as a view): the
    chain and the op after the permute in one stage reading the permuted source in place, where the chain's
    result was written, then read through the permute. Elementwise ops commute with a permutation of their
    coordinates, so the values are the same (Mamba2: ``exp`` of the segment sums before the transpose its product
    reads; a product before the transpose the sum after it reads, 1.07 GB each at the H200's batch)."""
    ops, decisions = list(pipe.ops), []
    taken = set(pipe.values)
    j = 0
    while j < len(ops):
        p = ops[j]
        nxt = ops[j + 1] if j + 1 < len(ops) else None
        if not (isinstance(p, Permute) and isinstance(nxt, Elementwise) and not isinstance(nxt, Capture)
                and nxt.src is None):
            j += 1
            continue
        if p.src is None:  # the chain ends right before it
            c, end = None, j - 1
        else:  # it starts from a value the chain's last capture names
            c = _capture_of(ops, p.src, j)
            end = c - 1 if c is not None else -1
        a = _chain_before(ops, end)
        why = None
        if a is None or all(isinstance(o, Capture) for o in ops[a:end + 1]):
            why = "no elementwise chain computes its input"
        elif c is not None and (_value_readers(ops, p.src) != {j} or p.src in pipe.outputs):
            why = f"{p.src} is read by other ops too (or returned)"
        elif c is not None and ops[a].src is None and not (a and isinstance(ops[a - 1], VIEWS) and ops[a - 1].src):
            why = "its chain continues from an unnamed result elsewhere"
        elif any(o.register or o.param is not None and not _param_stays(pipe, o, p) for o in ops[a:end + 1]):
            why = "an op of the chain reads a parameter along dims the permute moves"
        elif any(isinstance(o, Capture) and (o.name in pipe.outputs or not _value_readers(ops, o.name) <= set(range(a, end + 1)))
                 for o in ops[a:end + 1]):
            why = "a value named inside the chain is read after it"
        if why:
            decisions.append(Decision("permute_before_elementwise", p.key, False, why))
            j += 1
            continue
        # a chain continuing from a view of a named value (Mamba2's expand of the cumulative sums): the view moves
        # with it, to just before the permute, which then continues from it (a view of a view, read in place)
        view = a - 1 if ops[a].src is None and a and isinstance(ops[a - 1], VIEWS) and ops[a - 1].src else None
        chain, made, permuted = list(ops[a:end + 1]), [], {}
        inside = {o.name for o in chain if isinstance(o, Capture)}  # computed permuted by the moved chain itself
        for o in chain:
            if not isinstance(o, Capture) and o.tensor and o.tensor not in inside | set(permuted):
                permuted[o.tensor] = _fresh(f"{o.tensor}_permuted", taken)
                made += [replace(p, src=o.tensor), Capture(key=f"{p.key}.operand", name=permuted[o.tensor])]
        source = chain[0].src
        between = ops[c + 1:j] if c is not None else []
        moved = [replace(o, src=None, tensor=permuted.get(o.tensor, o.tensor)) if not isinstance(o, Capture) else o
                 for o in chain]
        moved[0] = replace(moved[0], src=None)
        if view is not None:  # the permute continues from the view, moved with the chain
            start, head, what = view, [ops[view], replace(p, src=None)], f"{p.describe()} of {ops[view].describe()}"
        else:
            if source is None and made and a and isinstance(ops[a - 1], VIEWS):
                decisions.append(Decision("permute_before_elementwise", p.key, False,
                                          f"its chain continues from {ops[a - 1].describe()}, a view its operands' "
                                          "permutes would make a copy of"))
                j += 1
                continue
            if source is None and made:  # the chain continues from the op before it: named there, a tensor already
                source = pipe.input_names[0] if a == 0 else _fresh("permute_source", taken)
                made[:0] = [Capture(key=f"{p.key}.source", name=source)] if a else []
            start, head, what = a, [replace(p, src=source)], p.describe()
        ops[start:j + 1] = between + made + head + moved
        decisions.append(Decision("permute_before_elementwise", p.key, True,
                                  f"{what} before {', '.join(o.describe() for o in chain if not isinstance(o, Capture))}, "
                                  f"which then fuse with {nxt.describe()}"))
        j = start + len(between) + len(made) + len(head) + len(moved)
    return ops, decisions


# ------------------------------------------------------------ avg pool folding


def avg_pool_folding(pipe: Pipeline, fire=always):
    """conv then avg_pool -> one ordinary conv with box-filtered weights (lowering.Folded).

    Average pooling is linear, so pool(conv(x, w) + b) = conv'(x, box * w) + b.
    Forward: kernel (Kp-1)*s + K, stride s*sp. Transposed with stride s: a
    convolution with stride Kp/s, when every pool window holds whole stride periods
    (Kp a multiple of s, stride Kp) -- the 1 GB output of a 3 -> 16 channel
    ConvTranspose3d is then never computed, only its pooled eighth. Needs the pool
    right after the convolution (affine_through_pooling moves scalar and
    per-channel factors and offsets out of the way), no dilation, and a pool
    without padding or ceil mode (partial windows would change the divisor).
    """
    ops, decisions = list(pipe.ops), []
    for i, op in enumerate(ops):
        lc = lowered(op)
        if lc is None:
            continue
        conv = lc.conv
        j = i + 1
        while j < len(ops) and isinstance(ops[j], Elementwise):
            j += 1
        if j >= len(ops) or not (isinstance(ops[j], Pool) and ops[j].kind == "avg"):
            continue
        pool = ops[j]
        why = None
        if pool.src is not None:
            continue
        if j != i + 1:
            why = f"{ops[i + 1].describe()} between the convolution and the pool"
        elif isinstance(op, LoweredConv):
            why = f"convolution is already {lc.lowering.name}"
        elif any(d != 1 for d in conv.dilation):
            why = f"dilated convolution (dilation {list(conv.dilation)})"
        elif any(pool.padding):
            why = f"pool pads (padding {list(pool.padding)})"
        elif pool.ceil_mode:
            why = "pool uses ceil_mode"
        elif conv.transposed:
            why = _transposed_fold_obstacle(conv, pool)
        crop = None
        if why is None:
            folded = LoweredConv(key=conv.key, src=op.src, conv=conv, lowering=Folded(pool.kernel, pool.stride))
            got, want = folded.infer(_type_at(pipe, op)).spatial, pipe.types[j + 1].spatial
            if any(g < w for g, w in zip(got, want)) or (got != want and not conv.transposed):
                why = f"folded output size {list(got)} differs from the pool's {list(want)}"
            elif got != want:
                crop = want  # the folded transposed convolution's last rows are past the floor-mode windows
        if why is None and not fire("avg_pool_folding", _site(op, pool)):
            why = NOT_CHOSEN
        if why:
            decisions.append(Decision("avg_pool_folding", _site(op, pool), False, why))
            continue
        folded = replace(folded, crop=crop)
        what = "transposed kernel" if conv.transposed else "kernel"
        decisions.append(
            Decision(
                "avg_pool_folding",
                _site(op, pool),
                True,
                f"{what} {list(conv.kernel)} stride {list(conv.stride)} + avg_pool {list(pool.kernel)} -> kernel {list(folded.kernel)} stride {list(folded.stride)}"
                + (f" padding {list(folded.padding)}" if conv.transposed and any(folded.padding) else ""),
            )
        )
        ops[i], ops[j] = folded, None
    return [o for o in ops if o is not None], decisions


def _transposed_fold_obstacle(conv: Conv, pool: Pool) -> str | None:
    """Why an average pool does not fold into a transposed convolution (None: it does)."""
    if conv.groups != 1:
        return f"transposed convolution with groups={conv.groups}"
    if tuple(pool.stride) != tuple(pool.kernel):
        return f"pool stride {list(pool.stride)} differs from its kernel {list(pool.kernel)} after a transposed convolution"
    if any(kp % s for kp, s in zip(pool.kernel, conv.stride)):
        return f"pool kernel {list(pool.kernel)} is not a multiple of the transposed convolution's stride {list(conv.stride)}"
    if any(p > k - 1 for p, k in zip(conv.padding, conv.kernel)):
        return f"transposed convolution's padding {list(conv.padding)} reaches past its kernel {list(conv.kernel)}"
    return None


# ------------------------------------------------------------ batch statistics in a pass of their own


def batch_stats_pass(pipe: Pipeline, fire=always):
    """transposed conv, batch statistics, the norm's affine, an average pool -> the convolution once
    for the statistics alone, then again from the same input for the ops after them.

    Training mode's batch norm needs every value of the convolution for its statistics, but an
    average pool after the norm needs only their window means: the affine moves after the pool
    (affine_through_pooling) and the pool folds into the convolution (avg_pool_folding), so the
    convolution's full output is never written. The statistics come from a pass of the convolution
    that stores nothing (its kernel gathers each tile's moments: conv_gemm, gathers_statistics).
    KernelBench #72: a 1 GB output written and read back against a second small convolution.

    Transposed convolutions only: eager's cuDNN call for one rounds its TF32 operands ties to even
    (lab tf32_lab/cudnn_rounding.py in docs/performance.md), and the folded convolution that replaces it behind the
    statistics must reproduce eager's products (conv_gemm: ConvGemmStage.eager_products). Needs the
    convolution's input to be a named value (the pipeline's input or a `from:`) that the second pass
    reads again, and an average pool without padding or ceil mode; the plan decides whether it pays.
    """
    ops, decisions = list(pipe.ops), []
    i = 0
    while i < len(ops):
        conv, i0 = ops[i], i
        i += 1
        if not (isinstance(conv, Conv) and i0 + 1 < len(ops) and isinstance(ops[i0 + 1], BatchStats)):
            continue
        stats = ops[i0 + 1]
        j = i0 + 2
        while j < len(ops) and type(ops[j]) is Elementwise and ops[j].src is None:
            j += 1
        pool = ops[j] if j < len(ops) else None
        if not (isinstance(pool, Pool) and pool.kind == "avg" and pool.src is None):
            continue
        source = conv.src if conv.src is not None else (pipe.input_names[0] if i0 == 0 else None)
        fold_obstacle = _transposed_fold_obstacle(conv, pool) if conv.transposed else None
        why = None
        if stats.src is not None:
            why = "the statistics read another value than the convolution's"
        elif not conv.transposed:
            why = "not a transposed convolution (eager's TF32 rounding is known for those)"
        elif source is None:
            why = "the convolution's input is not a named value (the second pass reads it again)"
        elif any(pool.padding) or pool.ceil_mode:
            why = f"pool pads or uses ceil_mode (padding {list(pool.padding)})"
        elif any(not e.plain or e.fn not in ("mul", "div", "add", "sub") for e in ops[i0 + 2:j]):
            why = "an op between the statistics and the pool is not a factor or an offset"
        elif fold_obstacle:
            why = fold_obstacle
        site = _site(conv, stats, pool)
        if why is None and not fire("batch_stats_pass", site):
            why = NOT_CHOSEN
        if why:
            decisions.append(Decision("batch_stats_pass", site, False, why))
            continue
        first = replace(conv, key=f"{conv.key}.for_stats")
        ops[i0:i0 + 2] = [first, stats, replace(conv, src=source)]
        decisions.append(Decision("batch_stats_pass", site, True,
                                  f"the statistics from a pass of {conv.describe()} that stores nothing; "
                                  f"the ops after them from the convolution again, on {source}"))
        i = i0 + 3
    return ops, decisions


# ------------------------------------------------------------ affine through pooling


def _aligned_param_shape(pipe: Pipeline, e: Elementwise, rank: int) -> tuple[int, ...]:
    """The shape of ``e``'s parameter as it broadcasts against a value of ``rank`` dims."""
    pshape = tuple(e.param_view or pipe.params[e.param].shape)
    return (1,) * (rank - len(pshape)) + pshape


def _pooling(op: Op, rank: int) -> str | None:
    """``op`` as a linear pooling the affine ops may pass: "mean" (an average pool, or a mean over
    spatial dims), "sum" (a sum over spatial dims); None for anything else."""
    if op.src is not None:
        return None
    if isinstance(op, Pool) and op.kind == "avg":
        return "mean"
    if isinstance(op, Reduce) and op.fn in ("sum", "mean") and all(2 <= d < rank for d in op.dims):
        return op.fn
    return None


def affine_through_pooling(pipe: Pipeline):
    """conv, x*a / x/a (/ x+b / x-b), linear pooling -> conv, pooling, the same ops.

    An average pool or a mean over spatial dims commutes with a factor or offset that is constant
    over its window (a scalar, or a parameter that varies only along the batch and channels); a sum
    over spatial dims with a factor only. The ops then run on the pooled values, and the pool can
    fold into the convolution (avg_pool_folding, sum_before_conv). Fires only right after a
    convolution, and not through a pool with padding (a zero-padded window would average the
    offset with zeros); the rounding changes within float32 accuracy, and a non-finite factor meets
    the window's mean instead of each value (inf * (1 - 1) is NaN where inf * 1 - inf * 1 was too,
    but inf * (2 + -1) is inf where the sum was NaN).
    """
    ops, decisions = list(pipe.ops), []
    for i, op in enumerate(ops):
        if lowered(op) is None:
            continue
        j = i + 1
        while j < len(ops) and isinstance(ops[j], Elementwise):
            j += 1
        rank = pipe.types[i + 1].rank
        kind = _pooling(ops[j], rank) if j < len(ops) and j > i + 1 else None
        if kind is None:
            continue
        pool, run = ops[j], ops[i + 1 : j]
        why = f"pool pads (padding {list(pool.padding)})" if isinstance(pool, Pool) and any(pool.padding) else None
        pooled = range(2, rank) if isinstance(pool, Pool) else pool.dims
        for e in run:
            if why:
                break
            if not e.plain or e.fn not in ("mul", "div", "add", "sub") or e.param_sum_dims:
                why = f"{e.describe()} is not a factor or an offset"
            elif e.fn in ("add", "sub") and kind == "sum":
                why = f"{e.describe()} is an offset, which a sum would count once per summed value"
            elif e.param is not None:
                aligned = _aligned_param_shape(pipe, e, rank)
                if any(aligned[d] != 1 for d in pooled):
                    why = f"parameter '{e.param}' varies along the pooled dims"
                elif isinstance(pool, Reduce) and pool.kept != pool.dims:
                    why = f"parameter '{e.param}' would meet a lower-rank value (the reduction drops its dims)"
        if why:
            decisions.append(Decision("affine_through_pooling", _site(*run, pool), False, why))
            continue
        ops[i + 1 : j + 1] = [pool] + run
        decisions.append(Decision("affine_through_pooling", _site(*run, pool), True,
                                  f"{', '.join(e.describe() for e in run)} moved after {pool.describe()}"))
    return ops, decisions


# ------------------------------------------------------------ sum before conv


def sum_before_conv(pipe: Pipeline):
    """conv, then a sum or mean over spatial dims (keepdim) -> a convolution of the input's per-tap sums.

    The convolution is linear: summed over a dim, its output is, per kernel tap k, w[k] times the
    sum of the inputs tap k reads (lowering.TapSums). The input is reduced first (one partial sum per
    tap), and the convolution runs only over the other dims: KernelBench #42's ConvTranspose2d over
    512 x 512 then a global mean becomes a (Cin x 9) x Cout product per sample. A mean is the sum
    divided by the count after it. Needs groups 1; transposed: no dilation; forward: stride 1 along
    the summed dims. The rounding changes (sums of inputs, not of outputs: the convolution of the
    sums runs in fp32), and +-inf inputs meet in the input's sums rather than in the outputs.
    """
    ops, types, decisions = list(pipe.ops), pipe.types, []
    i = 0
    while i < len(ops) - 1:
        op, red = ops[i], ops[i + 1]
        if not (isinstance(op, Conv) and isinstance(red, Reduce) and _pooling(red, types[i + 1].rank)):
            i += 1
            continue
        dims = tuple(d - 2 for d in red.dims)
        why = None
        if red.kept != red.dims:
            why = "the reduction drops its dims (keepdim false)"
        elif pipe.conv_impl == "gemm":
            why = "the spec asks for the generated convolution (plan.conv: gemm), which does not take tap sums"
        elif pipe.dtype != "float32":
            why = f"no {pipe.dtype} form of a convolution of tap sums (conv_aten's runs in float32)"
        elif op.groups != 1:
            why = f"groups={op.groups}"
        elif op.transposed and any(d != 1 for d in op.dilation):
            why = f"dilated transposed convolution (dilation {list(op.dilation)})"
        elif not op.transposed and any(op.stride[d] != 1 for d in dims):
            why = f"stride {list(op.stride)} along a summed dim: a tap reads every stride-th input"
        if why:
            decisions.append(Decision("sum_before_conv", _site(op, red), False, why))
            i += 1
            continue
        lc = LoweredConv(key=op.key, src=op.src, conv=op, lowering=TapSums(dims))
        new = [lc]
        if red.fn == "mean":
            new.append(Elementwise(key=red.key, fn="div", scalar=float(lc.lowering.count(op, types[i].spatial))))
        ops[i : i + 2] = new
        types = pipe.with_ops(ops).types
        taps = math.prod(op.kernel[d] for d in dims)
        decisions.append(Decision("sum_before_conv", _site(op, red), True,
                                  f"{red.fn} over {list(red.dims)} first: {taps} input sums per channel, then the convolution"
                                  + (f" over dims {[2 + d for d in lc.lowering.rest(op)]}" if lc.lowering.rest(op) else " as a matrix product")))
        i += len(new)
    return ops, decisions


# ------------------------------------------------------------ pool into linear


def _summed_offset(pipe: Pipeline, e: Elementwise, rank: int, features: int) -> Elementwise:
    """``e`` (an offset of the summed features) as it applies to their sum: counted once per feature."""
    if e.param is None:
        return replace(e, scalar=e.scalar * features)
    aligned = _aligned_param_shape(pipe, e, rank)
    return replace(e, param_sum_dims=(rank - 1,), param_rank=rank, param_sum_scale=features if aligned[-1] == 1 else 1)


def _feature_pool(pipe: Pipeline, ops: list, j: int) -> tuple[int, int, list] | None:
    """The ops from ``j`` as an average pool over the features of a [N, F] product's output, written
    reshape [N, 1, F], avg_pool1d(k, stride k), (reshape [N, F // k]): (k, ops consumed, ops that
    keep the output's type after the window sums and their division); None if they are not."""
    types = pipe.types
    if j + 1 >= len(ops) or not (isinstance(ops[j], Reshape) and isinstance(ops[j + 1], Pool)):
        return None
    pool, t = ops[j + 1], types[j]
    if t.rank != 2 or tuple(ops[j].shape) != (1, t.shape[1]) or pool.kind != "avg" or len(pool.kernel) != 1 or pool.src:
        return None
    k = pool.kernel[0]
    if tuple(pool.stride) != (k,) or any(pool.padding) or (pool.ceil_mode and t.shape[1] % k):
        return None
    groups = t.shape[1] // k
    if j + 2 < len(ops) and isinstance(ops[j + 2], Reshape) and tuple(ops[j + 2].shape) == (groups,):
        return k, 3, []
    return k, 2, [Reshape(key=ops[j].key, shape=(1, groups))]


_NO_16_BIT_POOLED_PRODUCT = "no 16-bit form of a product with summed weight rows (linear_aten's runs in float32)"


def pool_into_linear(pipe: Pipeline):
    """linear (or matmul with a parameter), affine ops, a sum / mean over its output features ->
    the product with its weight rows summed, then the affine ops.

    Summing a product's outputs over windows of its features is the product with the window's
    weight rows (and biases) summed (lowering.PooledProduct): a sum or mean over the features
    (keepdim) makes a matrix-vector product of the 8192 x 8192 GEMMs of KernelBench #14, #18 and
    #51, an avg_pool1d(16) over them (written reshape, pool, reshape, #98) a GEMM with 16x fewer
    outputs. Factors between the product and the sum must be constant along the features; offsets
    enter summed (a scalar times the feature count, a per-feature parameter summed over them); a
    mean is the sum divided by its count. The rounding changes within float32 accuracy (the
    weight's rows are summed first), and +-inf inputs meet in the summed weights' products.
    """
    ops, decisions = list(pipe.ops), []
    i = 0
    while i < len(ops):
        op = ops[i]
        if not (isinstance(op, Linear) or (isinstance(op, Matmul) and op.param is not None)):
            i += 1
            continue
        now = pipe.with_ops(ops)
        rank, features = now.types[i + 1].rank, now.types[i + 1].shape[-1]
        j = i + 1
        while j < len(ops) and isinstance(ops[j], Elementwise) and ops[j].plain and ops[j].fn in ("mul", "div", "add", "sub"):
            j += 1
        red = ops[j] if j < len(ops) else None
        pooled = _feature_pool(now, ops, j) if j == i + 1 else None
        if pooled is not None and pipe.dtype != "float32":
            decisions.append(Decision("pool_into_linear", _site(op, ops[j + 1]), False, _NO_16_BIT_POOLED_PRODUCT))
            i += 1
            continue
        if pooled is not None:
            k, used, tail = pooled
            pool = ops[j + 1]
            new = [PooledProduct(key=op.key, product=op, window=k), Elementwise(key=pool.key, fn="div", scalar=float(k))] + tail
            decisions.append(Decision("pool_into_linear", _site(op, pool), True,
                                      f"avg_pool1d({k}) over its {features} outputs: the product with its weight rows summed in windows of {k} ({features // k} outputs)"))
            ops[i : j + used] = new
            i += len(new)
            continue
        if not (isinstance(red, Reduce) and red.fn in ("sum", "mean") and red.dims == (rank - 1,) and red.src is None):
            i += 1
            continue
        run, why = ops[i + 1 : j], None
        if red.kept != red.dims:
            why = "the reduction drops the feature dim (keepdim false)"
        elif pipe.dtype != "float32":
            why = _NO_16_BIT_POOLED_PRODUCT
        for e in run:
            if why:
                break
            if e.param_sum_dims:
                why = f"{e.describe()} already enters summed"
            elif e.param is not None:
                aligned = _aligned_param_shape(pipe, e, rank)
                if e.fn in ("mul", "div") and aligned[-1] != 1:
                    why = f"{e.describe()} is a factor that varies along the features"
                elif e.fn in ("add", "sub") and any(n != 1 for n in aligned[:-1]):
                    why = f"parameter '{e.param}' varies along other dims than the features"
        if why:
            decisions.append(Decision("pool_into_linear", _site(op, *run, red), False, why))
            i = j + 1
            continue
        moved = [_summed_offset(pipe, e, rank, features) if e.fn in ("add", "sub") else e for e in run]
        new = [PooledProduct(key=op.key, product=op, window=features)] + moved
        if red.fn == "mean":
            new.append(Elementwise(key=red.key, fn="div", scalar=float(features)))
        ops[i : j + 1] = new
        decisions.append(Decision("pool_into_linear", _site(op, *run, red), True,
                                  f"{red.fn} over its {features} outputs: a product with the weight's rows summed (one output)"
                                  + (f"; {', '.join(e.describe() for e in run)} after it" if run else "")))
        i += len(new)
    return ops, decisions


# ------------------------------------------------------------ sub-pixel


def subpixel_conv_transpose(pipe: Pipeline, fire=always):
    """conv_transpose with stride s -> s^d ordinary convolutions, one per output phase.

    Each phase uses only the kernel taps that reach it, so no multiplications by
    inserted zeros; stride 1 is the single-phase case (a convolution with the
    flipped kernel). Needs groups 1, no dilation, no output_padding, and
    stride <= kernel (else some phase has no tap at all).
    """
    ops, decisions = list(pipe.ops), []
    for i, op in enumerate(ops):
        if not (isinstance(op, Conv) and op.transposed):
            continue
        why = None
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if isinstance(nxt, Capture):
            why = f"its output is the named value '{nxt.name}'"
        elif op.groups != 1:
            why = f"groups={op.groups}"
        elif any(d != 1 for d in op.dilation):
            why = f"dilation {list(op.dilation)}"
        elif any(op.output_padding):
            why = f"output_padding {list(op.output_padding)}"
        elif any(s > k for s, k in zip(op.stride, op.kernel)):
            why = f"stride {list(op.stride)} exceeds kernel {list(op.kernel)}: some phases get no tap"
        elif any(o < s for o, s in zip(pipe.types[i + 1].spatial, op.stride)):
            why = f"output {list(pipe.types[i + 1].spatial)} is shorter than the stride {list(op.stride)}: some phases get no output"
        elif amp := rounding_amplifier(pipe):
            # phases sum in another order than eager's cuDNN call: a unit of the dtype off in some outputs, which
            # a norm's output carries on top of its own rounding (relu_group_norm in bfloat16 on an H200: 6e-2
            # off eager, past KernelBench's 1e-2) and an exponential multiplies
            why = f"in {pipe.dtype} {amp.key} ({amp.op_name}) needs eager's own call's rounded output"
        elif not fire("subpixel_conv_transpose", _site(op)):
            why = NOT_CHOSEN
        if why:
            decisions.append(Decision("subpixel_conv_transpose", _site(op), False, why))
            continue
        n = math.prod(op.stride)
        ops[i] = LoweredConv(key=op.key, src=op.src, conv=op, lowering=Subpixel())
        taps = "x".join("/".join(str(t) for t in sorted({-(-(k - r) // s) for r in range(s)}, reverse=True)) for k, s in zip(op.kernel, op.stride))
        what = f"{n} phase convolutions" if n > 1 else "one convolution with the flipped kernel"
        decisions.append(Decision("subpixel_conv_transpose", _site(op), True, f"{what}, {taps} taps per dim"))
    return ops, decisions


# ------------------------------------------------------------ dead region


def _needed_input(op: Op, t_in: TensorType, t_out: TensorType, need: tuple) -> tuple:
    """Per non-batch dim of ``t_in``: the prefix extent that ``op`` reads to make ``need`` of its output."""
    if isinstance(op, Elementwise):
        return need
    if isinstance(op, Norm):
        return tuple(t_in.shape[1:])
    if isinstance(op, Reduce):
        it = iter(need)
        out = []
        for d in range(1, t_in.rank):
            if d in op.dims:
                if d in op.kept:
                    next(it)
                out.append(t_in.shape[d])
            else:
                out.append(next(it))
        return tuple(out)
    lc = lowered(op)
    if isinstance(op, Pool) or (lc is not None and isinstance(lc.lowering, Direct) and not lc.transposed):
        if isinstance(op, Pool):
            k, s, p, d = op.kernel, op.stride, op.padding, op.dilation
        else:
            k, s, p, d = lc.kernel, lc.stride, lc.padding, lc.dilation
        spatial = tuple(
            min(l, (n - 1) * st - pp + dd * (kk - 1) + 1)
            for l, n, kk, st, pp, dd in zip(t_in.spatial, need[1:], k, s, p, d)
        )
        return (t_in.channels,) + spatial
    return tuple(t_in.shape[1:])  # transposed convolution: everything


def dead_region(pipe: Pipeline, fire=always):
    """Compute only the part of a convolution's output that some consumer reads.

    Floor-mode pooling drops trailing rows (63 -> 31 -> 10 reads 60 of 63); the
    convolution then runs on the input prefix those outputs need. Fires when at
    least 5% of the output is dead (cropping costs one copy of the input).
    Transposed convolutions qualify once they are in sub-pixel form.
    """
    ops, types = list(pipe.ops), pipe.types
    need = tuple(types[-1].shape[1:])
    needs = [None] * len(ops)  # needs[i]: extent of op i's output that is read
    for i in range(len(ops) - 1, -1, -1):
        if i + 1 < len(ops) and ops[i + 1].src is not None:  # the next op reads another value: all of this one's kept
            need = tuple(types[i + 1].shape[1:])
        needs[i] = need
        need = _needed_input(ops[i], pipe.in_type(i), types[i + 1], need)
    # first_named[i]: the first op after op i that reads or names a value (None: none), found in one backward pass
    first_named, found = [None] * len(ops), None
    for i in range(len(ops) - 1, -1, -1):
        first_named[i] = found
        if ops[i].src is not None or ops[i].value_names() or isinstance(ops[i], Capture):
            found = ops[i]
    decisions = []
    for i, op in enumerate(ops):
        lc = lowered(op)
        if lc is None:
            continue
        if first_named[i] is not None:
            decisions.append(Decision("dead_region", _site(op), False, f"{first_named[i].describe()} reads or names a "
                                      "value after the convolution"))
            continue
        full = types[i + 1].spatial
        keep = needs[i][1:]
        if keep == full:
            decisions.append(Decision("dead_region", _site(op), False, "consumers read the whole output"))
            continue
        if not lc.lowering.can_crop(lc.conv):
            decisions.append(Decision("dead_region", _site(op), False, "transposed convolution not in sub-pixel form computes everything"))
            continue
        keep = tuple(min(f, max(k, m)) for f, k, m in zip(full, keep, lc.lowering.min_kept(lc.conv)))
        varying = _spatially_varying_param(pipe, i)
        if varying:
            decisions.append(Decision("dead_region", _site(op), False, f"parameter '{varying}' varies along the spatial dims of the cropped tensor"))
            continue
        cropped = replace(lc, crop=tuple(keep))
        if any(c < k for c, k in zip(cropped.physical_out(pipe.in_type(i).spatial), keep)):
            decisions.append(Decision("dead_region", _site(op), False, "the cropped input would not produce the kept outputs"))
            continue
        try:  # the consumers must take the cropped size (avg_pool3d refuses an input smaller than its kernel)
            after = infer_types(cropped.infer(pipe.in_type(i)), ops[i + 1 :], pipe.path, pipe.values)[0][-1]
        except SpecError as e:
            decisions.append(Decision("dead_region", _site(op), False, f"a consumer refuses the cropped size: {e.message}"))
            continue
        if after != types[-1]:
            decisions.append(Decision("dead_region", _site(op), False, f"the cropped size changes the output to {after}"))
            continue
        dead = 1 - math.prod(keep) / math.prod(full)
        if dead < DEAD_REGION_MIN_FRACTION:
            decisions.append(
                Decision("dead_region", _site(op), False, f"only {dead:.1%} of the output is dead (threshold {DEAD_REGION_MIN_FRACTION:.0%})")
            )
            continue
        if not fire("dead_region", _site(op)):
            decisions.append(Decision("dead_region", _site(op), False, NOT_CHOSEN))
            continue
        ops[i] = cropped
        decisions.append(Decision("dead_region", _site(op), True, f"computes {list(keep)} of {list(full)} ({dead:.1%} of the output was dead)"))
    return ops, decisions


def _spatially_varying_param(pipe: Pipeline, conv_index: int) -> str | None:
    """A parameter that varies along spatial dims, used by an elementwise op between
    the convolution and the next op that changes the spatial size."""
    for op in pipe.ops[conv_index + 1 :]:
        if not isinstance(op, Elementwise):
            return None
        if op.param and not op.param_view and any(n > 1 for n in pipe.params[op.param].shape[1:]):
            return op.param
    return None


# ------------------------------------------------------------ reduction algebra


def reduction_algebra(pipe: Pipeline):
    """mean over A (keepdim), affine ops, sum over B -> one sum over A+B, then the affine ops.

    sum_B(a * mean_A(x) + b) = a/|A| * sum_{A+B}(x) + sum_B(b) when the factors a
    are scalars and the offsets b vary only along B. One reduction instead of
    two, and a per-channel bias becomes one summed constant.
    """
    ops, types, decisions = list(pipe.ops), pipe.types, []
    i = 0
    while i < len(ops):
        m = ops[i]
        if not (isinstance(m, Reduce) and m.fn == "mean"):
            i += 1
            continue
        j = i + 1
        while j < len(ops) and isinstance(ops[j], Elementwise):
            j += 1
        s = ops[j] if j < len(ops) else None
        if not (isinstance(s, Reduce) and s.fn == "sum"):
            i += 1
            continue
        why, rank = None, types[i + 1].rank
        A, B = set(m.dims), set(s.dims)
        if pipe.rounds_between_ops and pipe.dtype == "float16":
            # the sum over A+B (a rounding point, as each op's result) is |A| times the mean eager rounds: past
            # float16's 65504 where the mean is not (bfloat16 has float's range)
            why = "in float16 the sum over the mean's dims would round to the dtype, |A| times the mean: past its range"
        elif m.kept != m.dims:
            why = "the mean drops its dims (keepdim false)"
        elif A & B:
            why = f"mean and sum share dims {sorted(A & B)}"
        if s.src is not None:
            why = f"{s.key} reads another value"
        for e in ops[i + 1 : j]:
            if why:
                break
            if not e.plain:
                why = f"{e.describe()} between the mean and the sum reads or names a value"
            elif e.fn in ("mul", "div"):
                if e.param is not None:
                    why = f"{e.describe()} is not a scalar factor; the sum does not distribute over it"
            elif e.fn in ("add", "sub"):
                if e.param is not None:
                    aligned = _aligned_param_shape(pipe, e, rank)
                    varying = {d for d, n in enumerate(aligned) if n != 1}
                    if not varying <= B:
                        why = f"parameter '{e.param}' varies along dims {sorted(varying - B)} that the sum does not reduce"
            else:
                why = f"{e.describe()} between the mean and the sum is not affine"
        if why:
            decisions.append(Decision("reduction_algebra", _site(m, s), False, why))
            i = j
            continue
        count_A = m.count(types[i])
        count_B = s.count(types[j])
        new = [
            Reduce(key=m.key, fn="sum", dims=tuple(sorted(A | B)), kept=tuple(sorted(A | set(s.kept)))),
            Elementwise(key=m.key, fn="div", scalar=float(count_A)),
        ]
        b_dims = tuple(sorted(B))
        for e in ops[i + 1 : j]:
            if e.fn in ("add", "sub") and e.param is None:
                new.append(replace(e, scalar=e.scalar * count_B))
            elif e.fn in ("add", "sub"):
                # where the parameter broadcasts (size 1) along a summed dim, it counts that many times
                aligned = _aligned_param_shape(pipe, e, rank)
                scale = math.prod(types[j].shape[d] for d in b_dims if aligned[d] == 1)
                new.append(replace(e, param_sum_dims=b_dims, param_rank=rank, param_sum_scale=scale))
            else:
                new.append(e)
        decisions.append(
            Decision("reduction_algebra", _site(m, s), True, f"mean over {sorted(A)} and sum over {sorted(B)} -> one sum over {sorted(A | B)}, /{count_A}")
        )
        ops[i : j + 1] = new
        types = pipe.with_ops(ops).types
        i += len(new)
    return ops, decisions


# ------------------------------------------------------------ driver

# scalar_through_max runs first: max, x/2, max becomes max, max, x/2, which composes.
REWRITES = (
    ("dropout_of_zero", dropout_of_zero),
    ("softmax_through_reshape", softmax_through_reshape),
    ("commute_operand_chain", commute_operand_chain),
    ("permute_before_elementwise", permute_before_elementwise),
    ("scalar_through_max", scalar_through_max),
    ("pool_composition", pool_composition),
    ("batch_stats_pass", batch_stats_pass),
    ("affine_through_pooling", affine_through_pooling),
    ("sum_before_conv", sum_before_conv),
    ("pool_into_linear", pool_into_linear),
    ("avg_pool_folding", avg_pool_folding),
    ("subpixel_conv_transpose", subpixel_conv_transpose),
    ("dead_region", dead_region),
    ("reduction_algebra", reduction_algebra),
)


# ------------------------------------------------------------ eval mode


def batch_norm_eval_affine(pipe: Pipeline) -> Pipeline | None:
    """The pipeline as eval mode computes it: each batch norm over running statistics becomes
    ``(x - running_mean) * scale (+ bias)``, three per-channel elementwise ops that fuse like any
    other, with ``scale = weight / sqrt(running_var + eps)`` a tensor the op derives on each call
    (``ir.DerivedTensor``); None where no batch norm uses running statistics.

    Not one of REWRITES: it holds in eval mode only, so the plan runs it for its eval-mode plan
    (kgen.plan.choose_plans), and the op dispatches on the mode. PyTorch's eval-mode batch norm
    computes ``((x - mean) * invstd) * weight + bias``; folding ``weight * invstd`` first changes
    the rounding by an ulp of the scale. The model keeps its members (the running statistics stay
    the op's arguments).
    """
    ops, derived = [], []
    for op in pipe.ops:
        if not (isinstance(op, BatchNorm) and op.track_running_stats):
            ops.append(op)
            continue
        mean, var = op.buffer_names()
        weight, bias = op.tensor_names() or (None, None)
        view = (op.num_features,) + (1,) * (op.rank - 2)  # per channel, against the activation's dims 1..
        name = f"{op.module}.eval_scale"
        scale = DerivedTensor(TensorArg.named(name, (op.num_features,), "float32"), var, weight, op.eps)  # float: ATen's invstd
        derived.append(scale)
        ops += [Elementwise(key=op.key, src=op.src, fn="sub", param=mean, param_view=view, inner=True),
                Elementwise(key=f"{op.key}.scale", fn="mul", param=name, param_view=view, inner=bool(bias))]
        if bias:
            ops.append(Elementwise(key=f"{op.key}.shift", fn="add", param=bias, param_view=view))
    if not derived:
        return None
    return replace(pipe.with_ops(ops), derived=tuple(derived), kept_members=tuple(pipe.members()))


def batch_norm_batch_stats(pipe: Pipeline) -> Pipeline | None:
    """The pipeline as training mode computes it: each batch norm becomes its batch statistics
    (``BatchStats``: the identity on its input, read once; it makes the per-channel ``mean`` and
    ``scale`` = weight / sqrt(var + eps) and updates the running statistics) and ``(x - mean) *
    scale (+ bias)``, three per-channel elementwise ops that fuse into the next stage; None where
    the pipeline has no batch norm. ATen's training-mode norm reads its input twice and writes
    its output, which the next stage reads again; here the input is read once for the statistics
    and once by the stage that applies them.

    Not one of REWRITES, like batch_norm_eval_affine: the plan runs it for the plan of training mode
    (or of both modes, for a norm that keeps no running statistics).
    """
    ops = []
    for op in pipe.ops:
        if not isinstance(op, BatchNorm):
            ops.append(op)
            continue
        stats = BatchStats(key=f"{op.key}.stats", src=op.src, norm=op)
        view = (op.num_features,) + (1,) * (op.rank - 2)
        ops += [stats,
                Elementwise(key=op.key, fn="sub", param=stats.mean.name, param_view=view, inner=True),
                Elementwise(key=f"{op.key}.scale", fn="mul", param=stats.scale.name, param_view=view, inner=op.affine)]
        if op.affine:
            ops.append(Elementwise(key=f"{op.key}.shift", fn="add", param=op.tensor_names()[1], param_view=view))
    if len(ops) == len(pipe.ops):
        return None
    return replace(pipe.with_ops(ops), kept_members=tuple(pipe.members()))


def apply_rewrites(pipe: Pipeline, enabled: dict | None = None, fire=always) -> tuple[Pipeline, list[Decision]]:
    """Run the enabled rewrites in order; returns the rewritten pipeline and every decision.

    ``fire(rewrite, site)`` decides, at each site where a ``TUNABLE`` rewrite's side
    conditions hold, whether it fires there (the plan's choice).
    """
    enabled = pipe.rewrites if enabled is None else enabled
    decisions = []
    for name, fn in REWRITES:
        if not enabled.get(name, True):
            decisions.append(Decision(name, "*", False, f"switched off in the spec (rewrites.{name}: false)"))
            continue
        amp = rounding_amplifier(pipe) if not keeps_eager_values(pipe, name) else None
        if amp is not None:
            decisions.append(Decision(name, "*", False, _skips_rounding(pipe, amp)))
            continue
        ops, ds = fn(pipe, fire) if name in TUNABLE else fn(pipe)
        decisions += ds
        if list(ops) != list(pipe.ops):
            pipe = pipe.with_ops(ops)
    return pipe, decisions
