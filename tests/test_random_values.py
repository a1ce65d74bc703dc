"""Seeded random pipelines with values through render, the CPU build and validation.

Like test_random_pipelines.py, but the pipelines are DAGs: results named with
`as:` and read again later as tensor operands (residuals, `x * f(x)`), a stage
started on an earlier value with `from:`, a reduction kept with keepdim and
broadcast back, and sometimes a second input. Which values can be read where
follows the shapes (an operand broadcasts to the value it meets). A failure
names the seed and the spec: ``random_value_spec(SEED + i, i)`` reproduces it.
"""
import random

import pytest
import yaml

from conftest import build_drawn_specs, pipeline_of, validate_drawn_spec
from kgen.errors import KgenError
from kgen.ops import elementwise_ops

SEED = 7700
COUNT = 12  # modules; each CPU build costs seconds
BINARY = ("add", "sub", "mul", "maximum", "minimum")  # ops that read a value as their operand


def _broadcasts(operand, shape) -> bool:
    return len(operand) == len(shape) and all(o in (1, s) for o, s in zip(operand, shape))


def _unary(rng) -> dict | str:
    entry = rng.choice([e for e in elementwise_ops() if not e.operand])
    return {entry.name: dict(entry.example)} if entry.example else entry.name


class _Draw:
    """The ops drawn so far, the shape they end in and the values that can be read."""

    def __init__(self, rng, ew, channels, spatial, second_input):
        self.rng, self.ew = rng, ew
        self.x = [channels] + spatial
        self.second = second_input
        self.inputs = {"x": list(self.x)}
        self.ops, self.values = [], {}  # value name -> shape ([C, *S])

    def text(self, index) -> str:
        raw = {"name": f"random_values_{index}"}
        raw["inputs"] = {n: {"shape": ["N"] + s, "dtype": "float32"} for n, s in self.inputs.items()}
        raw["example"] = {"N": 2}
        raw["ops"] = self.ops
        return yaml.safe_dump(raw, sort_keys=False)

    def shape(self, index) -> list:
        return list(pipeline_of(self.text(index)).output.shape[1:])

    def name(self, op, shape):
        """Name the result of ``op`` (the last op) as a value."""
        name = f"v{len(self.values)}"
        if isinstance(op, str):
            self.ops[-1] = op = {op: {}}
        next(iter(op.values()))["as"] = name
        self.values[name] = shape
        return name

    def read(self, shape):
        """An op reading a value (or the second input) that broadcasts to ``shape``; None if none does."""
        op = self.rng.choice(BINARY)
        if self.second and self.rng.random() < 0.5 and "y" not in self.inputs:
            self.inputs["y"] = list(shape)  # a second input of the shape it meets
            return {op: {"tensor": "y"}}
        names = [n for n, s in self.values.items() if _broadcasts(s, shape)]
        return {op: {"tensor": self.rng.choice(names)}} if names else None


def random_value_spec(seed: int, index: int) -> str:
    rng, ew = random.Random(seed), random.Random(seed + 1_000_003)
    while True:
        rank = rng.choice((1, 2, 2, 3))
        spatial = [rng.randint(4, 8 if rank < 3 else 5) for _ in range(rank)]
        d = _Draw(rng, ew, rng.randint(1, 4), spatial, rng.random() < 0.5)
        try:
            if rng.random() < 0.6:
                k = rng.randint(1, 3)
                d.ops.append({f"conv{rank}d": {"out_channels": rng.randint(2, 5), "kernel_size": k,
                                               "padding": rng.randint(0, k // 2)}})
                if rng.random() < 0.7:
                    d.name(d.ops[-1], d.shape(index))  # the convolution's output, read later
            d.ops.append(_unary(ew))
            shape = d.shape(index)
            d.name(d.ops[-1], shape)
            if rng.random() < 0.5:  # x * f(x), a residual, ...: a value read in its own stage
                d.ops.append(_unary(ew))
                op = d.read(shape)
                if op:
                    d.ops.append(op)
            if rng.random() < 0.5:  # a statistic kept with keepdim, broadcast back onto an earlier value
                dims = sorted(rng.sample(range(1, 2 + rank), rng.randint(1, rank)))
                d.ops.append({rng.choice(("mean", "max", "sum")): {"dim": dims, "keepdim": True}})
                m = d.name(d.ops[-1], d.shape(index))
                source = rng.choice(list(d.values)[:-1])
                d.ops.append({rng.choice(("sub", "add", "mul")): {"from": source, "tensor": m}})
            shape = d.shape(index)
            if rng.random() < 0.4:
                C = shape[0]
                d.ops.append({"group_norm": {"num_groups": rng.choice([g for g in range(1, C + 1) if C % g == 0])}})
            else:
                k = [rng.randint(1, min(2, n)) for n in shape[1:]]
                d.ops.append({f"{rng.choice(('max', 'avg'))}_pool{rank}d": {"kernel_size": k}})
            d.ops.append(_unary(ew))
            op = d.read(d.shape(index))
            if op:
                d.ops.append(op)
            dims = sorted(rng.sample(range(1, 2 + rank), rng.randint(1, 1 + rank)))
            d.ops.append({rng.choice(("sum", "mean", "max", "min")): {"dim": dims}})
            text = d.text(index)
            pipeline_of(text)
        except KgenError:
            continue  # a pool that does not fit, a norm over one element, ...
        if any("tensor" in a for o in d.ops if isinstance(o, dict) for a in o.values()):
            return text


SPECS = [random_value_spec(SEED + i, i) for i in range(COUNT)]


def _where(i: int) -> str:
    return f"random pipeline with values {i} (seed {SEED + i}):\n{SPECS[i]}"


@pytest.fixture(scope="module")
def random_modules(tmp_path_factory):
    return build_drawn_specs(tmp_path_factory.mktemp("random_values"), SPECS, "random_values", _where)


def test_the_draws_cover_values():
    """The fixed seed draws what the file claims to cover."""
    from kgen.plan import make_plan
    from kgen.target import DEFAULT

    raw = [yaml.safe_load(t) for t in SPECS]
    args = [a for r in raw for o in r["ops"] if isinstance(o, dict) for a in o.values()]
    assert any("from" in a for a in args) and sum("tensor" in a for a in args) >= 3
    assert any(len(r["inputs"]) == 2 for r in raw)
    plans = [make_plan(pipeline_of(t), target=DEFAULT) for t in SPECS]
    assert any(p.stages[0].kind == "conv" for p in plans)
    assert any(p.stage_values(s) for p in plans for s in p.kernel_stages())  # a value read as a tensor


@pytest.mark.slow
@pytest.mark.parametrize("i", range(COUNT))
def test_random_pipeline_with_values_validates_on_the_cpu_build(i, random_modules):
    validate_drawn_spec(*random_modules, "random_values", i, _where)
