"""Every relative link in the docs, the READMEs and the lab notes leads to a file that is in git: a benchmark's
own output (benchmarks/results/*.json, *.md other than peers.md) is ignored by git, so a link to one works on
the machine that ran it and nowhere else."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


def test_relative_links_lead_to_files_in_git() -> None:
    files = tracked()
    pages = sorted(name for name in files if name.endswith(".md"))
    assert "docs/performance.md" in pages and "README.md" in pages
    broken = []
    for page in pages:
        text = (ROOT / page).read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address, a mail address, or a heading of the same page
            path = ((ROOT / page).parent / target.split("#", 1)[0]).resolve()
            name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
            in_git = name in files or any(f.startswith(name + "/") for f in files if name)
            if not in_git:
                broken.append(f"{page}: {target}")
    assert not broken, "links to files not in git:\n" + "\n".join(broken)
