"""Benchmark the GPU engine at real V4-Flash layer dimensions on random weights.

Prints, in one run: the device copy bandwidth and GEMM rate (the two ceilings), the per
layer-token decode time of the kernel/CUDA-graph path against its bytes-read floor (with a
per-stage profile), prefill tokens/s and TFLOP/s at each chunk size through the engine's model
code on CuPy, and the same measures for transformers' DeepseekV4ForCausalLM (eager, bf16) on the
same weights when torch and transformers are importable.

    PYTHONPATH=. python3 tools/bench_engine.py --layers sliding,csa,hca,csa --ctx 4096

--format official adds the same layers held as an official checkpoint is (FP8 + FP4 packed,
tools/bench_official.py) in the same run, beside the bf16 tables.

--batch 1,2,4,8 times batched decode steps through the engine instead (tools/bench_batch.py:
--model, --backend; runs on the CPU too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from bench_flash import (
    FlashStack,
    bytes_read_per_token,
    flash_config,
    matrix_flops,
    prefill_floor,
)
from timing import ceilings, graph_time, timed

KINDS = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
         "hca": "heavily_compressed_attention"}


def decode_bench(cp, stack: FlashStack, ctx: int, batches=(1, 2, 4, 8), gemv: bool = True) -> dict:
    """Per-layer decode times (batch-of-one graph replays), a stage profile, eager vs graph full
    steps, and whole graph steps of each batch size against that batch's bytes bound."""
    dec, state = stack.decoder(), stack.filled_state(ctx)
    B = dec.prepare([state], [7])
    dec.run(B)  # compiles and loads every kernel outside capture
    cp.cuda.Device().synchronize()
    stream = dec.stream
    out = {"layers": [], "ctx": ctx}
    for i, ls in enumerate(state.layers):
        t = dec.layers[i]
        row = {"kind": ls.kind,
               "s": graph_time(cp, stream, lambda i=i: dec.run_layer(i, B)),
               "bytes": bytes_read_per_token(stack.cfg, t, ls, state.n)}
        row["stages"] = stage_times(cp, stream, dec, i, t, ls)
        out["layers"].append(row)
    out["graph_step_s"] = graph_time(cp, stream, lambda: dec.run(B))
    with stream:
        out["eager_step_s"] = timed(cp, lambda: dec.run(B), repeat=5, warmup=1)
    out["gemv"] = gemv_profile(cp, stream, dec) if gemv else {}
    out["batch"] = batch_steps(cp, stack, dec, [state] + [stack.filled_state(ctx) for _ in
                                                         range(max(batches) - 1)], batches)
    return out


def batch_steps(cp, stack: FlashStack, dec, states: list, batches) -> dict:
    """Graph-step seconds of each batch size (members at the same position, own states) and
    the bytes bound of that batch: the shared matrices once, each distinct routed expert once
    (as the routers picked them; uniform routing would expect E (1 - (1 - k/E)^B)), every
    member's state."""
    cfg = stack.cfg
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    rows = {}
    for b in batches:
        B = dec.prepare(states[:b], [7 + m for m in range(b)])
        picked = distinct_picks(cp, dec, B)  # also loads each size's kernels outside capture
        step = graph_time(cp, dec.stream, lambda B=B: dec.run(B))
        moved = sum(batch_bytes(cfg, t, ls, states[0].n, b, d)
                    for t, ls, d in zip(dec.layers, states[0].layers, picked))
        moved += sum(int(w.nbytes) for name, w in dec.top.items() if name != "embed")
        rows[b] = {"step_s": step, "tok_per_s": b / step,
                   "distinct_experts": float(np.mean(picked)),
                   "uniform_experts": E * (1.0 - (1.0 - k / E) ** b), "bound_bytes": moved}
    return rows


