"""Split a (rewritten) pipeline into stages; pick a family (an implementation) and a schedule for each.

1. The rewrites run (``kgen.rewrites``); each convolution's bias moves into
   the stage that reads the convolution (``defer_conv_bias``).
2. The op chain is grouped greedily: an op joins the current group while some
   template family accepts the longer group (``kgen.families.claimants``).
3. Each family that accepts a group lists its candidates for it
   (``Family.candidates``: its layouts or configurations), unless it declines
   the request (``Family.unsupported``); the plan takes the one its choices
   name. Every tunable number is a field of a stage, made for the plan's
   ``Target`` (``kgen.target``).
4. A convolution output that is not a plain tensor where it is read gets a
   copy stage; an implementation may absorb the next stage as its epilogue
   (the absorbed stage stays in the plan, marked ``absorbed_by``).

Choices: a plan is made for an assignment of options to decision points
(``make_plan(choices=...)``): the whole pipeline as kgen's stages or as the
spec's eager ops (``pipeline``), each size-dependent rewrite at each site
where its side conditions hold (``on``/``off``), and the candidate of each
stage with several. ``candidate_plans`` enumerates every plan the decision
points allow. ``choose_plans`` is where the choice is made: from the spec's
tuning file (``kgen.tunefile``, measured by `kgen tune`) when it has an entry
for the target, else by the cost model (``kgen.cost``); a tuning file may give
different plans for ranges of the batch, which the op dispatches between.

``plan.json`` records all of it; ``kgen explain`` prints it.
"""
from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from . import families, target as targets, values
from .buffer import flat_buffer
from .errors import KgenError
from .ir import BatchNorm, Capture, Cat, Elementwise, Op, Pipeline
from .lowering import TapSums, lowered
from .ops import FUSED, OPS
from .rewrites import Decision, apply_rewrites, batch_norm_batch_stats, batch_norm_eval_affine
from .stage import ChannelSlice, ConvStage, Stage
from .target import Target

# Decision points: the keys of a plan's choices.
PIPELINE = "pipeline"  # options KGEN, EAGER: kgen's stages or the spec's ops through ATen
EAGER_CHOICE = "eager: the spec's ops through ATen ({reason})"  # the eager plan's stage choice (plan.json)
KGEN, EAGER = "kgen", "eager"
EVAL_REWRITE = "batch_norm_eval_affine"  # the spec's switch for eval mode's own plan
TRAIN_REWRITE = "batch_norm_batch_stats"  # the spec's switch for training mode's batch statistics stage
ON, OFF = "on", "off"
MAX_CANDIDATES = 64  # plans candidate_plans enumerates at most (in order from the default)
DEFAULT_REASON = "the default: the first candidate"


def rewrite_key(rewrite: str, site: str) -> str:
    return f"{rewrite} @ {site}"


def implementation_key(op: Op) -> str:
    """The decision point of the stage that starts with ``op`` (its spec key is stable under rewrites)."""
    return f"implementation @ {op.key}"


class _Picker:
    """Answers the planner's questions from ``given`` (default: the first option) and
    records each decision point it was asked about with its options."""

    def __init__(self, given: dict | None):
        self.given = dict(given or {})
        self.options: dict[str, tuple[str, ...]] = {}
        self.chosen: dict[str, str] = {}

    def answer(self, key: str, options: tuple[str, ...]) -> str:
        choice = self.given.get(key)
        return choice if choice in options else options[0]

    def pick(self, key: str, options) -> str:
        options = tuple(options)
        choice = self.answer(key, options)
        if len(options) > 1:
            self.options[key], self.chosen[key] = options, choice
        return choice


class _Recorder:
    """A picker's stand-in that also records each question and its answer (the rewriting front's, _Memo)."""

    def __init__(self, picker: _Picker):
        self.picker, self.asked = picker, []

    def pick(self, key: str, options) -> str:
        options = tuple(options)
        choice = self.picker.pick(key, options)
        self.asked.append((key, options, choice))
        return choice


@dataclass
class _Front:
    """The rewriting front of _make_plan: the rewritten pipeline, its decisions and its groups of ops."""

    rewritten: Pipeline
    decisions: list
    groups: list  # (start, ops, families that claim them), groups of names only merged away
    named_after: dict  # group index -> the names the dropped groups after it gave its output
    # group index -> whether its result's readers all read a view of it (_views_read_in_place: the front's alone,
    # and a search asks it of every group of every plan it makes)
    read_in_place: dict = field(default_factory=dict)


class _Memo:
    """What _make_plan computes again when a search makes plans of one pipeline with one decision changed
    (candidate_plans, coordinate descent: hundreds of plans of a whole model): the rewriting front for the
    same answers to its questions, and each family's answer to the same stage request (its stages copied
    out, as the plan sets their fields). Every key is a value or an object the memo keeps alive."""

    def __init__(self):
        self.fronts: list[tuple[tuple, _Front]] = []  # (the questions asked and their answers, the front)
        self.offers: dict = {}  # stage request -> (families' reasons to decline, candidates offered)
        self.eager_whole: bool | None = None  # whether the eager family computes the whole pipeline (not asked yet)

    def front(self, picker: _Picker) -> _Front | None:
        """The front made with the answers ``picker`` gives (the same questions, asked in turn), recorded in it."""
        for asked, front in self.fronts:
            if all(picker.answer(key, options) == choice for key, options, choice in asked):
                for key, options, _ in asked:
                    picker.pick(key, options)
                return front
        return None


MEMO_PIPELINES = 4  # the pipelines whose plans _make_plan remembers (choose_plans asks of one or two at a time)
_MEMOS: dict = {}  # (id(pipeline), id(target), batch, rewrites) -> (pipeline, target, _Memo), the latest last


