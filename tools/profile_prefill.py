"""Where a packed prefill chunk's time goes in one layer, by the model code's own functions.

Each layer kind is profiled as the last layer of an official-format model of `--before` + 1
layers of that kind (V4-Flash dimensions, or `--small` ones; ds4's dummy loader draws the
packed weights), prefilled with `--chunk` random tokens from an empty context: the layers
before it fill the GPU's queue as a whole model's earlier layers do (a lone layer starts from
an empty queue and shows more time waiting on Python's launches than a layer inside the
model does). Every function of SPANS is wrapped so that a call inside that layer records a
device event on entry and on exit (CuPy; on NumPy the host clock); after a warm-up run, each
function gets its calls, its inclusive time and its own time (inclusive less the spans it
called). The events measure the GPU's timeline, so a function whose kernels wait for the host
shows that wait too: the own times add up to the layer's.

    python3 tools/profile_prefill.py [--layers sliding,csa,hca] [--chunk 2048] [--before 1]

`--whole TOKENS` profiles the whole dummy model instead (the shipped deepseek-v4-flash, or
`--config`, under bench_flash_full's budget): spans over every layer, for the first `--chunk`
tokens of a prompt, the same chunk with the host experts read in place (no staging: the wall
time only), and a TOKENS-token prompt, whose later chunks attend to a longer context:

    python3 tools/profile_prefill.py --whole 16384 --chunk 2048
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPANS = (  # (module, attribute): functions, or Class.method
    "ds4.model.forward:Model._layer",
    "ds4.model.hyper_connection:hc_weights", "ds4.model.hyper_connection:hc_collapse",
    "ds4.model.hyper_connection:hc_expand", "ds4.model.hyper_connection:rms_norm",
    "ds4.model.attention:attention", "ds4.model.attention:_project",
    "ds4.model.attention:_attend", "ds4.model.attention:_grouped_output",
    "ds4.model.attention:_compressed_rows", "ds4.model.attention:_raw_keys",
    "ds4.model.attention:_store_raw", "ds4.model.rope:Rope.rotate",
    "ds4.kernels.chunk_attention:chunk_attention", "ds4.model.compressor:compress",
    "ds4.model.indexer:select_entries", "ds4.model.quant:kv_fp8_simulation",
    "ds4.model.quant:indexer_fp4_simulation", "ds4.model.linear:linear",
    "ds4.model.linear:batched_linear", "ds4.model.linear:held", "ds4.model.linear:_words",
    "ds4.model.linear:_gemm", "ds4.model.linear:grouped_rows_linear", "ds4.model.moe:moe",
    "ds4.model.moe:route", "ds4.model.moe:_routed", "ds4.model.moe:swiglu",
    "ds4.kernels.grouped:routed",
)


class Spans:
    """Wraps functions so that each call is a span of (start, end) marks with its children."""

    def __init__(self, xp):
        self.xp, self.stack, self.done, self.on = xp, [[]], [], False

    def mark(self):
        """A point on the device timeline (CuPy event) or the host clock (NumPy)."""
        if self.xp.__name__ == "numpy":
            return time.perf_counter()
        event = self.xp.cuda.Event()
        event.record()
        return event

    def seconds(self, a, b) -> float:
        """Seconds between two marks (after a device sync)."""
        if isinstance(a, float):
            return b - a
        return self.xp.cuda.get_elapsed_time(a, b) / 1e3

    def wrap(self, name: str, fn):
        """fn, recording a span named `name` per call while the profile is on."""
        def call(*args, **kw):
            if not self.on:
                return fn(*args, **kw)
            children = []
            self.stack.append(children)
            start = self.mark()
            try:
                return fn(*args, **kw)
            finally:
                end = self.mark()
                self.stack.pop()
                span = (name, start, end, children)
                self.stack[-1].append(span)
                self.done.append(span)
        call.__wrapped__ = fn
        return call

    def table(self) -> dict[str, list]:
        """name -> [calls, inclusive s, own s]."""
        out: dict[str, list] = {}
        for name, start, end, children in self.done:
            total = self.seconds(start, end)
            own = total - sum(self.seconds(c[1], c[2]) for c in children)
            row = out.setdefault(name, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += total
            row[2] += own
        return out


def install(spans: Spans) -> list[tuple]:
    """Replace every SPANS function wherever ds4 imported it (names bound by `from x import`
    too), and each method on its class; returns the (owner, name, original) to put back."""
    undo = []
    for entry in SPANS:
        module_name, attr = entry.split(":")
        module = importlib.import_module(module_name)
        if "." in attr:
            cls_name, method = attr.split(".")
            cls = getattr(module, cls_name)
            undo.append((cls, method, cls.__dict__[method]))
            setattr(cls, method, spans.wrap(attr, getattr(cls, method)))
            continue
        fn = getattr(module, attr)
        wrapped = spans.wrap(attr, fn)
        for other in list(sys.modules.values()):
            name = getattr(other, "__name__", "")
            if name.startswith("ds4") and getattr(other, attr, None) is fn:
                undo.append((other, attr, fn))
                setattr(other, attr, wrapped)
    return undo


def layer_run(xp, kind: str, chunk: int, small: bool, layers: int = 1):
    """A function prefilling `chunk` random tokens into a fresh state of a model of `layers`
    layers of this kind."""
    import numpy as np
    from bench_engine import KINDS
    from bench_official import layer_model

    from ds4.model.state import SessionState

    model = layer_model(xp, [KINDS[kind]] * layers, small, True, load_format="dummy")
    ids = np.random.default_rng(chunk).integers(2, model.cfg.vocab_size, chunk).tolist()
    state = SessionState(xp, model.cfg, chunk)

    def run():
        """One chunk from an empty context, then a sync."""
        state.reset()
        model.forward(state, ids)
        if xp.__name__ != "numpy":
            xp.cuda.Device().synchronize()
    return run


def report(kind: str, chunk: int, total: float, table: dict) -> None:
    """One line a function, the largest own time first."""
    print(f"{kind} chunk {chunk}: {total * 1e3:.2f} ms")
    print(f"  {'function':24} {'calls':>5} {'inclusive ms':>13} {'own ms':>8} {'own %':>6}")
    for name, (calls, inclusive, own) in sorted(table.items(), key=lambda kv: -kv[1][2]):
        print(f"  {name:24} {calls:5d} {inclusive * 1e3:13.3f} {own * 1e3:8.3f} "
              f"{100 * own / total:6.1f}")


def main(argv=None) -> int:
    """Profile each layer kind."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="sliding,csa,hca")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--before", type=int, default=1,
                    help="layers run in front of the profiled one (0: a lone layer)")
    ap.add_argument("--small", action="store_true", help="tiny dimensions (CPU checks)")
    ap.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    ap.add_argument("--whole", type=int, default=0, metavar="TOKENS",
                    help="profile the whole dummy model over a prompt of TOKENS")
    ap.add_argument("--config", help="--whole: a config.json (default: deepseek-v4-flash)")
    ap.add_argument("--gpu-memory-gib", type=float, default=None, help="--whole: the budget")
    args = ap.parse_args(argv)
    xp = importlib.import_module(args.backend)
    spans = Spans(xp)
    undo = install(spans)  # wrapped once for every layer kind, put back at the end
    try:
        if args.whole:
            whole(spans, args)
            return 0
        for kind in args.layers.split(","):
            spans.done.clear()
            total, table = profile(spans, xp, kind, args.chunk, args.small, args.before)
            report(kind, args.chunk, total, table)
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
    return 0


