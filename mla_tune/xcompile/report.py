"""The compile check (check.py's dict) as text that fits 80 columns, or as Markdown.

One row per distinct binary: ok or ERROR, the kernel, registers (AMD: arch VGPRs + AGPRs;
CUDA: registers per thread), scratch bytes (AMD: private segment per lane; CUDA: spill
stores), LDS / shared memory bytes, MMA instructions, occupancy (AMD: waves per SIMD; CUDA:
CTAs / warps per SM) and how many candidates use it (`--users` lists them). A failed
binary's first error line follows its row; then the candidates the plan drops, each with
its reason.
"""

from __future__ import annotations

import textwrap

WIDTH = 80


def _is_hip(report: dict) -> bool:
    return report["target"].startswith("hip")


def summary_lines(report: dict) -> list[str]:
    """The check's header: target, Triton, counts, drops by kind, the version note."""
    binaries = report["binaries"]
    errors = sum(1 for b in binaries if not b.get("ok"))
    over = sum(1 for b in binaries if b.get("over_lds"))
    drops = [r for per in report["drops"].values() for r in per.values()]
    dupes = sum(1 for r in drops if "same code" in r)
    lds = sum(1 for r in drops if "shared memory (LDS)" in r)
    candidates = len({(s, label) for b in binaries for s, label in b["users"]
                      if not label.startswith("q_quant(")})
    lines = [
        f"compile check: {report['gpu']} ({report['target']}), Triton {report['triton']}, "
        f"{report['jobs']} processes, {report['wall_s']:.1f} s",
        f"  {candidates} candidates and q_quant: {len(binaries)} distinct binaries "
        f"({report['compiled']} compiled, {report['cached']} from the cache)",
        f"  {errors} compile errors, {over} over the LDS limit of {report['lds_limit']} B, "
        f"{len(report['capture_errors'])} capture errors",
        f"  dropped from the plan: {len(drops)} ({len(drops) - dupes - lds} compile errors, "
        f"{lds} over LDS, {dupes} duplicates)",
    ]
    if report.get("not_compiled"):
        lines.append("  not compiled (vendor code, not mla-tune's Triton): "
                     + ", ".join(f"{k} {n}" for k, n in sorted(report["not_compiled"].items())))
    if report.get("version_note"):
        lines += textwrap.wrap(f"note: {report['version_note']}", WIDTH, initial_indent="  ",
                               subsequent_indent="    ")
    return lines


def _cells(b: dict, hip: bool) -> tuple[str, str, str, str, str]:
    if not b.get("ok"):
        return ("-",) * 5
    if hip:
        regs = f"{b.get('arch_vgprs') or 0}+{b.get('agprs') or 0}"
        occupancy = str(b.get("waves_per_simd"))
    else:
        regs = str(b.get("registers"))
        occupancy = f"{b.get('ctas_per_sm')}/{b.get('warps_per_sm')}"
    return regs, str(b.get("scratch")), str(b.get("lds")), str(b.get("mma")), occupancy


def binary_lines(report: dict, users: bool = False) -> list[str]:
    hip = _is_hip(report)
    head = ("VGPR+AGPR", "scratch", "LDS", "MMA", "waves") if hip else \
        ("regs", "spill", "smem", "MMA", "CTA/warp")
    fmt = "{:<6} {:<20} {:>9} {:>7} {:>7} {:>5} {:>8} {:>5}"
    lines = [fmt.format("status", "kernel", *head, "uses")]
    for b in report["binaries"]:
        status = ("ok" if not b.get("over_lds") else "LDS!") if b.get("ok") else "ERROR"
        lines.append(fmt.format(status, b["kernel"][:20], *_cells(b, hip), len(b["users"])))
        if not b.get("ok"):
            lines += textwrap.wrap(str(b.get("error")), WIDTH, initial_indent="    ",
                                   subsequent_indent="    ")
        if users:
            lines += [f"    {shape} {label}" for shape, label in b["users"]]
    return lines


def drop_lines(report: dict) -> list[str]:
    lines = []
    for item in report["capture_errors"]:
        lines.append(f"capture error: {item['shape']} {item['label']}")
        lines += textwrap.wrap(item["error"], WIDTH, initial_indent="    ", subsequent_indent="    ")
    for shape, per in report["drops"].items():
        for label, reason in per.items():
            lines.append(f"dropped: {shape} {label}")
            lines += textwrap.wrap(reason, WIDTH, initial_indent="    ", subsequent_indent="    ")
    return lines


def text_lines(report: dict, users: bool = False) -> list[str]:
    return [*summary_lines(report), "", *binary_lines(report, users), *([""] if report["drops"] or
            report["capture_errors"] else []), *drop_lines(report)]


def markdown(report: dict, command: str) -> str:
    """A Markdown section of the check, headed by the command that made it."""
    hip = _is_hip(report)
    out = [f"## {report['gpu']} ({report['target']}), Triton {report['triton']}", "",
           f"`{command}`", ""]
    out += [f"- {line.strip()}" for line in summary_lines(report)[1:] if not line.startswith("    ")]
    if report.get("version_note"):
        out[-1] = f"- note: {report['version_note']}"
    head = ("VGPR+AGPR", "scratch B", "LDS B", "MMA", "waves/SIMD") if hip else \
        ("registers", "spill stores B", "smem B", "MMA", "CTAs/warps per SM")
    out += ["", f"| status | kernel | {' | '.join(head)} | candidates | first user |",
            "|" + "---|" * (len(head) + 4)]
    for b in report["binaries"]:
        status = ("ok" if not b.get("over_lds") else "over LDS") if b.get("ok") else "ERROR"
        first = f"{b['users'][0][0]} `{b['users'][0][1]}`" if b["users"] else ""
        out.append(f"| {status} | {b['kernel']} | {' | '.join(_cells(b, hip))} | {len(b['users'])} | {first} |")
    errors = [b for b in report["binaries"] if not b.get("ok")]
    if errors:
        out += ["", "Compile errors (first error line):", ""]
        out += [f"- {b['kernel']} ({len(b['users'])} candidates): `{b.get('error')}`" for b in errors]
    if report["drops"]:
        out += ["", "Dropped from the plan:", ""]
        out += [f"- {shape} `{label}`: {reason}" for shape, per in report["drops"].items()
                for label, reason in per.items()]
    if report["capture_errors"]:
        out += ["", "Capture errors:", ""]
        out += [f"- {e['shape']} `{e['label']}`: {e['error']}" for e in report["capture_errors"]]
    return "\n".join(out) + "\n"