def distinct_picks(cp, dec, B: int) -> list[int]:
    """Distinct routed experts each layer's router picked for the B members (one eager step)."""
    from ds4.kernels import hyper_connection as hc

    out = []
    with dec.stream:
        hc.embed_streams(dec.top["embed"], dec.tables[B].tokens, dec.buf["X"][:B])
        for i in range(len(dec.layers)):
            dec.run_layer(i, B)
            out.append(len(np.unique(cp.asnumpy(dec.buf["idx"][:B]))))
        dec.run_head(B)
    return out


def batch_bytes(cfg, t: dict, ls, n: int, batch: int, distinct: float) -> float:
    """Bytes a batch of `batch` tokens reads in one layer: weights once, `distinct` experts,
    each member's state."""
    one = bytes_read_per_token(cfg, t, ls, n)
    expert = t["experts.gate_up"][0].nbytes + t["experts.down"][0].nbytes
    state = one - sum(w.nbytes for name, w in t.items() if not name.startswith("experts.")) \
        - cfg.num_experts_per_tok * expert
    return one + (distinct - cfg.num_experts_per_tok) * expert + (batch - 1) * state


def stage_times(cp, stream, dec, i: int, t: dict, ls) -> dict:
    """Graph-replay seconds of the parts of one layer step, batch of one (compressor/indexer/
    attention kernel are also inside "attention")."""
    from ds4.kernels import attention as at
    from ds4.kernels.sampling import topk_select
    from ds4.model.gpu_batch import COMPRESSOR, COMPRESSOR_ROWS, RAW

    b, cfg, tab = dec.buf, dec.cfg, dec.tables[1]
    freqs = dec.freqs["main" if ls.compressor is None else "compress"]
    out = {"h projections": graph_time(cp, stream, lambda: dec.projections[i].run(b["h"], 1)),
           "mhc+norm x2": 2 * graph_time(cp, stream, lambda: dec._block(
               t, "attn_hc", "input_layernorm.weight", 1, post=True)),
           "attention": graph_time(cp, stream, lambda: dec._attention(i, t, 1)),
           "moe": graph_time(cp, stream, lambda: dec._moe(i, t, 1))}
    if ls.compressor is not None:
        out["compressor"] = graph_time(cp, stream, lambda: dec._compress(
            t, "self_attn.compressor.", tab, i, COMPRESSOR, cfg.head_dim, freqs, "ckv", "cg", 1))
    if ls.indexer is not None:
        out["indexer+topk"] = graph_time(cp, stream, lambda: dec._index(t, tab, i, freqs, 1))
        out["topk"] = graph_time(cp, stream, lambda: topk_select(
            b["scores"][:1], cfg.index_topk, b["sel"][:1], b["sel_count"][:1], tab.pos,
            ls.indexer.ratio))
    comp = None if ls.compressor is None else COMPRESSOR_ROWS
    sel = b["sel"][:1] if ls.indexer is not None else None
    out["attention kernel"] = graph_time(cp, stream, lambda: at.attention_decode_m(
        b["q"][:1], tab, i, RAW, comp, cfg.sliding_window, sel, b["sel_count"][:1],
        0 if comp is None else ls.compressor.ratio, t["self_attn.sinks"], b["o"][:1],
        dec.keys[i], b["attn_part"][:1]))
    return out


def gemv_profile(cp, stream, dec) -> dict:
    """Achieved bytes/s of the GEMV kernel on each distinct matrix shape of a layer, with the
    launcher's column-split choice and with each power-of-two split."""
    from ds4.kernels.gemv import gemv, pick_rows_per_warp, pick_splits

    seen, out = set(), {}
    for t in dec.layers:
        for name, w in t.items():
            if w.ndim != 2 or w.dtype != cp.uint16 or w.shape in seen or w.shape[0] < 64:
                continue
            seen.add(w.shape)
            x = cp.random.standard_normal(w.shape[1], dtype=cp.float32)
            y = cp.empty(w.shape[0], dtype=cp.float32)
            rates = {}
            for splits in (1, 2, 4, 8, 16):
                if w.shape[1] % (256 * splits) == 0:
                    s = graph_time(cp, stream, lambda w=w, x=x, y=y,
                                   k=splits: gemv(w, x, y, splits=k))
                    rates[splits] = w.nbytes / s
            s = graph_time(cp, stream, lambda w=w, x=x,
                           y=y: gemv(w, x, y, splits=1, rows_per_warp=2))
            rates["2rows"] = w.nbytes / s
            splits = pick_splits(*w.shape)
            chosen = "2rows" if pick_rows_per_warp(*w.shape, splits) == 2 else splits
            out[f"{name} {w.shape[0]}x{w.shape[1]}"] = {"chosen": chosen, "bytes_per_s": rates}
    return out


