"""``fastppo bench``: print the bench tables, optionally writing them as JSON and markdown."""

import argparse
from pathlib import Path

import torch

from .report import markdown, to_json
from .runner import FAMILIES, run_suite


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo bench", description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", choices=list(FAMILIES),
                        help="an op family to run (repeatable; default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes that finish in seconds on a CPU")
    parser.add_argument("--json", type=Path, help="also write the rows and the machine as JSON here")
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    parser.add_argument("--time-budget", type=float, default=float("inf"), metavar="SECONDS",
                        help="stop measuring after this long; the rest is listed as skipped")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")

    def write(meta, rows):
        for path, render in ((args.json, to_json), (args.markdown, markdown)):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(render(meta, rows))

    meta, rows = run_suite(args.op or list(FAMILIES), torch.device(args.device), quick=args.quick,
                           time_budget_s=args.time_budget, on_case=write)
    write(meta, rows)
    print(markdown(meta, rows), end="")
    return 0