def _memo(pipeline: Pipeline, target: Target, batch: int, rewrites: dict | None) -> _Memo:
    key = (id(pipeline), id(target), batch, json.dumps(rewrites, sort_keys=True))
    entry = _MEMOS.pop(key, None)
    if entry is None or entry[0] is not pipeline or entry[1] is not target:
        entry = (pipeline, target, _Memo())
    _MEMOS[key] = entry
    while len(_MEMOS) > MEMO_PIPELINES:
        _MEMOS.pop(next(iter(_MEMOS)))
    return entry[2]


@dataclass
class Plan:
    pipeline: Pipeline  # rewritten
    original: Pipeline
    decisions: list[Decision]
    stages: list[Stage]
    target: Target
    choices: dict = field(default_factory=dict)  # decision point -> the option this plan was made with
    options: dict = field(default_factory=dict)  # decision point -> its options (the first is the default)
    batch: int = 1  # the batch its schedules were made for
    value_exprs: dict = None  # value name -> the binding's tensor holding it (kgen.values.materialized)
    _stage_values: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # id(stage) -> stage_values
    _writers: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # "t<index>" -> its stage
    _view_values: dict | None = field(default=None, init=False, repr=False, compare=False)  # view_values, once known

    def __post_init__(self):
        for st in self.stages:  # every stage reads and writes the plan's dtype (the cost model's bytes)
            st.dtype = self.pipeline.dtype
            st.rounded = rounding_points(self.pipeline, st)
        # (the stages are numbered before a plan is made; a search asks for writers millions of times)
        self._writers = {f"t{st.index}": st for st in self.stages}

    @property
    def name(self) -> str:
        return self.pipeline.name

    @property
    def eager(self) -> bool:
        """Whether it is the spec's ops through ATen (the eager candidate)."""
        return self.choices.get(PIPELINE) == EAGER

    def kernel_stages(self) -> list[Stage]:
        """Stages whose kernels kgen generates; each is also the op kgen::NAME_stageK."""
        return [s for s in self.stages if s.family.generates_kernel]

    def stage_args(self, stage: Stage) -> list:
        """The parameter tensors (TensorArgs) a stage takes, in the module's argument order."""
        names = stage.tensor_names()
        return [a for a in self.pipeline.stage_tensors() if a.name in names]

    def stage_values(self, stage: Stage) -> list[str]:
        """The values a stage reads as tensors (operands not in a register), in definition order (kept per stage:
        the plan's passes and the cost model ask for every stage, hundreds of plans in a search)."""
        known = self._stage_values.get(id(stage))
        if known is None:
            names = {n for op in stage.ops for n in op.value_names() if not getattr(op, "register", False)}
            known = self._stage_values[id(stage)] = [n for n in self.pipeline.values if n in names] if names else []
        return known

    def output_tensors(self) -> set[str]:
        """The binding's tensors that hold outputs of the graph before its last op (stages must write them)."""
        pipe = self.pipeline
        if not pipe.several_outputs or self.value_exprs is None:
            return set()
        return {self.value_exprs[n] for n in pipe.outputs if n != pipe.ops[-1].name}

    def writer_of(self, tensor: str) -> Stage | None:
        """The stage whose output is the binding's tensor ``tensor`` (``t<index>``); None for an input."""
        return self._writers.get(tensor)

    def view_values(self) -> dict:
        """The named values that are views read in place (a permute's, slice's or expand's,
        ``_views_read_in_place``): name -> the buffer a stage reading it as an operand addresses it through."""
        if self._view_values is None:
            if self.value_exprs is None:  # (not yet materialized: kgen.values)
                return {}
            writers = {name: self.writer_of(tensor) for name, tensor in self.value_exprs.items()}
            # (asked by every elementwise op the templates render: computed once)
            self._view_values = {name: w.output for name, w in writers.items() if w is not None and w.hands_on_view}
        return self._view_values

    def running_copies(self) -> tuple[int, list[str]] | None:
        """Where the binding copies the running statistics the batch norms update in training mode (before the
        first stage that updates one: its index) and which (state_dict names, in the op's buffer order); None
        where none is updated."""
        updated = self.pipeline.updated_buffers()
        if not updated:
            return None
        first = next(st.index for st in self.stages if any(n in updated for op in st.ops for n in op.buffer_names()))
        return first, [b.name for b in self.pipeline.buffer_args() if b.name in updated]

    def output_exprs(self) -> list[str]:
        """The binding's C++ tensor of each output of the graph, in order: the last stage's for the
        last op's result; another output is the tensor holding its value (a plain contiguous one)."""
        pipe = self.pipeline
        last = f"t{self.stages[-1].index}"
        if not pipe.several_outputs:
            return [last]
        out = []
        for n in pipe.outputs:
            if n == pipe.ops[-1].name:
                out.append(last)
            elif self.eager:
                out.append(f"{self.stages[0].value(n)}.contiguous()")  # a named value of the eager stage
            else:
                expr = self.value_exprs[n]
                writer = self.writer_of(expr)
                out.append(expr if writer is None or writer.output.flat else f"{expr}.contiguous()")
        return out

    def to_json(self) -> dict:
        def stage_json(s: Stage) -> dict:
            d = {
                "index": s.index,
                "kind": s.kind,
                "ops": [o.describe() for o in s.ops],
                "spec_keys": s.keys,
                "input": str(s.in_type),
                "output": str(s.out_type),
                "family": s.family.name,
                "candidates": list(s.candidates),
                "choice": s.choice,
            }
            if isinstance(s, ConvStage) and s.epilogue is not None:
                d["epilogue_stage"] = s.epilogue.index
            if s.absorbed_by is not None:
                d["absorbed_by_stage"] = s.absorbed_by.index
            if s.rounded and s.family.generates_kernel:  # 16-bit: where its math rounds as eager does (rounding_points)
                d["rounds_after"] = [o.key for o in s.rounded]
            if getattr(s, "gathered_by", None) is not None:
                d["statistics_gathered_by_stage"] = s.gathered_by.index
            if s.into is not None:
                d["writes_into"] = {"stage": s.into.stage, "channel0": s.into.channel0}
            if s.in_place:
                d["operands_in_place"] = list(s.in_place)
            d.update(s.family.stage_json(s))
            return d

        return {
            "name": self.name,
            "spec": self.pipeline.path,
            "precision": self.pipeline.precision,
            "target": asdict(self.target),
            "batch": self.batch,
            "choices": [{"decision": k, "options": list(self.options[k]), "chosen": v} for k, v in self.choices.items()],
            "rewrites": [asdict(d) for d in self.decisions],
            "ops_before": [o.describe() for o in self.original.ops],
            "ops_after": [o.describe() for o in self.pipeline.ops],
            "stages": [stage_json(s) for s in self.stages],
        }