GEMM_MODES = ("bf16x2", "bf16")  # DS4_GEMM: activations as a hi + lo bf16 pair, or rounded once


def prefill_bench(cp, stack: FlashStack, chunks: list[int]) -> dict:
    """Seconds per layer to prefill `chunk` tokens through the engine's model code on CuPy, for
    each DS4_GEMM mode, plus where the time goes at the largest chunk (default mode)."""
    out = {}
    for i, kind in enumerate(stack.kinds):
        if kind in out:
            continue
        model = stack.engine_model(i)  # layer i alone, on the stack's own arrays
        out[kind] = {}
        for mode in GEMM_MODES:
            os.environ["DS4_GEMM"] = mode
            out[kind][mode] = {chunk: timed(cp, prefill_run(stack, model, chunk), repeat=3,
                                            warmup=1)
                               for chunk in chunks}
        os.environ["DS4_GEMM"] = GEMM_MODES[0]
        out[kind]["stages"] = prefill_stages(cp, prefill_run(stack, model, chunks[-1]))
        model = None
        cp.get_default_memory_pool().free_all_blocks()
    return out


def prefill_run(stack: FlashStack, model, chunk: int):
    """A function running one chunk of random tokens from an empty context."""
    ids = np.random.default_rng(chunk).integers(2, stack.cfg.vocab_size, chunk).tolist()
    state = stack.empty_state(model.cfg, chunk)

    def run():
        """One chunk from an empty context."""
        state.reset()
        model.forward(state, ids)
    return run


def prefill_stages(cp, run) -> dict:
    """Device seconds inside attention (with compressor and indexer), the MoE and the rest of
    one prefill run, from events around the forward module's calls."""
    from ds4.model import forward

    spans = {"attention": [], "moe": []}
    originals = {name: getattr(forward, name) for name in spans}

    def timed_call(name):
        def call(*args, **kw):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            result = originals[name](*args, **kw)
            end.record()
            spans[name].append((start, end))
            return result
        return call

    run()
    for name in spans:
        setattr(forward, name, timed_call(name))
    try:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run()
        end.record()
        end.synchronize()
    finally:
        for name, fn in originals.items():
            setattr(forward, name, fn)
    out = {name: sum(cp.cuda.get_elapsed_time(a, b) for a, b in pairs) / 1e3
           for name, pairs in spans.items()}
    out["total"] = cp.cuda.get_elapsed_time(start, end) / 1e3
    return out


def hf_bench(stack: FlashStack, chunks: list[int], decode_tokens: int = 8) -> dict:
    """transformers' eager bf16 model on the same weights: prefill per chunk, then decode."""
    import torch
    from transformers import DynamicCache

    model, n_layers, out = stack.hf, len(stack.kinds), {"prefill_s": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for chunk in [64] + chunks:  # the first, small run only warms up
            ids = torch.randint(2, stack.cfg.vocab_size, (1, chunk), device="cuda", generator=gen)
            cache = DynamicCache(config=model.config)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            end.record()
            torch.cuda.synchronize()
            out["prefill_s"][chunk] = start.elapsed_time(end) / 1e3 / n_layers
        steps = []
        for _ in range(decode_tokens):
            tok = torch.randint(2, stack.cfg.vocab_size, (1, 1), device="cuda", generator=gen)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=tok, past_key_values=cache, use_cache=True)
            end.record()
            torch.cuda.synchronize()
            steps.append(start.elapsed_time(end) / 1e3)
        out["decode_s"] = float(np.median(steps[1:])) / n_layers
        out["decode_ctx"] = chunks[-1]
    out["prefill_s"].pop(64)
    return out


