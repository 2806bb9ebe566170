"""Import time: what ``import fulmen`` adds to ``import torch``, measured in fresh Python processes.

Each run starts a new interpreter that times ``import torch`` and then ``import fulmen`` (so fulmen's figure
is the time it adds on top of torch), plus, for reference, a separate process that imports torch alone.
Figures are medians over the runs.

Target (issue 2): ``import fulmen`` adds under 0.5 s.

    python benchmarks/bench_import.py
    python benchmarks/bench_import.py --runs 11 --importtime 15   # and the 15 slowest modules fulmen pulls in
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

TARGET_S = 0.5

_TIMED = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import fulmen; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)"
)
_TORCH_ONLY = "import time; t0 = time.perf_counter(); import torch; print(time.perf_counter() - t0)"


def _run(code: str, extra: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    return subprocess.run([sys.executable, *(extra or []), "-c", code], capture_output=True, text=True, env=env,
                          check=True, stdin=subprocess.DEVNULL)


def slowest_fulmen_imports(count: int) -> list[tuple[float, str]]:
    """Modules imported by ``import fulmen`` (after torch) sorted by their own import time (``-X importtime``)."""
    out = _run("import torch; import fulmen", ["-X", "importtime"]).stderr
    seen_torch_done = False
    rows = []
    for line in out.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (.*)$", line)
        if not m:
            continue
        self_us, cumulative_us, name = int(m.group(1)), int(m.group(2)), m.group(3)
        if name.strip() == "torch":
            seen_torch_done = True
            continue
        if seen_torch_done:
            rows.append((self_us / 1e3, cumulative_us / 1e3, name.rstrip()))
    rows.sort(key=lambda r: -r[0])
    return rows[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--importtime", type=int, metavar="N", default=0,
                        help="also list the N modules with the largest own import time under `import fulmen`")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    _run("import torch, fulmen")  # warm the file system cache and __pycache__ once, untimed
    torch_alone, torch_first, fulmen_added = [], [], []
    for _ in range(args.runs):
        torch_alone.append(float(_run(_TORCH_ONLY).stdout.split()[0]))
        t_torch, t_fulmen = map(float, _run(_TIMED).stdout.split())
        torch_first.append(t_torch)
        fulmen_added.append(t_fulmen)

    def row(name: str, xs: list[float]) -> str:
        return f"{name:<36} {statistics.median(xs):>9.3f} {min(xs):>8.3f} {max(xs):>8.3f}"

    print(f"import times in fresh processes (median of {args.runs}), Python {sys.version.split()[0]}\n")
    print(f"{'what':<36} {'median s':>9} {'min s':>8} {'max s':>8}")
    print(row("import torch (alone)", torch_alone))
    print(row("import torch (before fulmen)", torch_first))
    print(row("import fulmen, after torch", fulmen_added))
    added = statistics.median(fulmen_added)
    print(f"\ntarget: import fulmen adds < {TARGET_S} s -> {added:.3f} s: {'met' if added < TARGET_S else 'MISSED'}")

    if args.importtime:
        print("\nslowest modules under `import fulmen` (own time; -X importtime, one run):")
        print(f"{'own ms':>8} {'cumul ms':>9}  module")
        for self_ms, cumulative_ms, name in slowest_fulmen_imports(args.importtime):
            print(f"{self_ms:>8.1f} {cumulative_ms:>9.1f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch_alone_s": torch_alone, "torch_s": torch_first, "fulmen_added_s": fulmen_added,
                       "median_fulmen_added_s": added}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