# ---------------------------------------------------------------- planning


def rounding_points(pipe: Pipeline, stage: Stage) -> tuple[Op, ...]:
    """The ops of ``stage`` whose output is rounded to the plan's 16-bit dtype where the stage computes it
    (decided here and nowhere else; the stage math renders each as ``kgen::round_to<T>(v)``).

    Eager PyTorch materializes every op's output as a tensor of the dtype, so each op's result is
    rounded before the next op reads it; where a later op amplifies that rounding (a norm's statistics
    over a convolution's output, a softmax, a difference of close values) eager ends further from the
    exact result than float32 intermediates would, by more than KernelBench's 1e-2 check against eager
    in the same dtype allows (docs/performance.md, Rounding points). So a 16-bit plan rounds after every
    op of the spec, as eager does (a float -> 16-bit -> float round trip in registers; inside a
    convolution's or GEMM's main loop nothing changes: its output is the rounding point, as cuDNN's is).
    A name (``as:``) computes nothing and rounds nothing. The spec's ``intermediates: float32`` keeps
    float32 until the stage's output (closer to float64, further from eager); float32 plans round nowhere.
    A step inside an op eager computes whole (``Elementwise.inner``: a batch norm's subtraction and scale,
    rewrites.batch_norm_batch_stats / batch_norm_eval_affine) rounds nothing: eager rounds the norm's output
    once, after its last step, which rounds here. Only the families that generate a stage's math render
    these; an ATen call rounds its own output."""
    if not pipe.rounds_between_ops:
        return ()
    return tuple(op for op in stage.ops if not isinstance(op, Capture) and not getattr(op, "inner", False))


# Ops after which a 16-bit plan keeps a convolution's bias in the convolution (defer_conv_bias): a product after it
# (a later convolution or GEMM, which the deferred add would have to go into). Before a pool the decision is the
# cost model's: cuDNN's call with the bias deferred into the pooling stage (ATen's bias pass gone: 1.49 ms of #10's
# bfloat16 call), or conv_gemm, which keeps it (its fused max pools add it once per window max). Pools were in
# this list while the model put 2-d cuDNN calls with 8 input channels too fast (#67, #82, #96 went to cuDNN
# without them); since the 16-bit refit they keep conv_gemm.
KEEPS_16_BIT_BIAS_AFTER = ("conv", "linear")
DEFER_BIAS = "defer_conv_bias"  # a 16-bit plan's decision point per convolution (rewrite_key)


def defer_conv_bias(pipe: Pipeline, choose: Callable[[str], bool]) -> Pipeline:
    """Move each convolution's bias into the fused stage that reads it.

    cuDNN does not add a bias: ATen adds it in a separate pass over the whole
    convolution output (in bfloat16 on an H200, 0.71 ms of KernelBench #1's 2.3, more than its
    convolution's 0.45). Adding it where the next stage loads the value costs nothing there,
    and the value is the same: the convolution's output (rounded to a 16-bit dtype, as cuDNN's),
    then one rounded add, as ATen's CUDA call. float32 plans always defer it. In 16 bits it is a
    decision (``choose(key)``; the plan search's, keeping it first): the generated convolution
    adds a kept bias itself and declines a deferred one; ATen's CPU convolution adds the bias
    inside and rounds once, so on the CPU the ATen call keeps it and the next stage's add is
    CUDA's only (Elementwise.cuda_only): each build rounds as eager does on its device, which
    matters where a norm or a softmax scales one unit of the dtype. The bias stays after
    KEEPS_16_BIT_BIAS_AFTER.
    """
    ops = []
    local = values.local_captures(pipe)
    for i, op in enumerate(pipe.ops):
        lc = lowered(op)
        nxt = pipe.ops[i + 1] if i + 1 < len(pipe.ops) else None
        # only into a fused stage; a conv output named for a later stage stays the conv stage's output
        fused_next = nxt is not None and any(f in FUSED for f in OPS[nxt.op_name].families) and nxt.src is None
        if isinstance(nxt, Capture) and i + 1 not in local:
            fused_next = False
        # a convolution of tap sums adds its bias once per summed position itself (lowering.TapSums)
        if not (lc is not None and lc.conv.bias and fused_next) or isinstance(lc.lowering, TapSums) or (
                pipe.dtype != "float32" and (_keeps_16_bit_bias(pipe, i) or not choose(op.key))):
            ops.append(op)
            continue
        view = (lc.conv.out_channels,) + (1,) * lc.conv.rank
        # its own key (the convolution's bias): the stage it starts is a decision point of its own
        add = Elementwise(key=f"{op.key}.bias", fn="add", param=lc.conv.bias_name, param_view=view,
                          cuda_only=pipe.dtype != "float32")
        # only where the next op's stage takes it (not a layer_norm whose rows are too long for its family)
        if families.claimants([add, nxt]):
            ops += [replace(lc, bias_deferred=True, bias_deferred_on_cuda=add.cuda_only), add]
        else:
            ops.append(op)
    return pipe.with_ops(ops) if len(ops) != len(pipe.ops) else pipe


