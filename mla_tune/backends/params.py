"""The backends' parameter rules as plain data: names, choices and bounds, without torch.

Each built-in backend's `validate(variant)` starts with `check_variant_rules(variant,
PARAM_RULES[NAME])` and then adds only the rules that compute over several parameters (the
fused family's combinations, a Gluon tile's shared memory, AITER's kernel pairs). Because
this module imports nothing but mla_tune.core, the readers that must stay fast and
torch-free (`mla-tune show`, `mla-tune diff`: tables.table.load_table with
check_params=False) check every name, choice and bound here with the very messages the
runtime and the export give, and tune/config.py checks a search space's values with them
(`check_space_value`), so a value no run can use fails at config load.

A backend's rules are a `ParamRules`: one or more `ParamForm`s (a parameter set: the names
it knows and requires, and an ordered list of checks, each a `ParamChoice` or a `ParamInt`,
plus `ParamQAmax` where fp8_static's q_amax may be carried). With several forms, one is
picked either by the presence of a marker parameter (`ParamForm.when_any`: the split-K
serving variants carry max_splits) or by the value of the `select` parameter (AITER's
`mode`: the forms' names are its choices).

Adding a value: append it to the choice (`ParamChoice(("a", "b", "new"))`) or widen the
bound (`ParamInt(minimum=0, maximum=16)`). Adding a parameter: add its name to the form's
`known` (and `required` if every variant carries it) and a check to `checks`; an optional
parameter that is absent is not checked unless `defaults` gives the value it stands for.
Adding an AITER mode: add a `ParamForm(name="the_mode", ...)` to its rules. A backend's
candidates() must offer only variants its rules pass (tests/test_capabilities.py checks it).
This module is exportable: the export copies it with the backends that import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mla_tune.core import (
    CORE_HEADS,
    PARAM_MAX_BLOCK_N,
    PARAM_MAX_SPLITS,
    PARAM_MAX_STAGES,
    PARAM_MAX_WARPS,
    Variant,
    check_param_choice,
    check_param_int,
    check_param_names,
    check_q_amax,
)


@dataclass(frozen=True)
class ParamChoice:
    """The value is one of `allowed`, of the same type (true is not 1, 1 is not 1.0)."""

    allowed: tuple


@dataclass(frozen=True)
class ParamInt:
    """An int (not a bool) in minimum..maximum (None: no upper bound), a power of two if
    asked, or one of `allowed_too`."""

    minimum: int = 1
    maximum: int | None = None
    power_of_two: bool = False
    allowed_too: tuple = ()


@dataclass(frozen=True)
class ParamQAmax:
    """q_amax: a finite number > 0 on an fp8_static variant, absent on every other."""


@dataclass(frozen=True)
class ParamForm:
    """One parameter set: the names it knows and requires, and its checks in order."""

    name: str
    known: tuple[str, ...]
    required: tuple[str, ...]
    checks: tuple[tuple[str, Any], ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()  # (name, value): an absent parameter is checked as value
    when_any: tuple[str, ...] = ()  # picked when a variant carries any of these (presence forms)


@dataclass(frozen=True)
class ParamRules:
    """A backend's rules: its forms, and how a variant picks one (see the module docstring)."""

    backend: str
    forms: tuple[ParamForm, ...]
    select: str | None = None  # the parameter whose value names the form
    required: tuple[str, ...] = ()  # with `select`: what every form requires
    common: tuple[tuple[str, Any], ...] = ()  # with `select`: checks before the form's own


def _pr_check(variant: Variant, name: str, rule: Any) -> None:
    if isinstance(rule, ParamChoice):
        check_param_choice(variant, name, rule.allowed)
    elif isinstance(rule, ParamInt):
        check_param_int(variant, name, minimum=rule.minimum, maximum=rule.maximum,
                        power_of_two=rule.power_of_two, allowed_too=rule.allowed_too)
    elif isinstance(rule, ParamQAmax):
        check_q_amax(variant)
    else:
        raise TypeError(f"parameter rule for {name} is a {type(rule).__name__}, not a "
                        "ParamChoice, ParamInt or ParamQAmax")


def _pr_run(variant: Variant, form: ParamForm) -> None:
    present = variant.p
    full = variant
    if any(name not in present for name, _ in form.defaults):
        full = Variant(variant.backend, tuple(sorted({**dict(form.defaults), **present}.items())))
    for name, rule in form.checks:
        if name in full.p or name in form.required or isinstance(rule, ParamQAmax):
            _pr_check(full, name, rule)