def report(res: dict) -> None:
    """Print the results as short tables."""
    c = res["ceilings"]
    bw = c["copy_bytes_per_s"]
    print(f"\ndevice copy {bw / 1e12:.2f} TB/s (read+write), fp16 GEMM "
          f"{c['gemm_flop_per_s'] / 1e12:.0f} TFLOP/s")
    d = res["decode"]
    print(f"\ndecode at context {d['ctx']} (CUDA graph replay, per layer-token):")
    print(f"{'layer':10} {'ms':>8} {'MB read':>9} {'floor ms':>9} {'ratio':>6}   stages (ms)")
    for row in d["layers"]:
        floor = row["bytes"] / bw  # HBM moves bw bytes/s whether they are read or written
        stages = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in row["stages"].items())
        print(f"{row['kind'][:10]:10} {row['s'] * 1e3:8.3f} {row['bytes'] / 1e6:9.1f} "
              f"{floor * 1e3:9.3f} {row['s'] / floor:6.2f}   {stages}")
    print(f"whole step (embed + {len(d['layers'])} layers + head): graph "
          f"{d['graph_step_s'] * 1e3:.3f} ms, eager launches {d['eager_step_s'] * 1e3:.3f} ms")
    read_bw = bw  # as the layer floors above: HBM moves bw bytes/s, read or written
    print(f"batched graph steps ({len(d['layers'])} layers + head; bound: weights once, "
          f"distinct experts once, each member's state, at {read_bw / 1e12:.2f} TB/s read):")
    print(f"| {'B':>2} | {'ms/step':>8} | {'tok/s':>8} | {'x B=1':>6} | {'experts (unif.)':>15} "
          f"| {'bound MB':>9} | {'bound ms':>8} | {'of bound':>8} |")
    base = d["batch"][min(d["batch"])]["tok_per_s"]
    for b, r in d["batch"].items():
        bound = r["bound_bytes"] / read_bw
        print(f"| {b:>2} | {r['step_s'] * 1e3:8.3f} | {r['tok_per_s']:8.1f} | "
              f"{r['tok_per_s'] / base:5.2f}x | {r['distinct_experts']:6.1f} "
              f"({r['uniform_experts']:5.1f}) | "
              f"{r['bound_bytes'] / 1e6:9.1f} | {bound * 1e3:8.3f} | "
              f"{100 * bound / r['step_s']:7.1f}% |")
    print("GEMV kernel alone, TB/s by column splits (* = launcher's choice):")
    for name, g in d["gemv"].items():
        cells = " ".join(f"{k}{'*' if k == g['chosen'] else ''}:{v / 1e12:.2f}"
                         for k, v in g["bytes_per_s"].items())
        print(f"  {name:60} {cells}")
    print("\nprefill through the engine's model code on CuPy (bf16 weights, per layer, "
          "own process):")
    if "error" in res["prefill"]:
        print(res["prefill"]["error"])
    for kind, per in res["prefill"].items():
        if kind == "error":
            continue
        for mode in GEMM_MODES:
            for chunk, s in per[mode].items():
                flops = matrix_flops(res["cfg"], kind, chunk)
                floor = prefill_floor(res["cfg"], kind, chunk, c)
                print(f"{kind[:10]:10} {mode:6} chunk {chunk:5}: {s * 1e3:8.2f} ms, "
                      f"{chunk / s:9.0f} tok/s, {flops / s / 1e12:6.1f} TFLOP/s, "
                      f"floor {floor * 1e3:.2f} ms ({s / floor:.1f}x)")
        st = per["stages"]
        rest = st["total"] - st["attention"] - st["moe"]
        print(f"{'':10} where the time goes ({GEMM_MODES[0]}, largest chunk): "
              f"attention {st['attention'] * 1e3:.2f} ms, "
              f"moe {st['moe'] * 1e3:.2f} ms, mHC/norms/head {rest * 1e3:.2f} ms")
    hf = res.get("hf")
    if isinstance(hf, dict):
        print(f"\ntransformers DeepseekV4ForCausalLM eager bf16, same weights (per layer, "
              f"embed/head included): decode {hf['decode_s'] * 1e3:.3f} ms at context "
              f"{hf['decode_ctx']}")
        for chunk, s in hf["prefill_s"].items():
            print(f"  prefill chunk {chunk:5}: {s * 1e3:8.2f} ms, {chunk / s:9.0f} tok/s")
    else:
        print(f"\ntransformers reference not run: {hf}")