def _keeps_16_bit_bias(pipe: Pipeline, i: int) -> bool:
    return any(OPS[o.op_name].role in KEEPS_16_BIT_BIAS_AFTER for o in pipe.ops[i + 1:] if o.op_name in OPS)


def eager_call_cuts(pipe: Pipeline) -> set[int]:
    """Where a chain of training-mode batch norms runs as eager's calls (Pipeline.eager_batch_norms), a softmax
    before a batch norm is ATen's call too (the softmax family declines it): it stands alone, the ops around it in
    stages of their own."""
    return {j for i, op in enumerate(pipe.ops)
            if op.op_name in families.EAGER_SOFTMAXES and families.before_eager_batch_norm(pipe, i) for j in (i, i + 1)}


def group_ops(pipe: Pipeline, cuts: set[int] = frozenset()) -> list[tuple[int, list[Op], list[families.Family]]]:
    """Split the op chain into (first op index, ops, families that accept them); an op
    joins the current group while some family accepts the longer group, and a group
    starts at every cut (``kgen.values``: where a value must be a tensor)."""
    groups: list[tuple[int, list[Op], list[families.Family]]] = []
    for i, op in enumerate(pipe.ops):
        if groups and i not in cuts:
            longer = families.claimants(groups[-1][1] + [op])
            if longer:
                groups[-1] = (groups[-1][0], groups[-1][1] + [op], longer)
                continue
        alone = families.claimants([op])
        if not alone:
            raise KgenError(f"{pipe.path}: {op.key}: no template family computes {op.describe()}")
        groups.append((i, [op], alone))
    return groups


def make_plan(pipeline: Pipeline, rewrites: dict | None = None, target: Target | None = None,
              choices: dict | None = None, batch: int | None = None, reason: str = DEFAULT_REASON) -> Plan:
    """The plan of ``pipeline`` for ``choices`` (decision point -> option; a point not
    named takes its first option: every rewrite whose side conditions hold fires, each
    stage takes its family's preferred candidate). ``rewrites`` overrides the spec's
    switches; ``batch`` (default: the spec's example) is what schedules are made for;
    ``reason`` says why these choices (for each stage's ``choice``)."""
    target = target or targets.current()
    batch = batch or pipeline.example_batch()
    picker = _Picker(choices)
    try:
        return _make_plan(pipeline, rewrites, target, picker, batch, reason)
    except KgenError as e:
        e.picked = picker  # the decisions taken before it failed: candidate_plans tries their other options
        raise


def _make_plan(pipeline: Pipeline, rewrites: dict | None, target: Target, picker: _Picker, batch: int, reason: str) -> Plan:
    memo = _memo(pipeline, target, batch, rewrites)
    if memo.eager_whole is None:
        memo.eager_whole = families.EAGER.whole(pipeline) is not None
    if picker.pick(PIPELINE, (KGEN, EAGER) if memo.eager_whole else (KGEN,)) == EAGER:
        eager = families.EAGER.whole(pipeline)
        eager.choice = EAGER_CHOICE.format(reason=reason)
        return Plan(pipeline, pipeline, [], [eager], target, picker.chosen, picker.options, batch)
    front = memo.front(picker)
    if front is None:
        front = _rewriting_front(pipeline, rewrites, _Recorder(picker), memo)
    rewritten, decisions, groups, named_after = front.rewritten, list(front.decisions), front.groups, front.named_after
    types = rewritten.types
    # the family of each group first (a stage's request names the next stage's family)
    chosen = [_family_named(picker.given.get(implementation_key(gops[0]), ""), cands) for _, gops, cands in groups]
    stages: list[Stage] = []
    buf = flat_buffer(rewritten.input)  # what the next stage reads
    for gi, (start, gops, cands) in enumerate(groups):
        if gops[0].src is not None:  # it reads a value: a plain tensor
            buf = flat_buffer(rewritten.in_type(start))
        req = families.StageRequest(
            index=len(stages),
            ops=gops,
            types=(rewritten.in_type(start),) + types[start + 1 : start + len(gops) + 1],
            input=buf,
            next_family=chosen[gi + 1] if gi + 1 < len(groups) else None,
            pipeline=rewritten,
            target=target,
            batch=batch,
            start=start,
        )
        # the candidates of every family that takes the request, in registry order
        asked = (id(rewritten), start, len(gops), req.index, buf, req.next_family)
        if asked not in memo.offers:
            memo.offers[asked] = _offers(req, cands)
        declined, offered = memo.offers[asked]
        if not offered:
            raise KgenError(f"{req.pipeline.path}: {gops[0].key}: no family computes it here: " + "; ".join(declined))
        labels = [c.label for c in offered]
        label = picker.pick(implementation_key(gops[0]), labels)
        st = copy.copy(next(c.stage for c in offered if c.label == label))  # the memo's stays as made
        st.family = next(f for f in cands if f.name == label.split(":")[0])
        st.candidates = tuple(labels)
        st.choice = f"{label}: " + ("the only candidate" if len(labels) == 1 else reason)
        if declined:
            st.choice += f" ({'; '.join(declined)})"
        st.names = named_after.get(gi, [])
        if gi not in front.read_in_place:
            front.read_in_place[gi] = _views_read_in_place(groups, gi, st.names, rewritten.outputs)
        if front.read_in_place[gi]:
            st.output = st.family.view_output(st) or st.output  # a permute's, slice's or expand's view, not a copy
        buf = st.output
        stages.append(st)
    _add_copy_stages(stages, rewritten, target, batch)
    for i, st in enumerate(stages):
        st.index = i
    plan = Plan(rewritten, pipeline, decisions, stages, target, picker.chosen, picker.options, batch)
    plan.value_exprs = values.materialized(plan)
    _absorb_epilogues(plan)
    _write_cats_in_place(plan)
    return plan


