"""The mutation score of the last `mutmut run` (its results in mutants/), per module and in all.

    python tests/mutation/score.py [--survivors]

Score: killed (a test failed, or the mutant timed out) over the mutants that were checked and
have tests; "no tests" mutants (module-level code) are listed apart.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[2]
KILLED = ("killed", "timeout", "caught by type check", "segfault")


def statuses() -> dict[str, Counter[str]]:
    """Per mutated module, how many mutants ended in each status."""
    by_module: dict[str, Counter[str]] = {}
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        module = str(meta.relative_to(ROOT / "mutants")).removesuffix(".meta")
        by_module[module] = Counter(status_by_exit_code[code] for code in codes.values())
    return by_module


def score(counts: Counter[str]) -> str:
    killed = sum(counts[status] for status in KILLED)
    checked = killed + counts["survived"] + counts["suspicious"]
    return f"{killed}/{checked} killed ({100 * killed / checked:.1f} %)" if checked else "nothing checked"


def main() -> int:
    by_module = statuses()
    if not by_module:
        print("no results in mutants/: run `mutmut run` first")
        return 1
    total: Counter[str] = Counter()
    for module, counts in by_module.items():
        total += counts
        rest = {k: v for k, v in counts.items() if k not in (*KILLED, "survived")}
        print(f"{module:32} {score(counts):28} survived {counts['survived']:4} {rest or ''}")
    print(f"{'all':32} {score(total):28} survived {total['survived']:4}")
    if "--survivors" in sys.argv:
        print("survivors: `mutmut results`; one mutant's diff: `mutmut show NAME`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
