"""What the three commands share on their command lines: --help with defaults, --version."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ds4 import __version__


class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help lists each flag's default, except where there is none to show (None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)


def add_version(p: argparse.ArgumentParser) -> None:
    """`--version`: the program's name and the ds4 version, then exit 0."""
    p.add_argument("--version", action="version", version=f"%(prog)s (ds4) {__version__}")


def argument_type(convert: Callable[[str], float], noun: str, accept: Callable[[float], bool],
                  wanted: str) -> Callable[[str], float]:
    """An argparse type: `convert` the text (else "'x' is not <noun>"), then refuse values
    `accept` rejects ("x <wanted>"): both exit 2 with argparse's usage line."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"{text} {wanted}")
        return value

    return parse


port_number = argument_type(int, "an integer", lambda v: 0 <= v <= 65535,
                            "is not a port number (0-65535)")  # 0: any free port
positive_float = argument_type(float, "a number", lambda v: v > 0, "must be > 0")
draft_count = argument_type(int, "an integer", lambda v: 1 <= v <= 16, "must be 1..16")
margin = argument_type(float, "a number", lambda v: v >= 0, "must be >= 0")


def add_mtp(p: argparse.ArgumentParser) -> None:
    """`--mtp`, `--mtp-draft N`, `--mtp-margin X`: speculative decoding of greedy requests."""
    p.add_argument("--mtp", action="store_true",
                   help="speculative decoding with the checkpoint's MTP block: greedy "
                        "(temperature 0) generations draft tokens and verify them in one "
                        "forward pass (on the GPU one decode-graph replay); output is "
                        "identical to plain greedy decoding; sampled ones "
                        "decode normally. Greedy MTP jobs decode alone (never in a batched "
                        "decode step)")
    p.add_argument("--mtp-draft", type=draft_count, default=1, metavar="N",
                   help="MTP drafts per verify round (1..16)")
    p.add_argument("--mtp-margin", type=margin, default=0.0, metavar="X",
                   help="propose a draft only when the MTP's top-1 logit beats its runner-up "
                        "by at least X logits (raw logits, before any temperature); drafting "
                        "stops at the first draft below it; 0: always propose")


gpu_count = argument_type(int, "an integer", lambda v: v >= 1, "must be >= 1")


def add_gpus(p: argparse.ArgumentParser) -> None:
    """`--gpus N`: the routed experts split over N GPUs of this host (expert parallel)."""
    p.add_argument("--gpus", type=gpu_count, default=None, metavar="N",
                   help="split the routed experts over N GPUs of this host (expert e on GPU "
                        "e mod N; attention, the shared expert, the router and the head stay "
                        "on GPU 0; NCCL sums the experts' outputs); default: one GPU")
    p.add_argument("--expert-owners", metavar="FILE",
                   help="with --gpus: a JSON file placing the routed experts, one GPU index "
                        "per expert, or one such list per layer (default: expert e on GPU "
                        "e mod N)")


def expert_owners(path: str | None, gpus: int | None):
    """The --expert-owners table read from its JSON file (None without one); (None, why) when
    it cannot be used: ((table or None), refusal or None)."""
    if path is None:
        return None, None
    if gpus is None:
        return None, "--expert-owners places experts over the GPUs of --gpus N"
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), None
    except (OSError, ValueError) as e:
        return None, f"--expert-owners {path}: {e}"


def gpus_refusal(gpus: int | None, backend: str, gpu_memory_gib: float | None = None,
                 ssd_streaming: bool = False) -> str | None:
    """Why --gpus cannot go with the other flags (None when it can)."""
    if gpus is None:
        return None
    if gpu_memory_gib is not None:
        return ("--gpus holds every expert in device memory on its GPU; --gpu-memory-gib "
                "(host overflow) is for one GPU")
    if ssd_streaming:
        return "--gpus and --ssd-streaming exclude each other"
    from ds4.engine import cuda_available

    if backend == "numpy" or (backend == "auto" and not cuda_available()):
        return "--gpus needs CUDA devices (CuPy); this run uses the NumPy backend"
    return None
