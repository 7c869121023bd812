"""Write a synthetic official-format (FP8 + FP4, sharded) checkpoint of any model directory.

    python3 tools/make_official.py tiny /tmp/tiny-official
    python3 tools/make_official.py tests/fixtures/v4_csa_hca /tmp/x --block 64 --scale-dtype f32

`tiny` is the built-in tiny model. --dequantized DIR also writes the same values widened to
fp32 (the reference a packed engine must match). The logic is ds4.model.official_format.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds4.model.official_format import write_dequantized, write_official


def block_size(text: str) -> tuple[int, int]:
    """'128' or '128,64' -> (rows, cols) of one FP8 scale tile."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"block must be N or R,C with positive integers: {text}")
    return parts[0], parts[1]


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="model directory, or 'tiny' for the built-in tiny model")
    p.add_argument("out", help="directory to write the official-format checkpoint into")
    p.add_argument("--block", type=block_size, default=(128, 128),
                   help="FP8 scale tile, N or R,C (default 128)")
    p.add_argument("--scale-dtype", choices=("e8m0", "f32"), default="e8m0",
                   help="scale storage: e8m0 (instruct release) or f32 (-Base)")
    p.add_argument("--shard-mb", type=int, default=2048, help="approximate shard size (MiB)")
    p.add_argument("--dequantized", help="also write the widened fp32 reference here")
    a = p.parse_args(argv)
    source = a.source
    if source == "tiny":
        from ds4.engine import default_model_dir

        source = default_model_dir()
    out = write_official(source, a.out, a.block, a.scale_dtype, a.shard_mb << 20)
    print(f"wrote {out}")
    if a.dequantized:
        print(f"wrote {write_dequantized(out, Path(a.dequantized))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
