"""`make bench-peers` keeps one dated table per CPU kind in docs/performance.md, so that the page says where
every kind stands without the lab notes: a run replaces its own kind's section and leaves the others'.

A section sits between two markers naming the kind (`<!-- bench-peers:amx -->` ... `<!-- /bench-peers:amx
-->`) under one heading; the kind is the widest vector ISA the CPU has (AMX, AVX-512 BF16, AVX-512, AVX2),
which is what chooses our kernels (csrc/README.md), with the CPU's model name beside it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

HEADING = "## `make bench-peers`: the latest table per CPU kind"
INTRO = (
    "Written by `make bench-peers` (`python -m benchmarks.peers`): each run replaces its CPU kind's table,\n"
    "SmolLM2-135M in bf16 for every server, the same workloads side by side (docs/benchmarks.md).\n"
)
BEFORE = "## What runs on the CPU"  # where the heading goes on a page that has none yet
KINDS = (  # (flag in /proc/cpuinfo, key, words), widest first
    ("amx_bf16", "amx", "AVX-512 BF16 and AMX"),
    ("avx512_bf16", "avx512-bf16", "AVX-512 BF16, no AMX"),
    ("avx512f", "avx512", "AVX-512, no BF16"),
    ("avx2", "avx2", "AVX2, no AVX-512"),
)


def cpu_kind(model_name: str, flags: set[str]) -> tuple[str, str]:
    """(key, title): e.g. ("amx", "Intel Xeon Processor (AVX-512 BF16 and AMX)")."""
    name = re.sub(r"\((R|TM)\)", "", model_name).replace("  ", " ").strip() or "unknown CPU"
    for flag, key, words in KINDS:
        if flag in flags:
            return key, f"{name} ({words})"
    return "other", f"{name} (no AVX2)"


def this_cpu() -> tuple[str, str]:
    model, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return cpu_kind(model, flags)


def section(key: str, title: str, report: dict[str, Any], table: str, command: str) -> str:
    machine = report.get("machine", {})
    rounds = report.get("settings", {}).get("rounds")
    facts = [f"{machine.get('cpus', '?')} vCPUs", f"commit {machine.get('commit') or '?'}"]
    if machine.get("copy_bandwidth_gbs"):
        facts.append(f"copy bandwidth {machine['copy_bandwidth_gbs']:.1f} GB/s")
    if rounds:
        facts.append(f"medians of {rounds} round{'s' if rounds != 1 else ''}")
    return (
        f"<!-- bench-peers:{key} -->\n"
        f"### {title}: {report.get('date', '?')}\n\n"
        f"`{command}` ({', '.join(facts)}):\n\n"
        f"{table.strip()}\n"
        f"<!-- /bench-peers:{key} -->\n"
    )


def update(text: str, key: str, new_section: str) -> str:
    """The page with key's section replaced, or added at the end of the heading's part (made if missing)."""
    found = re.search(
        rf"^<!-- bench-peers:{re.escape(key)} -->\n.*?^<!-- /bench-peers:{re.escape(key)} -->\n",
        text,
        flags=re.M | re.S,
    )
    if found:
        return text[: found.start()] + new_section + text[found.end() :]
    if HEADING not in text:
        block = f"{HEADING}\n\n{INTRO}\n"
        at = text.find(f"\n{BEFORE}")
        text = text.rstrip("\n") + "\n\n" + block if at < 0 else text[: at + 1] + block + text[at + 1 :]
    start = text.index(HEADING) + len(HEADING)
    following = re.search(r"^## ", text[start:], flags=re.M)
    end = start + following.start() if following else len(text)
    part = text[start:end].rstrip("\n") + "\n\n" + new_section + "\n"
    return text[:start] + part + text[end:]


def write(page: Path, report: dict[str, Any], table: str, command: str) -> str:
    """Replace this CPU kind's table in page; returns the kind's title."""
    key, title = this_cpu()
    page.write_text(update(page.read_text(), key, section(key, title, report, table, command)))
    return title