def whole(spans: Spans, args) -> None:
    """The whole model's spans over its first chunk and over a --whole-token prompt."""
    import bench_flash_full as full

    from ds4.model import moe

    argv = ["--backend", args.backend, "--contexts", str(args.whole), "--decode-tokens", "1",
            "--ttft-tokens", str(args.whole), "--prefill-chunk", str(args.chunk)]
    argv += ["--config", args.config] if args.config else []
    argv += ["--gpu-memory-gib", str(args.gpu_memory_gib)] if args.gpu_memory_gib else []
    engine = full.open_engine(full.parser().parse_args(argv))
    cp = engine.backend.xp if engine.backend.is_gpu else None
    runs = (("warm-up", args.chunk, True), ("no staging", args.chunk, False),
            ("first", args.chunk, True), ("prompt", args.whole, True))
    for seed, (label, tokens, stage) in enumerate(runs):
        session, ids = engine.new_session(args.whole + 2), full.prompt(engine, tokens, seed)
        moe.STAGE_HOST, spans.on = stage, label in ("first", "prompt")
        spans.done.clear()
        try:
            seconds = full.sync_time(cp, lambda: session.sync(ids))
        finally:
            moe.STAGE_HOST, spans.on = True, False
        if label == "no staging":
            print(f"whole model, host experts read in place: {seconds * 1e3:.0f} ms for "
                  f"{tokens} tokens ({tokens / seconds:.0f} tok/s)")
        elif label != "warm-up":
            print(f"whole model, {tokens} tokens: {tokens / seconds:.0f} tok/s")
            report(f"{label} {tokens} tokens,", args.chunk, seconds, spans.table())


def profile(spans: Spans, xp, kind: str, chunk: int, small: bool,
            before: int = 1) -> tuple[float, dict]:
    """(seconds of the profiled layer, the span table) of one layer kind, through installed
    spans: a warm-up run, then a run that records only inside layer `before`."""
    from ds4.model.forward import Model

    run = layer_run(xp, kind, chunk, small, before + 1)
    run()  # kernels compiled, memory pools grown
    spanned = Model._layer

    def gated(self, i, *args, **kw):
        """The layer, recording spans only when it is the profiled one."""
        spans.on = i == before
        try:
            return spanned(self, i, *args, **kw)
        finally:
            spans.on = False

    Model._layer = gated
    try:
        run()
    finally:
        Model._layer = spanned
    table = spans.table()
    return table["Model._layer"][1], table


if __name__ == "__main__":
    sys.exit(main())
