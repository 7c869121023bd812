"""Write tests/fixtures/tiny_ref.npz: HF fp32 logits of the built-in tiny model (top tokens only).

The tiny model has the real 129280-token vocabulary, so full logit rows would be megabytes;
the fixture keeps, for the last prefill position and each decode step, the TOP best token ids
and their logits. Run with the reference venv (torch 2.13 CPU, transformers 5.23); the model
itself is written by the project's Python (`python3 -m ds4.cli.main make-tiny`):

    /work/.refvenv/bin/python tools/make_tiny_reference.py [--python python3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_reference import selection_margins  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, DECODE_STEPS, TOP = 300, 8, 32


@torch.inference_mode()
def top_logits(model, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Cached prefill of PROMPT_LEN ids, then single-token steps; top-TOP of every row."""
    cache = DynamicCache(config=model.config)
    rows = [model(input_ids=ids[None, :PROMPT_LEN], past_key_values=cache,
                  use_cache=True).logits[0, -1]]
    for t in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        rows.append(model(input_ids=ids[None, t : t + 1], past_key_values=cache,
                          use_cache=True).logits[0, -1])
    full = model(input_ids=ids[None], use_cache=False).logits[0, PROMPT_LEN - 1 :]
    rows = torch.stack(rows).float()
    assert (rows - full[: rows.shape[0]]).abs().max() < 1e-4, "HF cached run disagrees with itself"
    top = rows.topk(TOP, dim=-1)
    return {
        "ids": ids.numpy().astype(np.int64),
        "prompt_len": np.array(PROMPT_LEN, dtype=np.int64),
        "top_ids": top.indices.numpy().astype(np.int64),
        "top_logits": top.values.numpy(),
    }


def main() -> None:
    """Make the tiny model, run it in HF fp32, save the top logits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="python3", help="a Python that imports ds4")
    parser.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/tiny_ref.npz")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([args.python, "-m", "ds4.cli.main", "make-tiny", tmp], check=True, cwd=ROOT)
        version = subprocess.run([args.python, "-c",
                                  "from ds4.model.tiny import TINY_VERSION; print(TINY_VERSION)"],
                                 check=True, cwd=ROOT, capture_output=True, text=True)
        version = version.stdout.strip()
        model = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, model.config.vocab_size, (PROMPT_LEN + DECODE_STEPS,), generator=gen)
    ids[0] = 0
    ref = top_logits(model, ids)
    ref["tiny_version"] = np.array(version)
    margins = selection_margins(model, ids[None])
    np.savez_compressed(args.out, **ref)
    gaps = ref["top_logits"][:, 0] - ref["top_logits"][:, 1]
    print(json.dumps({"selection_margins": margins, "argmax_gap_min": float(gaps.min()),
                      "argmax": ref["top_ids"][:, 0].tolist()}))


if __name__ == "__main__":
    main()