def _rewriting_front(pipeline: Pipeline, rewrites: dict | None, picker: _Recorder, memo: _Memo) -> _Front:
    """The rewrites the picker's answers fire, the bias deferrals, the values resolved, the ops grouped."""
    fire = lambda rewrite, site: picker.pick(rewrite_key(rewrite, site), (ON, OFF)) == ON  # noqa: E731
    rewritten, decisions = apply_rewrites(pipeline, rewrites, fire)
    rewritten = defer_conv_bias(rewritten, lambda key: picker.pick(rewrite_key(DEFER_BIAS, key), (OFF, ON)) == ON)
    resolved, cuts = values.resolve(rewritten.ops, rewritten.outputs)
    rewritten = rewritten.with_ops(resolved)
    cuts |= eager_call_cuts(rewritten)
    # a group of nothing but names (after a standalone op, before a cut) names that op's output: no stage
    named_after, kept = {}, []
    for group in group_ops(rewritten, cuts):
        if kept and all(isinstance(o, Capture) for o in group[1]):
            named_after.setdefault(len(kept) - 1, []).extend(o.name for o in group[1])
        else:
            kept.append(group)
    front = _Front(rewritten, decisions, kept, named_after)
    memo.fronts.append((tuple(picker.asked), front))
    return front


def _views_read_in_place(groups: list, gi: int, names: list, outputs) -> bool:
    """Whether every reader of group ``gi``'s result (named ``names`` after it, or by the next group's first op)
    reads a view of it as it is, whichever family computes it: the next group, continuing from it, through
    families that read views; an op reading it as an operand through families that read view operands (ATen's
    matmul and cat, pool_reduce through its strides). Not where an op starts from it (``from:``) or the graph
    returns it: each would copy it."""
    if gi + 1 >= len(groups):
        return False
    _, nxt, cands = groups[gi + 1]
    read = set(names)
    if nxt[0].src is None:
        read |= {nxt[0].name} if isinstance(nxt[0], Capture) else set()
        if not all(f.reads_views for f in cands):
            return False
    if read & set(outputs):
        return False
    for _, gops, cands in groups[gi + 1:]:
        for op in gops:
            if op.src in read or read & set(op.value_names()) and not all(f.reads_view_operands for f in cands):
                return False
    return True


def _offers(req: families.StageRequest, cands: list[families.Family]) -> tuple[list[str], list]:
    """Why each family of ``cands`` declines ``req``, and the candidates of those that take it."""
    declined, offered = [], []
    for f in cands:
        why_not = f.declines(req)
        if why_not is None:
            offered += f.candidates(req)
        else:
            declined.append(f"{f.name} declined ({why_not})")
    return declined, offered


def _family_named(label: str, cands: list[families.Family]) -> families.Family:
    """The family a candidate label names (``family`` or ``family:config``), else the first."""
    return next((f for f in cands if f.name == label.split(":")[0]), cands[0])


def _add_copy_stages(stages: list[Stage], pipe: Pipeline, target: Target, batch: int) -> None:
    """A stage output that is not a plain tensor (sub-pixel phase tiles, a cropped or
    channels_last buffer) gets a copy stage where it is read as a tensor: at the end
    (a plain contiguous tensor) or by a stage that generates no kernel (a dense one)."""
    for i in range(len(stages) - 1, -1, -1):
        st = stages[i]
        nxt = stages[i + 1] if i + 1 < len(stages) else None
        if nxt is not None and nxt.family.generates_kernel:
            continue  # generated kernels read any buffer in place
        if st.output.flat or (nxt is not None and (st.output.dense or st.output.layout == "strided")):
            continue  # (a view is made only for a next stage that reads views: Family.reads_views)
        family = families.claimants([])[0]  # a stage of no ops: a copy
        t = st.out_type
        req = families.StageRequest(i + 1, [], (t,), st.output, nxt.family if nxt else None, pipe, target, batch, len(pipe.ops))
        copy = family.candidates(req)[0].stage
        copy.family, copy.candidates, copy.choice = family, (family.name,), f"{family.name}: the first family that copies"
        stages.insert(i + 1, copy)


def _absorb_epilogues(plan: Plan) -> None:
    """Let a stage's family take the next stage as its epilogue (a generated convolution or
    product may). The absorbed stage keeps its place: its math and its own op are still rendered.
    Never where the stage's output is read as a tensor by another stage (a value operand, a
    `from:` start: the fused op does not write it) or is an output of the graph, where the next stage reads values as tensors
    (the fused op does not take them; a value named and read in the same stage is a register), or
    where the next stage starts from another tensor than this stage's output (`from:`). Where it does
    not, a family may still gather the next stage's statistics in its kernel (gathers_statistics)."""
    # values read as tensors (an operand kept in a register of its own stage is not)
    value_tensors = {plan.value_exprs[v] for s in plan.stages for v in plan.stage_values(s)}
    value_tensors |= plan.output_tensors()  # the graph's outputs are written, read later or not
    readers_of = Counter(s.source for s in plan.stages)  # stages that start from each tensor
    for st, nxt in zip(plan.stages, plan.stages[1:]):
        output = f"t{st.index}"
        read_later = output in value_tensors or readers_of[output] > (nxt.source == output)  # another stage `from:` it
        # (nor a stage that writes channels_last, pool_reduce:channels_last: the absorbing kernels write plain tensors)
        if read_later or nxt.source != output or plan.stage_values(nxt) or (nxt.output is not None and not nxt.output.flat):
            continue
        if st.absorbed_by is None and st.family.absorbs_epilogue(st, nxt):
            st.epilogue, nxt.absorbed_by = nxt, st
        elif st.absorbed_by is None and st.family.gathers_statistics(st, nxt):
            st.moments_for, nxt.gathered_by = nxt, st
            # the statistics stage passes its input on: where nothing reads that either, only the moments
            # are wanted (rewrites.batch_stats_pass) and the kernel writes no output
            passed = f"t{nxt.index}"
            st.output_dropped = nxt is not plan.stages[-1] and passed not in value_tensors and not any(
                s.source == passed for s in plan.stages)


