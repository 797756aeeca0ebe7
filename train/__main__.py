"""Command line: `python -m train [--preset=NAME] [--optimizer=NAME] [--key=value ...]`.

`--help` lists every key with its type and default (of the chosen preset). The resolved
config is written to `out_dir/config.json`; see `train.loop` for the other outputs.

Example:
  $ python -m train --optimizer=adamw --out_dir=out/adamw
  $ python -m train --preset=moe_tiny --max_iters=500 --optimizer snoo_muon
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from train.config import TrainConfig, config_help, parse_args
from train.loop import run


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, train, print the final metrics; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        try:
            shown = parse_args([a for a in argv if a not in ("-h", "--help")])
        except ValueError:
            shown = TrainConfig()
        print(config_help(shown))
        return 0
    try:
        config = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = run(config)
    final = result.final
    fmt = lambda value, spec: "n/a" if not isinstance(value, float) else format(value, spec)
    print(f"done: step {final['step']}, val loss {fmt(final['val_loss'], '.4f')} (best "
          f"{fmt(final['best_val_loss'], '.4f')}), {fmt(final['tokens_per_sec'], ',.0f')} "
          f"tokens/s, MFU {fmt(final['mfu'], '.1%')}, {final['wall_s']:.0f} s; outputs in "
          f"{result.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
