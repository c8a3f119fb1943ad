"""Benchmark: how long a config mistake takes to be reported, against ``python -c "import torch"``.

    python scripts/bench/first_error.py --repeat 10 --out result.json

Each case is a fresh ``python -m megatron_rlhf <command> <bad setting>`` that must exit with status 2
(a config error) before anything is built: an unknown key, a value outside a setting's choices, and
an unknown key of ``sft``. The floor is a fresh ``python -c "import torch"`` (the package imports
torch at start-up). Runs are interleaved (floor, case 1, case 2, ... then again) so that a machine
whose load changes affects each the same; the report gives each one's median wall time and its
ratio to the floor's median. The target is a ratio of at most 1.5: the check imports no megatron-core
(``tests/unit/test_schema_imports.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import median, write_report

FLOOR = ("import torch", ["-c", "import torch"])
CASES = {
    "ppo unknown key": ["-m", "megatron_rlhf", "ppo", "bad.key=1"],
    "ppo bad value": ["-m", "megatron_rlhf", "ppo", "algorithm.advantage_estimator=nope"],
    "sft unknown key": ["-m", "megatron_rlhf", "sft", "bad.key=1"],
}
CONFIG_ERROR = 2
"""The exit status of a refused config."""


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_seconds(args: list[str], *, expect: int) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of a fresh interpreter running ``args``; its exit status
    must be ``expect``. The CPU time moves less than the wall time on a machine others load."""
    cpu, start = children_cpu_seconds(), time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != expect:
        raise SystemExit(f"{' '.join(args)}: exit status {done.returncode}, expected {expect}:\n{done.stderr}")
    return wall, children_cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="runs of each (interleaved)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    walls: dict[str, list[float]] = {name: [] for name in (FLOOR[0], *CASES)}
    cpus: dict[str, list[float]] = {name: [] for name in walls}
    run_seconds(FLOOR[1], expect=0)  # warm the file cache: the first run reads torch from disk
    for _ in range(args.repeat):
        for name, argv, expect in [(FLOOR[0], FLOOR[1], 0)] + [(n, c, CONFIG_ERROR) for n, c in CASES.items()]:
            wall, cpu = run_seconds(argv, expect=expect)
            walls[name].append(wall)
            cpus[name].append(cpu)

    def summary(name: str) -> dict[str, float | list[float] | None]:
        return {"median_s": median(walls[name]), "cpu_median_s": median(cpus[name]), "samples_s": walls[name]}

    floor = summary(FLOOR[0])
    floor_wall, floor_cpu = median(walls[FLOOR[0]]) or 1.0, median(cpus[FLOOR[0]]) or 1.0
    result = {
        "python": sys.executable,
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "repeat": args.repeat,
        "floor": {"command": 'python -c "import torch"', **floor},
        "cases": {
            name: {
                "command": " ".join(["python", *case]),
                **summary(name),
                "ratio_to_floor": (median(walls[name]) or 0.0) / floor_wall,
                "cpu_ratio_to_floor": (median(cpus[name]) or 0.0) / floor_cpu,
            }
            for name, case in CASES.items()
        },
        "target_ratio": 1.5,
    }
    write_report(result, args.out)


if __name__ == "__main__":
    main()