def prefill_in_child(args) -> dict:
    """prefill_bench in a fresh process without torch (random weights of the same shapes):
    with torch loaded in the process, CuPy's launch-bound eager prefill ran 3-6x slower."""
    cmd = [sys.executable, __file__, "--prefill-only", "--layers", args.layers,
           "--chunks", args.chunks] + (["--small"] if args.small else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    per = json.loads(proc.stdout.strip().splitlines()[-1])
    return {kind: {mode: (v if mode == "stages" else {int(c): s for c, s in v.items()})
                   for mode, v in modes.items()} for kind, modes in per.items()}


def main(argv=None) -> int:
    """Run the benchmark; print the tables and optionally write JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--batch" or a.startswith("--batch=") for a in argv):
        from bench_batch import main as batch_main

        return batch_main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="sliding,csa,hca,csa")
    ap.add_argument("--ctx", type=int, default=4096, help="decode position")
    ap.add_argument("--chunks", default="512,2048")
    ap.add_argument("--small", action="store_true", help="tiny dims: a smoke test of this tool")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--prefill-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--format", choices=("bf16", "official"), default="bf16",
                    help="official: also time the layers held packed (FP8 + FP4)")
    ap.add_argument("--official-only", action="store_true",
                    help="with --format official: skip the bf16 tables")
    ap.add_argument("--quantize", action="store_true",
                    help="with --format official: the FP8/FP4 simulation on (the default of a "
                         "packed checkpoint; off to compare with bf16)")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="with --format official: dummy draws the packed layers' weights with "
                         "ds4's --load-format dummy loader (its formats and scales)")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode tables (per layer, stages, batch sizes 1-8; the "
                         "official layers' too)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import cupy as cp

    kinds = [KINDS[k] for k in args.layers.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    config = flash_config(kinds, small=args.small)
    if args.prefill_only:
        print(json.dumps(prefill_bench(cp, FlashStack(cp, config, kinds, use_hf=False), chunks)))
        return 0
    res = {"ceilings": ceilings(cp)}
    cp.get_default_memory_pool().free_all_blocks()
    if args.format == "official":
        from bench_official import official_bench, report_official

        res["official"] = official_bench(cp, kinds, [] if args.decode_only else chunks,
                                         args.ctx, args.small, res["ceilings"],
                                         quantize=args.quantize,
                                         load_format=args.load_format)
        report_official(res["official"], args.quantize)
        if args.official_only:
            return _write_json(args.json, res)
    if args.decode_only:
        args.no_hf = True
    res["prefill"] = {} if args.decode_only else prefill_in_child(args)
    stack = FlashStack(cp, config, kinds, use_hf=not args.no_hf)
    res["cfg"] = stack.cfg
    res["decode"] = decode_bench(cp, stack, args.ctx, gemv=not args.decode_only)
    cp.get_default_memory_pool().free_all_blocks()  # leave torch the room its eager run needs
    res["hf"] = hf_bench(stack, chunks) if stack.hf is not None else stack.hf_reason
    report(res)
    res["cfg"] = str(res["cfg"])
    return _write_json(args.json, res)


def _write_json(path: str | None, res: dict) -> int:
    """Write the results as JSON when asked; the exit status 0."""
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