def _write_cats_in_place(plan: Plan) -> None:
    """Concatenation without a copy: a cat along the channels whose operand is written by a stage of the plan
    that can write a channel slice (Family.writes_channel_slice), and read by nothing but the cat, has that
    stage write it into its slice of the cat's output (Stage.into); the cat copies only its other operands.
    The binding allocates the cat's output before the stages run."""
    read = Counter(s.source for s in plan.stages)  # how often each binding tensor is read
    for s in plan.stages:
        read.update(plan.value_exprs[v] for v in plan.stage_values(s))
    kept = plan.output_tensors() | {f"t{plan.stages[-1].index}"}
    for cat in plan.stages:
        op = cat.ops[0] if len(cat.ops) == 1 else None
        if not isinstance(op, Cat) or op.dim != 1 or cat.family.name != "aten":
            continue
        operands = [cat.source] + [plan.value_exprs[n] for n in op.tensors]
        types = [cat.in_type, *op.pieces]
        in_place, channel0 = [], 0
        for pos, (tensor, t) in enumerate(zip(operands, types)):
            writer = plan.writer_of(tensor)
            if (writer is not None and writer.into is None and tensor not in kept and operands.count(tensor) == 1
                    and read[tensor] == 1 and writer.out_type == t and writer.family.writes_channel_slice(writer)):
                writer.into = ChannelSlice(cat.index, channel0, cat.out_type)
                in_place.append(pos)
            channel0 += t.shape[1]
        cat.in_place = tuple(in_place)


# ---------------------------------------------------------------- the choice


def candidate_plans(pipeline: Pipeline, target: Target | None = None, batch: int | None = None) -> list[Plan]:
    """Every plan the decision points allow, each once (by the choices it was made with),
    in breadth-first order from the default plan; at most MAX_CANDIDATES."""
    target = target or targets.current()
    found: dict[str, Plan] = {}
    queue: list[dict] = [{}]
    tried: set[str] = set()
    neighbours = lambda chosen, options: [{**chosen, point: o} for point, opts in options.items()  # noqa: E731
                                          for o in opts if o != chosen[point]]
    while queue and len(found) < MAX_CANDIDATES:
        given = queue.pop(0)
        asked = json.dumps(given, sort_keys=True)
        if asked in tried:
            continue
        tried.add(asked)
        try:
            plan = make_plan(pipeline, None, target, given, batch)
        except KgenError as e:
            if not given and pipeline.dtype == "float32":
                raise  # the default plan must exist
            # e.g. a rewrite left an op (a sub-pixel phase, a folded pool) that no family computes in this dtype:
            # the plans with another option at a decision taken before it failed (the rewrite off), then eager
            queue += neighbours(e.picked.chosen, e.picked.options)
            if not given and families.EAGER.whole(pipeline):
                queue.append({PIPELINE: EAGER})  # 16-bit: a family without kernels for it declined; eager computes it
            continue
        key = json.dumps(plan.choices, sort_keys=True)
        if key in found:
            continue
        found[key] = plan
        queue += neighbours(plan.choices, plan.options)
    return list(found.values())


@dataclass
class Variant:
    """A plan and the batches it runs (``lo`` to ``hi`` inclusive; ``hi`` None: no bound) in the
    modes it runs: ``any``, or ``train`` and ``eval`` where eval mode has a plan of its own
    (batch norm over running statistics as a per-channel affine: rewrites.batch_norm_eval_affine)."""

    plan: Plan
    lo: int = 1
    hi: int | None = None
    why: str = DEFAULT_REASON  # why this plan for these batches
    mode: str = "any"
    dtype: str = "float32"  # the input dtype it computes (the op dispatches on it first)
    # the cost model puts the eager candidate (the spec's ops through ATen) at this plan's estimate: the same work,
    # so the Dynamo backend leaves such a partition to PyTorch (kgen.backend._refuse_eager_plans)
    eager_as_fast: bool = False

    @property
    def batches(self) -> str:
        return f"{self.lo}.." + ("" if self.hi is None else str(self.hi))

    @property
    def runs(self) -> str:
        """What it runs: its batches, and its mode where eval mode has a plan of its own."""
        mode = "" if self.mode == "any" else f", {self.mode} mode"
        return ("" if self.dtype == "float32" else f"{self.dtype}, ") + f"batches {self.batches}{mode}"


@dataclass
class Selection:
    """What a module is rendered from: one plan per batch range, and how they were chosen."""

    pipeline: Pipeline  # as written
    variants: list[Variant]
    source: str  # what chose the plans
    notes: list[str] = field(default_factory=list)  # e.g. a tuning file that does not apply, and why
    candidates: list[Plan] = field(default_factory=list)  # every candidate plan considered
    tuning: object = None  # the kgen.tunefile.Entry that chose the plans, if one did (the first dtype's that has one)
    tunings: tuple = ()  # every such Entry, one per dtype a tuning file chose (Entry.dtype)

    def tuning_for(self, dtype: str):
        """The tuning file's entry that chose ``dtype``'s plans, or None."""
        return next((e for e in self.tunings if e.dtype == dtype), None)

    @property
    def name(self) -> str:
        return self.pipeline.name

    @property
    def plans(self) -> list[Plan]:
        return [v.plan for v in self.variants]

    def variant_for(self, batch: int, training: bool = False, dtype: str = "float32") -> Variant:
        """The variant the op runs for ``batch`` in the mode and dtype (batch 0 returns early, before any variant)."""
        mode = "train" if training else "eval"
        return next(v for v in self.variants
                    if v.dtype == dtype and v.mode in (mode, "any") and (v.hi is None or batch <= v.hi))

    @property
    def dtypes(self) -> list[str]:
        """The dtypes the module computes, in the spec's order."""
        return list(dict.fromkeys(v.dtype for v in self.variants))