def _pr_form(variant: Variant, rules: ParamRules) -> ParamForm:
    """The form `variant` is checked against (names and the selector checked on the way)."""
    if rules.select is None:
        for form in rules.forms:
            if not form.when_any or any(name in variant.p for name in form.when_any):
                return form
        return rules.forms[-1]
    every = tuple(dict.fromkeys(n for form in rules.forms for n in form.known))
    check_param_names(variant, every, rules.required)
    value = check_param_choice(variant, rules.select, tuple(form.name for form in rules.forms))
    for name, rule in rules.common:
        _pr_check(variant, name, rule)
    form = next(form for form in rules.forms if form.name == value)
    stray = [n for n in variant.p if n not in form.known]
    if stray:
        takes = [n for n in form.known if n not in rules.required and n != "q_amax"]
        raise ValueError(f"{rules.backend}: {', '.join(stray)} is not a parameter of "
                         f"{rules.select}={value}, which takes {', '.join(takes) or 'none'}")
    return form


def check_variant_rules(variant: Variant, rules: ParamRules) -> None:
    """Raise ValueError (one sentence: the parameter, the bad value, what is allowed) for a
    parameter `rules` do not know, a missing one, or a value outside its choices or bounds."""
    form = _pr_form(variant, rules)
    check_param_names(variant, form.known, form.required)
    _pr_run(variant, form)


def check_space_value(rules: ParamRules, name: str, value: Any) -> None:
    """Raise ValueError when `value`, listed for parameter `name` in a search space, passes
    no form's rule for `name` (the message is the first form's); a name no form checks is
    left to the backend's candidates()."""
    if name == rules.select:
        probe = Variant(rules.backend, ((name, value),))
        check_param_choice(probe, name, tuple(form.name for form in rules.forms))
        return
    found = [rule for rule_name, rule in rules.common if rule_name == name]
    found += [rule for form in rules.forms for rule_name, rule in form.checks if rule_name == name]
    errors = []
    for rule in found:
        try:
            _pr_check(Variant(rules.backend, ((name, value),)), name, rule)
            return
        except ValueError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


# ------------------------------------------------------------------- the built-in rules
_PR_KV = ParamChoice(("bf16", "fp8"))
_PR_Q3 = ParamChoice(("bf16", "fp8_dynamic", "fp8_static"))
_PR_WARPS = ParamInt(maximum=PARAM_MAX_WARPS, power_of_two=True)
_PR_STAGES = ParamInt(maximum=PARAM_MAX_STAGES)
_PR_SPLITS = ParamInt(maximum=PARAM_MAX_SPLITS)
_PR_INT32_MAX = 2**31 - 1  # tokens_per_split and split_budget reach the kernels as int32
# split_budget (optional in a split-K serving variant): the most splits the whole batch runs
# (0 or absent: max_splits per sequence; the split-K kernel's serving launch).
# heads per program: a power of two dividing the head count (at most CORE_HEADS')
_PR_BLOCK_H = ParamInt(maximum=max(CORE_HEADS), power_of_two=True)
# ROCm compiler options of the split-K kernel: 0 lets the compiler choose occupancy
# (waves_per_eu, at most the 16 wave slots a CDNA SIMD has) and the MFMA tile.
_PR_HIP_KEYS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
_PR_HIP_CHECKS = (("waves_per_eu", ParamInt(minimum=0, maximum=16)),
                  ("matrix_instr_nonkdim", ParamChoice((0, 4, 16, 32))),
                  ("kpack", ParamChoice((1, 2))))
_PR_TSK_COMMON = (("kv", _PR_KV), ("q", _PR_Q3), ("dot_dtype", ParamChoice(("fp16", "bf16"))))
# the split-K kernel's tl.arange needs a power of two >= 16
_PR_TSK_TAIL = (("block_n", ParamInt(minimum=16, maximum=PARAM_MAX_BLOCK_N, power_of_two=True)),
                ("num_warps", _PR_WARPS), ("num_stages", _PR_STAGES), ("q_amax", ParamQAmax()),
                *_PR_HIP_CHECKS)
_PR_TSK_SERVING = ("kv", "q", "block_n", "block_h", "max_splits", "tokens_per_split",
                   "num_warps", "num_stages", "dot_dtype")
