"""Names a spec may not use: every parameter and submodule name becomes a
Python identifier (attribute, argument) and a C++ one (argument, struct
member) next to the names the generated code uses itself.
"""
from __future__ import annotations

import functools
import keyword
import re

# Names a spec may not use for its parameters or submodules: each becomes a
# Python identifier (attribute, argument) and a C++ one (argument, struct
# member), next to the names the generated code uses itself. The module's own
# name has fewer rules (module_name_reason).
CPP_KEYWORDS = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t
    class compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield
    decltype default delete do double dynamic_cast else enum explicit export extern false float for friend
    goto if import inline int long module mutable namespace new noexcept not not_eq nullptr operator or
    or_eq private protected public register reinterpret_cast requires return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try typedef typeid
    typename union unsigned using virtual void volatile wchar_t while xor xor_eq final override
""".split())
CPP_MACROS_AND_TYPES = frozenset("""
    assert errno offsetof setjmp va_arg va_start va_end linux unix major minor
    int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t size_t ptrdiff_t intptr_t uintptr_t
    half dim3 std at c10 kgen torch cuda
""".split())
# Locals, arguments and struct members of the generated binding and module
# (a parameter named `x` or `torch` would shadow them).
GENERATED_NAMES = frozenset("x self torch forward in out like guard batch a partial stats splits params buffers values factors".split())
GENERATED_PATTERN = re.compile(
    r"(t|x|w|s|stage|level)[0-9]+\Z"  # per-stage locals and namespaces of the binding
    r"|.*_c\Z"  # the binding's contiguous copy of parameter P is P_c
    r"|(u?(char|short|int|long|longlong)|float|double)[1-4]\Z"  # CUDA vector types
)
# kgen's own ops (NAME_stageK), variants (NAME_norewrite), and `name`, an
# attribute of torch.ops.kgen (no op can be reached under it)
OWN_OPS_PATTERN = re.compile(r"name\Z|.*_(stage[0-9]+|norewrite)\Z")


@functools.lru_cache(maxsize=None)
def _module_attributes() -> frozenset:
    import torch

    return frozenset(n for n in dir(torch.nn.Module()) if not n.startswith("_"))


def module_name_reason(name: str) -> str | None:
    """Why ``name`` cannot name a generated module (package entry, op kgen::NAME); None if it can."""
    if keyword.iskeyword(name):
        return "a Python keyword"
    if name in CPP_KEYWORDS:
        return "a C++ keyword"
    if OWN_OPS_PATTERN.match(name):
        return "a name kgen's own ops use"
    return None


def reserved_reason(name: str) -> str | None:
    """Why ``name`` cannot name a parameter or submodule; None if it can."""
    reason = module_name_reason(name)
    if reason:
        return reason
    if name in CPP_MACROS_AND_TYPES:
        return "a C/C++/CUDA name the generated code sees"
    if name in _module_attributes():
        return "an attribute of torch.nn.Module"
    if name in GENERATED_NAMES or GENERATED_PATTERN.match(name):
        return "a name the generated code uses"
    return None


def value_reserved_reason(name: str) -> str | None:
    """Why ``name`` cannot name a value (an input or an op's result named with `as:`): the
    rules of parameters, except that the first input is conventionally `x`."""
    return None if name == "x" else reserved_reason(name)


# A member path: a submodule or parameter of a nested model, as its state_dict prefix
# (`layer1.0.conv1`): the first segment an attribute of the model, the others attributes
# of submodules or the keys of nn.Sequential / nn.ModuleList ("0", "1", ...) and nn.ModuleDict.
PATH_SEGMENT = re.compile(r"[a-z_][a-z0-9_]*\Z|[0-9]+\Z")


def path_reason(path: str) -> str | None:
    """Why ``path`` (``conv`` or ``layer1.0.conv1``) cannot name a submodule or parameter; None if it can.

    A plain name follows ``reserved_reason``. In a dotted path each part is an attribute of
    the model or a submodule (not a Python keyword, not an attribute of torch.nn.Module, which
    the attribute would hide; the generated code reads it as ``self.layer1``), and the
    identifier the generated code derives from the path (dots -> ``_``: ``layer1_0_conv1``)
    follows ``reserved_reason``."""
    if "." not in path:
        return reserved_reason(path)
    for seg in path.split("."):
        if not PATH_SEGMENT.match(seg):
            return f"a path with the part {seg!r} (expected [a-z_][a-z0-9_]* or digits)"
        if keyword.iskeyword(seg) or seg in _module_attributes():
            return f"a path with the part '{seg}', an attribute of torch.nn.Module or a Python keyword"
    derived = path.replace(".", "_")
    reason = reserved_reason(derived)
    return f"a path whose identifier '{derived}' is {reason}" if reason else None