def choose_plans(pipeline: Pipeline, target: Target | None = None, rewrites: dict | None = None) -> Selection:
    """The choice, made here and nowhere else: the plans of ``pipeline`` for ``target``.

    From the spec's tuning file when it has an entry for the target that is not stale
    (one plan per measured batch range), else the candidate the cost model estimates
    fastest at the spec's example batch. ``rewrites`` (overriding the spec's switches,
    e.g. the no-rewrite baseline) gives kgen's default plan under those switches.

    Where a batch norm uses running statistics, eval mode has plans of its own (the norm
    as a per-channel affine that fuses: ``tuned_candidates``); the tuning file (kgen tune
    measures in eval mode, as bench does) or the cost model chooses them, and the cost
    model chooses training mode's plan.
    """
    target = target or targets.current()
    chosen = [_choose_for_dtype(replace(pipeline, dtype=d), target, rewrites) for d in pipeline.dtypes]
    if len(chosen) == 1 and pipeline.dtypes == ("float32",):
        return chosen[0]
    first = chosen[0]
    return Selection(first.pipeline, [v for s in chosen for v in s.variants],
                     "; ".join(f"{s.pipeline.dtype}: {s.source}" for s in chosen),
                     [n for s in chosen for n in s.notes], [p for s in chosen for p in s.candidates],
                     next((s.tuning for s in chosen if s.tuning is not None), None), tuple(e for s in chosen for e in s.tunings))


def _choose_for_dtype(pipeline: Pipeline, target: Target, rewrites: dict | None) -> Selection:
    """choose_plans for the pipeline's dtype, as described there: the tuning file's entry for the target
    and this dtype (`kgen tune --dtype`), else the cost model among the plans that compute it."""
    from . import tunefile

    stored, notes = tunefile.spec_entry(pipeline, target)
    measured = tunefile.eager_conv_tf32(stored, pipeline)  # eager's cuDNN precision, as kgen tune found it
    if measured:
        pipeline = replace(pipeline, eager_conv_tf32=measured)
    if rewrites is not None:
        why = "rewrites overridden: the default candidates"
        try:
            plan = make_plan(pipeline, rewrites, target, {PIPELINE: KGEN}, reason=why)
        except KgenError:
            if pipeline.dtype == "float32" or not families.EAGER.whole(pipeline):
                raise
            plan = make_plan(pipeline, rewrites, target, {PIPELINE: EAGER}, reason=why)  # 16-bit: see candidate_plans
        return Selection(pipeline, [Variant(plan, why=why, dtype=pipeline.dtype)], f"fixed ({why})", candidates=[plan])
    cands, eval_mode = tuned_candidates(pipeline, target)
    if pipeline.dtype != "float32" and all(c.eager for c in cands):  # say why kgen's stages do not compute it
        try:
            make_plan(pipeline, None, target, {PIPELINE: KGEN})
        except KgenError as e:
            notes.append(f"{pipeline.dtype}: the eager plan (the ops as written through ATen) computes it: {str(e).split(': ', 2)[-1]}")
    entry, stale = tunefile.applicable_entry(stored, pipeline, target, tunefile.candidates_hash(cands))
    notes += stale
    mode = "eval" if eval_mode else "any"
    if entry is not None:
        variants = []
        for r in entry.ranges:  # schedules for the example batch, as kgen tune measured them
            why = f"measured fastest at batch {r.tuned_at} on {entry.device}: {r.ms:.3f} ms ({entry.path.name})"
            made_from = next((c.original for c in cands if c.choices == r.choices), pipeline)  # eval mode's or the spec's
            plan = make_plan(made_from, None, target, r.choices, reason=why)
            if plan.choices != r.choices:
                raise KgenError(f"{entry.path}: the choices {r.choices} do not make a plan kgen offers; run `kgen tune` again")
            variants.append(Variant(plan, r.lo, r.hi, why, mode, pipeline.dtype))
        source = f"tuning file {entry.path.name} ({entry.device})"
    else:
        plan, why, as_fast = _cheapest(cands, target)
        variants, source = [Variant(plan, why=why, mode=mode, dtype=pipeline.dtype, eager_as_fast=as_fast)], "cost model"
    if eval_mode:
        plan, why, as_fast = training_plan(pipeline, target)
        if plan.eager and all(v.plan.eager for v in variants):  # the same plan in both modes (equal choices are
            variants = [Variant(plan, why=why, dtype=pipeline.dtype)]  # not: eval mode's are of another pipeline)
        else:
            variants.insert(0, Variant(plan, why=why, mode="train", dtype=pipeline.dtype, eager_as_fast=as_fast))
            source += "; training mode: cost model" if entry is not None else ""
    return Selection(pipeline, variants, source, notes, cands, entry, (entry,) if entry is not None else ())


def tuned_candidates(pipeline: Pipeline, target: Target) -> tuple[list[Plan], bool]:
    """The candidates `kgen tune` measures and a tuning file chooses among, and whether they are
    eval mode's own. Where a batch norm uses running statistics (and the spec does not switch
    rewrites.batch_norm_eval_affine off), eval mode's: kgen's plans of the pipeline with the norm
    as a per-channel affine (a norm without running statistics as its batch statistics), and the
    spec's ops through ATen; else the training candidates (where no norm keeps running statistics),
    or every candidate."""
    eval_pipe = batch_norm_eval_affine(pipeline) if pipeline.rewrites.get(EVAL_REWRITE, True) else None
    if eval_pipe is None:
        tracked = any(isinstance(op, BatchNorm) and op.track_running_stats for op in pipeline.ops)
        return (candidate_plans(pipeline, target) if tracked else training_candidates(pipeline, target)), False
    return _and_eager(candidate_plans(_batch_stats(eval_pipe) or eval_pipe, target), pipeline, target), True


