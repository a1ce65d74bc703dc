"""A seeded spec fuzzer: random mutations of the shipped specs (wrong types, huge and
tiny numbers, deleted and extra keys, unicode, deep nesting, broken YAML text).

Every outcome must be a spec that plans and renders, or a KgenError (SpecError)
whose message is one line under a length limit: never another exception type.
"""
import math
import random
from pathlib import Path

import pytest
import yaml

from conftest import SPECS
from kgen.errors import MAX_SPEC_MESSAGE, KgenError
from kgen.ir import build_pipeline
from kgen.plan import make_plan
from kgen.render import render_plan
from kgen.spec import parse_spec, spec_from_data

ORIGINALS = [yaml.safe_load(p.read_text()) for p in SPECS]
TEXTS = [p.read_text() for p in SPECS]

VALUES = [
    None, True, False, 0, 1, -1, 2, 3, 7, 64, 2**31 - 1, 2**31, 2**63, 10**12, 10**400, -(10**400),
    0.5, -2.5, 1e-5, 1e300, -1e300, 1e-320, math.inf, -math.inf, math.nan, 3.4028235e38,
    "", "N", "B", "x", "relu", "sum", "conv", "float32", "float16", "tf32", "randn", "auto",
    "lambda", "class", "int", "torch", "forward", "training", "cuda", "name", "a" * 65, "ü" * 10, "名前",
    "a\nb", "'; import os #", "{{ x }}", "x" * 10_000,
    [], {}, [1], [1, 2], [1, 2, 3], [0, 0, 0], [-1], ["N", 4, 8, 8], [[1, 2], [3]], {"a": 1}, {"N": 2},
]


def _deep(depth: int):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


def _random_value(rng: random.Random):
    roll = rng.random()
    if roll < 0.05:
        return _deep(rng.choice([5, 40, 5000]))
    if roll < 0.15:
        return rng.randint(-(2**40), 2**40)
    return rng.choice(VALUES)


def _containers(node, out, depth=0):
    """The dicts and lists inside ``node`` (itself included), down to 20 levels."""
    if isinstance(node, (dict, list)) and depth < 20:
        out.append(node)
        for v in node.values() if isinstance(node, dict) else node:
            _containers(v, out, depth + 1)
    return out


def _mutate(data, rng: random.Random):
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(_containers(data, []))
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        action = rng.random()
        ints = [k for k in keys if isinstance(target[k], int) and not isinstance(target[k], bool)]
        if ints and action < 0.3:  # a nearby or a far size: keeps the spec valid more often
            k = rng.choice(ints)
            target[k] = rng.choice([target[k] + rng.randint(-3, 3), target[k] * rng.randint(2, 9), 2 ** rng.randint(0, 40)])
        elif keys and action < 0.6:
            target[rng.choice(keys)] = _random_value(rng)
        elif keys and action < 0.75:
            del target[rng.choice(keys)]
        elif isinstance(target, dict):
            target[rng.choice(["extra", "name", "ops", "dim", "padding", "stride", "ü", 5, None])] = _random_value(rng)
        else:
            target.insert(rng.randint(0, len(target)), _random_value(rng))
    return data


def _check(make_spec):
    """Build, plan and render whatever ``make_spec`` gives; errors must be one bounded line."""
    try:
        pipe = build_pipeline(make_spec())
        render_plan(make_plan(pipe), Path("generated"))
        return "ok"
    except KgenError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) <= MAX_SPEC_MESSAGE, msg[:300]
        return "error"


def _seeds(n: int) -> list:
    """Seeds 0 .. n-1; past the first, more of the same random search: the slow set runs those."""
    return [pytest.param(seed, marks=[pytest.mark.slow] if seed else []) for seed in range(n)]


def _mutated_text(text: str, rng: random.Random) -> str:
    pos = rng.randrange(len(text) + 1)
    action = rng.random()
    if action < 0.3:
        return text[:pos]  # truncated
    if action < 0.5:
        return text[:pos] + text[pos + rng.randint(1, 20):]  # a piece cut out
    if action < 0.7:
        return text[:pos] + rng.choice(["[", "{", "]", "}", ":", "- ", "&a ", "*a", "!!python/object ", "\t", "\n  ", "'", "\"", "ü", "\x00"]) + text[pos:]
    if action < 0.85:
        return text + rng.choice(["name: again\n", "ops: []\n", "x: &a [1]\ny: *a\n", "%YAML 1.1\n", "---\nname: t\n"])
    return text[:pos] + "[" * 40 + "1" + "]" * 40 + text[pos:]


@pytest.mark.parametrize("seed", _seeds(3))
def test_mutated_spec_data(seed):
    rng = random.Random(seed)
    outcomes = {"ok": 0, "error": 0}
    for i in range(250):
        data = _mutate(yaml.safe_load(yaml.safe_dump(rng.choice(ORIGINALS))), rng)
        outcomes[_check(lambda: spec_from_data(data, f"fuzz-{seed}-{i}.yaml"))] += 1
        if i % 10 == 0:  # through YAML text too (values YAML can carry)
            try:
                text = yaml.safe_dump(data, allow_unicode=True)
            except (yaml.YAMLError, RecursionError):
                continue
            _check(lambda: parse_spec(text, "fuzz.yaml"))
    assert outcomes["error"] > 0 and outcomes["ok"] > 0  # the fuzzer reaches both sides


@pytest.mark.parametrize("seed", _seeds(2))
def test_mutated_spec_text(seed):
    rng = random.Random(100 + seed)
    for i in range(150):
        text = _mutated_text(rng.choice(TEXTS), rng)
        _check(lambda: parse_spec(text, f"fuzz-{seed}-{i}.yaml"))