_PR_TSK_LEADERBOARD = ("kv", "q", "num_splits", "block_n", "num_warps", "num_stages", "dot_dtype")
# Optional in a split-K leaderboard variant (absent: 1): stage-1 programs per split, each
# multiplying its share of the value columns, and chunks of the score dot shared by the
# warps (the split-K kernel's, for AMD's register file; a torch-only export carries this
# module, so it names no kernel file).
_PR_TSK_REGISTER_CHECKS = (("v_split", ParamChoice((1, 2))), ("qk_split", ParamChoice((1, 2, 4, 8))))

_PR_FU_DOTS = ParamChoice(("fp16", "bf16", "fp8"))
_PR_FU_BLOCK_N = ParamChoice((16, 32, 64, 128))
_PR_FU_Q = ParamChoice(("bf16", "fp8_dynamic"))
_PR_FU_LEADERBOARD = ("kv", "q", "qk_dot", "pv_dot", "tok_m", "block_n", "num_warps", "num_stages",
                      "num_splits", "reduce")
_PR_FU_LATER = (("load", "ptr"), ("grid", "split"), ("waves", 1))  # triton_fused.FU_LATER_DEFAULTS
_PR_FU_SERVING = ("kv", "q", "qk_dot", "pv_dot", "block_n", "block_h", "max_splits",
                  "tokens_per_split", "num_warps", "num_stages")

# gluon_fused's serving variant (its "the serving call" says what each names)
_PR_GF_SERVING = ("kv", "q", "block_h", "max_splits", "tokens_per_split", "num_stages", "v_halves")
PR_GS_MAX_SPLITS = 64  # kernels/gluon_serving.GS_MAX_SPLITS (this module imports no kernel; a test holds them equal)