def training_candidates(pipeline: Pipeline, target: Target) -> list[Plan]:
    """The candidates for training mode (or both modes, where no batch norm keeps running
    statistics): kgen's plans of the pipeline with each batch norm as its batch statistics and a
    per-channel affine that fuses (rewrites.batch_norm_batch_stats), and the spec's ops through
    ATen; every candidate where there is no batch norm or the spec switches the rewrite off."""
    stats_pipe = _batch_stats(pipeline)
    if stats_pipe is None:
        return candidate_plans(pipeline, target)
    return _and_eager(candidate_plans(stats_pipe, target), pipeline, target)


def _batch_stats(pipeline: Pipeline) -> Pipeline | None:
    """rewrites.batch_norm_batch_stats unless the spec switches it off or the norms run as eager's calls
    (Pipeline.eager_batch_norms; None: not made)."""
    if not pipeline.rewrites.get(TRAIN_REWRITE, True) or pipeline.eager_batch_norms:
        return None
    return batch_norm_batch_stats(pipeline)


def _and_eager(cands: list[Plan], pipeline: Pipeline, target: Target) -> list[Plan]:
    """kgen's candidates of a rewritten pipeline, and the eager candidate of ``pipeline`` as written."""
    cands = [p for p in cands if not p.eager]
    if families.EAGER.whole(pipeline):
        cands.append(make_plan(pipeline, None, target, {PIPELINE: EAGER}))
    return cands


def training_plan(pipeline: Pipeline, target: Target) -> tuple[Plan, str, bool]:
    """Training mode's plan where eval mode has its own: the cost model's among the training
    candidates, why, and whether the eager candidate is as fast (_cheapest)."""
    return _cheapest(training_candidates(pipeline, target), target)


def _cheapest(cands: list[Plan], target: Target) -> tuple[Plan, str, bool]:
    """The candidate the cost model estimates fastest at its spec's example batch, then improved one
    decision at a time (made again with that reason), why, and whether the eager candidate is estimated as fast
    (Variant.eager_as_fast; a generated plan still wins such a tie). candidate_plans stops at MAX_CANDIDATES
    plans near the default one: a whole model's 16 decision points (MobileNetV2) leave most combinations
    out, so the cheapest of them alone would be the default plan with one or two choices changed."""
    from . import cost

    batch = cands[0].original.example_batch()
    estimates = [cost.estimate_ms(p, batch) for p in cands]
    best = min(range(len(cands)), key=lambda i: estimates[i])  # ties: the earlier (nearer the default)
    plan, ms, tried = _descend(cands[best], estimates[best], target, batch)
    more = f", then {tried} plans one choice apart" if plan is not cands[best] else ""
    why = f"cost model: {ms:.3f} ms at batch {batch}, the lowest of {len(cands)} candidate(s){more}"
    eager = next((e for p, e in zip(cands, estimates) if p.eager), None)
    as_fast = not plan.eager and eager is not None and round(eager, TIE_DIGITS) <= round(ms, TIE_DIGITS)
    return make_plan(plan.original, None, target, plan.choices, batch, reason=why), why, as_fast


TIE_DIGITS = 6  # estimates (ms) equal to this many decimals are a tie (Variant.eager_as_fast)
MAX_DESCENT_PASSES = 4  # passes over a plan's decision points (each pass: every option of every point)


def _descend(plan: Plan, ms: float, target: Target, batch: int) -> tuple[Plan, float, int]:
    """Coordinate descent on the cost model's estimate from ``plan``: each decision point's other options
    in turn, a change kept where the estimate falls, until a pass keeps none. Returns the plan, its
    estimate and how many plans were estimated (the stages' costs add, so where choices do not interact
    this reaches the cheapest combination in a few passes)."""
    from . import cost

    tried = 0
    for _ in range(MAX_DESCENT_PASSES):
        improved = False
        for point in [p for p in plan.options if p != PIPELINE]:  # kgen or eager: among the candidates only (eager's
            for option in plan.options.get(point, ()):  # is the spec as written, not the rewritten pipeline's)
                if option == plan.choices.get(point):
                    continue
                try:
                    other = make_plan(plan.original, None, target, {**plan.choices, point: option}, batch)
                except KgenError:
                    continue
                tried += 1
                other_ms = cost.estimate_ms(other, batch)
                if other_ms < ms * (1 - 1e-9):
                    plan, ms, improved = other, other_ms, True
        if not improved:
            break
    return plan, ms, tried


def stage_op_name(module: str, variant: int, variants: int, stage: int) -> str:
    """The op ``kgen::<this>`` of a stage with a generated kernel (plan ``variant`` of ``variants``)."""
    return f"{module}_stage{stage}" if variants == 1 else f"{module}_v{variant}_stage{stage}"


def stage_scope_name(module: str, variant: int, variants: int, stage: Stage) -> str:
    """The profiler range around a stage's calls in the op (kgen bench reads these)."""
    plan = "" if variants == 1 else f" plan {variant}"
    return f"kgen::{module}{plan} stage {stage.index} ({stage.family.name})"


def describe_choices(choices: dict) -> str:
    """A plan's choices in one line: ``eager``, or each rewrite's on/off and each stage's
    candidate at the op that starts it (``ops[i]``; ``ops[i].bias``: convolution i's deferred bias)."""
    if choices.get(PIPELINE) == EAGER:
        return "eager (the spec's ops through ATen)"
    parts = []
    for key, option in choices.items():
        if key == PIPELINE:
            continue
        what, _, site = key.partition(" @ ")
        where = site.split(".")[0] + (".bias" if site.endswith(".bias") else "")  # (the stage a deferred bias starts)
        parts.append(f"{option}@{where}" if what == "implementation" else f"{what}@{where}={option}")
    return " ".join(parts) or "kgen (no choices)"