PARAM_RULES: dict[str, ParamRules] = {
    "triton": ParamRules("triton", (
        ParamForm("serving", (*_PR_TSK_SERVING, "split_budget", "q_amax", *_PR_HIP_KEYS), _PR_TSK_SERVING,
                  (*_PR_TSK_COMMON, ("max_splits", _PR_SPLITS),
                   ("tokens_per_split", ParamInt(maximum=_PR_INT32_MAX)),
                   ("split_budget", ParamInt(minimum=0, maximum=_PR_INT32_MAX)),
                   ("block_h", _PR_BLOCK_H), *_PR_TSK_TAIL),
                  when_any=("max_splits", "tokens_per_split")),
        ParamForm("leaderboard", (*_PR_TSK_LEADERBOARD, "q_amax", *_PR_HIP_KEYS, "v_split", "qk_split"),
                  _PR_TSK_LEADERBOARD,
                  (*_PR_TSK_COMMON, ("num_splits", _PR_SPLITS), *_PR_TSK_TAIL, *_PR_TSK_REGISTER_CHECKS)),
    )),
    "triton_fused": ParamRules("triton_fused", (
        ParamForm("serving", _PR_FU_SERVING, _PR_FU_SERVING,
                  (("kv", _PR_KV), ("q", _PR_FU_Q), ("qk_dot", _PR_FU_DOTS), ("pv_dot", _PR_FU_DOTS),
                   ("block_n", _PR_FU_BLOCK_N), ("block_h", _PR_BLOCK_H), ("max_splits", _PR_SPLITS),
                   ("tokens_per_split", ParamInt(maximum=_PR_INT32_MAX)), ("num_warps", _PR_WARPS),
                   ("num_stages", _PR_STAGES)),
                  when_any=("max_splits", "tokens_per_split")),
        ParamForm("leaderboard", (*_PR_FU_LEADERBOARD, *dict(_PR_FU_LATER)), _PR_FU_LEADERBOARD,
                  (("kv", ParamChoice(("bf16", "fp8", "mxfp4"))), ("q", _PR_FU_Q),
                   ("qk_dot", _PR_FU_DOTS), ("pv_dot", _PR_FU_DOTS), ("tok_m", ParamChoice((True, False))),
                   ("block_n", _PR_FU_BLOCK_N), ("reduce", ParamChoice(("none", "last", "spin"))),
                   ("load", ParamChoice(("ptr", "tma", "tma_host"))),
                   ("grid", ParamChoice(("split", "persistent"))), ("waves", ParamChoice((1, 2))),
                   ("num_warps", _PR_WARPS), ("num_stages", _PR_STAGES), ("num_splits", _PR_SPLITS)),
                  defaults=_PR_FU_LATER),
    )),
    "gluon_fused": ParamRules("gluon_fused", (
        # the serving call (kernels/gluon_serving.py; gluon_fused's "the serving call")
        ParamForm("serving", (*_PR_GF_SERVING, "split_budget"), _PR_GF_SERVING,
                  (("kv", ParamChoice(("bf16", "fp8"))), ("q", ParamChoice(("bf16", "fp8_dynamic"))),
                   ("block_h", ParamInt(maximum=128, power_of_two=True)),
                   ("max_splits", ParamInt(maximum=PR_GS_MAX_SPLITS)),
                   ("tokens_per_split", ParamInt(minimum=64, maximum=_PR_INT32_MAX)),
                   ("num_stages", ParamInt(minimum=2, maximum=4)), ("v_halves", ParamChoice((1, 2))),
                   ("split_budget", ParamInt(minimum=0, maximum=_PR_INT32_MAX))),
                  when_any=("max_splits", "tokens_per_split")),
        ParamForm("leaderboard", ("kv", "q", "block_n", "num_stages", "num_splits", "v_path", "reduce", "ws",
                                  "q_load", "part"),
                  ("kv", "q", "block_n", "num_stages", "num_splits", "v_path"),
                  (("reduce", ParamChoice(("launch", "spin"))), ("ws", ParamChoice((0, 1, 2))),
                   ("q_load", ParamChoice(("twice", "first"))), ("part", ParamChoice(("fp32", "bf16"))),
                   ("kv", ParamChoice(("fp8",))), ("q", ParamChoice(("fp8_dynamic",))),
                   ("block_n", ParamChoice((64, 128))), ("num_stages", ParamInt(minimum=2, maximum=4)),
                   ("num_splits", _PR_SPLITS), ("v_path", ParamChoice(("ss16", "rs16", "rs8", "ss16a"))))),
    )),
    "torch": ParamRules("torch", (
        ParamForm("leaderboard", ("kv", "q"), ("kv", "q"),
                  (("kv", ParamChoice(("bf16",))), ("q", ParamChoice(("bf16",))))),
    )),
    "aiter": ParamRules("aiter", (
        ParamForm("nonpersistent", ("kv", "q", "mode", "q_amax", "num_kv_splits"),
                  ("kv", "q", "mode", "num_kv_splits"),
                  (("q_amax", ParamQAmax()), ("num_kv_splits", ParamInt()))),
        ParamForm("persistent", ("kv", "q", "mode", "q_amax", "kv_granularity", "max_split_per_batch",
                                 "fast_mode", "intra_batch", "opus"),
                  ("kv", "q", "mode", "kv_granularity", "max_split_per_batch", "fast_mode", "intra_batch"),
                  (("q_amax", ParamQAmax()), ("kv_granularity", ParamInt(power_of_two=True)),
                   ("max_split_per_batch", ParamInt(allowed_too=(-1,))),
                   ("fast_mode", ParamChoice((True, False))), ("intra_batch", ParamChoice((True, False))),
                   ("opus", ParamChoice((True, False))))),
        # the persistent work list with mla_decode_fwd's wrapper skipped: persistent's
        # parameters, OPUS excepted (the OPUS stage 1 is another op than the one it calls)
        ParamForm("direct", ("kv", "q", "mode", "q_amax", "kv_granularity", "max_split_per_batch",
                             "fast_mode", "intra_batch"),
                  ("kv", "q", "mode", "kv_granularity", "max_split_per_batch", "fast_mode", "intra_batch"),
                  (("q_amax", ParamQAmax()), ("kv_granularity", ParamInt(power_of_two=True)),
                   ("max_split_per_batch", ParamInt(allowed_too=(-1,))),
                   ("fast_mode", ParamChoice((True, False))), ("intra_batch", ParamChoice((True, False))))),
        ParamForm("gluon", ("kv", "q", "mode", "q_amax"), ("kv", "q", "mode"), (("q_amax", ParamQAmax()),)),
    ), select="mode", required=("kv", "q", "mode"), common=(("kv", _PR_KV), ("q", _PR_Q3))),
    "flashinfer": ParamRules("flashinfer", (
        ParamForm("leaderboard", ("kernel", "kv", "q"), ("kernel", "kv", "q"),
                  (("kernel", ParamChoice(("fa3", "fa2"))), ("kv", _PR_KV), ("q", ParamChoice(("bf16",))))),
    )),
    "flashmla": ParamRules("flashmla", (
        ParamForm("leaderboard", ("kv", "q", "q_amax"), ("kv", "q"),
                  (("kv", _PR_KV), ("q", _PR_Q3), ("q_amax", ParamQAmax()))),
    )),
}


def param_rules(backend: str) -> ParamRules | None:
    """The built-in backend's rules (None for a plugin backend: its validate() alone)."""
    return PARAM_RULES.get(backend)
