"""The whole dummy V4-Flash through the Engine: decode, prefill and TTFT against the byte floor.

Loads `--load-format dummy` weights of the shipped deepseek-v4-flash config (or `--config PATH`,
e.g. a shrunken copy for a CPU smoke run) under a device budget (`--gpu-memory-gib`; default:
what is free less the sessions and scratch), prints the expert split, then measures one stream:

- decode tok/s after a prompt of each `--contexts` length (greedy, `--decode-tokens` steps);
- prefill tok/s at `--prefill-chunk`, and the TTFT of a `--ttft-tokens` prompt (sync to the
  first sampled token);
- the bytes-read floor of the placement used: per token, every dense matrix once (the
  embedding only its row), plus k experts per layer, the resident share at `--hbm-gbs` and the
  share expected in host memory (uniform routing) at `--pcie-gbs`, and the same floor with the
  host share the decode steps actually counted;
- on the GPU, the split of one decode step (its CUDA graph replayed alone, after the first
  context): the placed graph, the same graph with every host expert's table entry pointed at a
  resident expert (resident time), their difference (host-read time), and a graph of empty
  kernels with the same node count (launch overhead); what the Python step adds on top.

    python3 tools/bench_flash_full.py --backend cupy --json flash_full.json
    python3 tools/bench_flash_full.py --backend numpy --config small/config.json \\
        --contexts 64,128 --ttft-tokens 256 --prefill-chunk 64 --decode-tokens 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds4.engine import Engine  # noqa: E402  (after the sys.path line above)
from ds4.model.dummy import expert_bytes  # noqa: E402


def open_engine(args) -> Engine:
    """The dummy model under the budget, sized for the longest context measured."""
    model = "deepseek-v4-flash"
    if args.config:  # a config.json or the directory holding it
        model = args.config if Path(args.config).is_dir() else Path(args.config).parent
    longest = max(max(args.contexts), args.ttft_tokens) + args.decode_tokens + 1
    return Engine.open(model, backend=args.backend, prefill_chunk=args.prefill_chunk,
                       load_format="dummy", seed=args.seed, gpu_memory_gib=args.gpu_memory_gib,
                       parallel=1, ctx=longest)


def prompt(engine: Engine, n: int, seed: int) -> list[int]:
    """n random token ids (BOS first)."""
    rng = np.random.default_rng(seed)
    return [0] + rng.integers(2, engine.config.vocab_size, n - 1).tolist()


def sync_time(cp, fn) -> float:
    """Seconds fn() takes, the device drained before and after."""
    if cp is not None:
        cp.cuda.Device().synchronize()
    start = time.perf_counter()
    fn()
    if cp is not None:
        cp.cuda.Device().synchronize()
    return time.perf_counter() - start


def decode_at(engine: Engine, ctx: int, steps: int, ctx_size: int, keep: list | None = None
              ) -> dict:
    """Greedy decode tok/s of one stream after a ctx-token prompt (the first two steps not
    timed: a graph size's first step runs eagerly and compiles, its second captures the graph,
    ~0.1 s at full size, what 8 timed steps would have averaged in as 6 ms a token); the
    session is appended to `keep` when given."""
    session = engine.new_session(ctx_size)
    logits = session.sync(prompt(engine, ctx, ctx))
    for _ in range(2):
        logits = session.decode(int(np.argmax(logits)))
    seconds = 0.0
    for _ in range(steps):
        token = int(np.argmax(logits))  # the logits came back to the host: step done
        start = time.perf_counter()
        logits = session.decode(token)
        seconds += time.perf_counter() - start
    if keep is not None:
        keep.append(session)
    return {"context": ctx, "tokens": steps, "tok_s": steps / seconds,
            "ms_per_token": 1e3 * seconds / steps, "finite": bool(np.isfinite(logits).all())}


def ttft(engine: Engine, cp, n: int, ctx_size: int) -> dict:
    """Seconds from a fresh n-token prompt to its first sampled token; prefill tok/s."""
    session = engine.new_session(ctx_size)
    ids = prompt(engine, n, 7)
    seconds = sync_time(cp, lambda: int(np.argmax(session.sync(ids))))
    return {"tokens": n, "ttft_s": seconds, "prefill_tok_s": n / seconds,
            "chunk": engine.prefill_chunk}


def byte_floor(engine: Engine, hbm_gbs: float, pcie_gbs: float,
               host_share: float | None = None) -> dict:
    """Bytes a decode step must read, split by memory, and the time that takes at least: host
    reads as uniform routing expects them, or at `host_share` of the picks (counted)."""
    cfg, weights = engine.config, engine.model.weights
    per_expert = expert_bytes(cfg)
    resident_experts = sum(bank.nbytes for bank in weights.experts)
    embed = weights["model.embed_tokens.weight"]
    row = int(embed.nbytes) // cfg.vocab_size  # a step reads one embedding row
    dense = weights.nbytes + weights.host_tensor_nbytes - resident_experts - int(embed.nbytes) + row
    if weights["lm_head.weight"] is embed:
        dense += int(embed.nbytes)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    host = [0] * cfg.num_hidden_layers
    if weights.placement is not None:
        host = weights.placement.split().host_experts
    host_reads = sum(k * h / E for h in host) * per_expert
    if host_share is not None:
        host_reads = k * cfg.num_hidden_layers * host_share * per_expert
    device_reads = dense + k * cfg.num_hidden_layers * per_expert - host_reads
    device_s, host_s = device_reads / (hbm_gbs * 1e9), host_reads / (pcie_gbs * 1e9)
    return {"device_bytes_per_token": device_reads, "host_bytes_per_token": host_reads,
            "floor_ms_per_token": 1e3 * (device_s + host_s), "floor_tok_s": 1 / (device_s + host_s),
            "device_floor_ms": 1e3 * device_s, "host_floor_ms": 1e3 * host_s}


EMPTY_NODE = 'extern "C" __global__ void empty_node() {}'


def replay_ms(cp, graph, stream, n: int = 20) -> float:
    """Milliseconds one replay of a captured graph takes (device time, n replays averaged)."""
    graph.launch(stream)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(n):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / n


def graph_nodes(graph) -> int | None:
    """Nodes (kernels, copies, memsets) of a captured graph, through the driver API."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    n = ctypes.c_size_t(0)
    if driver.cuGraphGetNodes(ctypes.c_void_p(graph.graph), None, ctypes.byref(n)) != 0:
        return None
    return int(n.value)


def empty_graph_ms(cp, nodes: int) -> float:
    """Replay time of a chain of `nodes` empty one-block kernels: the launch overhead a graph
    of that many nodes pays before any work."""
    kernel = cp.RawKernel(EMPTY_NODE, "empty_node")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        kernel((1,), (32,), ())  # loads the module outside the capture
        stream.begin_capture()
        for _ in range(nodes):
            kernel((1,), (32,), ())
        graph = stream.end_capture()
    return replay_ms(cp, graph, stream)


def step_split(engine: Engine, cp, session, step_ms: float) -> dict:
    """One decode step's device time split: placed graph, host reads off (resident time),
    host-read time, launch overhead of its node count, and the Python step around it."""
    decoder = engine.model.kernel_decoder.decoder
    graph, stream = decoder.graphs[1], decoder.stream  # one graph per batch size: B = 1
    placement = engine.model.weights.placement
    banks = [b for b in placement.banks if b.placed_stacks] if placement is not None else []
    counted = [b.counts.copy() for b in banks]  # replays of one token must not count as picks
    placed_ms = resident_ms = replay_ms(cp, graph, stream)
    if placement is not None:
        with placement.host_reads_off():
            resident_ms = replay_ms(cp, graph, stream)
    for bank, counts in zip(banks, counted):
        bank.counts[...] = counts
    nodes = graph_nodes(graph)
    launch_ms = empty_graph_ms(cp, nodes) if nodes else float("nan")
    return {"graph_ms": placed_ms, "resident_ms": resident_ms,
            "host_read_ms": placed_ms - resident_ms, "nodes": nodes, "launch_ms": launch_ms,
            "python_ms": step_ms - placed_ms}


def run(args) -> dict:
    """Every figure of one run."""
    start = time.perf_counter()
    engine = open_engine(args)
    cp = engine.backend.xp if engine.backend.is_gpu else None
    res = {"load_s": time.perf_counter() - start, "memory": engine.memory_report()}
    split = res["memory"].get("expert_placement", "routed experts: all resident")
    print(f"loaded in {res['load_s']:.1f} s; {split}", flush=True)
    ctx_size = max(max(args.contexts), args.ttft_tokens) + args.decode_tokens + 2
    kept: list = []  # the first context's session: its graph is split, then it goes
    res["decode"] = [decode_at(engine, args.contexts[0], args.decode_tokens, ctx_size, kept)]
    if cp is not None and engine.model.kernel_decoder is not None:
        res["split"] = step_split(engine, cp, kept[0], res["decode"][0]["ms_per_token"])
    kept.clear()
    res["decode"] += [decode_at(engine, c, args.decode_tokens, ctx_size) for c in args.contexts[1:]]
    placement = engine.model.weights.placement
    if placement is not None:
        res["counted"] = placement.stats()
        res["floor_counted"] = byte_floor(engine, args.hbm_gbs, args.pcie_gbs,
                                          res["counted"]["host_read_share"])
    if args.replace:
        res["replaced_experts"] = engine.replace_experts()
        res["decode_after_replace"] = [decode_at(engine, c, args.decode_tokens, ctx_size)
                                       for c in args.contexts]
    res["ttft"] = ttft(engine, cp, args.ttft_tokens, ctx_size)
    res["floor"] = byte_floor(engine, args.hbm_gbs, args.pcie_gbs)
    if cp is not None:
        res["device_memory"] = device_memory(cp, engine, res["memory"])
    return res


def device_memory(cp, engine: Engine, memory: dict) -> dict:
    """GiB on the device after the run: CuPy's pool (it keeps every block it grew to, so its
    total is the high-water mark of weights + sessions + scratch + temporaries), what the
    weights hold of it, and what the device still has free: how far the scratch reserve of
    the weight budget (ds4.model.budget.scratch_estimate) overshoots."""
    pool, gib = cp.get_default_memory_pool(), float(1 << 30)
    weights = memory["weight_bytes"]  # (the device's share: host experts and embedding not)
    return {"pool_gib": pool.total_bytes() / gib, "weights_gib": weights / gib,
            "beside_weights_gib": (pool.total_bytes() - weights) / gib,
            "scratch_gib": engine.model.scratch.nbytes / gib,
            "free_gib": cp.cuda.runtime.memGetInfo()[0] / gib}


def report(res: dict) -> None:
    """The figures as lines."""
    floor = res["floor"]
    print(f"bytes-read floor: {floor['floor_ms_per_token']:.2f} ms/token "
          f"({floor['floor_tok_s']:.0f} tok/s; {floor['device_bytes_per_token'] / 1e9:.2f} GB "
          f"device + {floor['host_bytes_per_token'] / 1e9:.3f} GB host per token)")
    if "floor_counted" in res:
        counted = res["floor_counted"]
        print(f"floor at the counted host share {res['counted']['host_read_share']:.3f}: "
              f"{counted['floor_ms_per_token']:.2f} ms/token ({counted['floor_tok_s']:.0f} tok/s)")
    if "split" in res:
        sp = res["split"]
        print(f"decode step split (graph replayed alone): {sp['graph_ms']:.2f} ms on the device "
              f"= {sp['resident_ms']:.2f} ms resident + {sp['host_read_ms']:.2f} ms host reads; "
              f"launch overhead of its {sp['nodes']} nodes {sp['launch_ms']:.2f} ms (inside the "
              f"resident time); Python around the step {sp['python_ms']:.2f} ms")
        floor = res.get("floor_counted", res["floor"])
        print(f"  against the floor of this placement: {floor['device_floor_ms']:.2f} ms "
              f"resident + {floor['host_floor_ms']:.2f} ms host reads "
              f"({'counted' if 'floor_counted' in res else 'uniform'} host share)")
    for d in res["decode"] + res.get("decode_after_replace", []):
        print(f"decode at context {d['context']}: {d['tok_s']:.1f} tok/s "
              f"({d['ms_per_token']:.2f} ms/token, finite logits: {d['finite']})")
    if "device_memory" in res:
        m = res["device_memory"]
        print(f"device memory after the run: CuPy's pool grew to {m['pool_gib']:.2f} GiB "
              f"({m['weights_gib']:.2f} GiB weights, {m['beside_weights_gib']:.2f} GiB sessions, "
              f"scratch and temporaries; the named scratch {m['scratch_gib']:.2f}); "
              f"{m['free_gib']:.2f} GiB free")
    t = res["ttft"]
    print(f"prefill at chunk {t['chunk']}: {t['prefill_tok_s']:.0f} tok/s; "
          f"TTFT of {t['tokens']} tokens: {t['ttft_s']:.2f} s")


def parser() -> argparse.ArgumentParser:
    """The tool's flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    def ints(text):
        return [int(v) for v in text.split(",")]

    ap.add_argument("--config", help="a config.json (or its directory); default: the shipped "
                    "deepseek-v4-flash")
    ap.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    ap.add_argument("--gpu-memory-gib", type=float, default=None)
    ap.add_argument("--contexts", type=ints, default=[4096, 32768])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--ttft-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replace", action="store_true",
                    help="re-place experts by the counted picks, then decode again")
    ap.add_argument("--hbm-gbs", type=float, default=4200.0, help="device copy rate, GB/s")
    ap.add_argument("--pcie-gbs", type=float, default=51.0,
                    help="rate a kernel reads mapped host memory, GB/s")
    ap.add_argument("--json", help="also write the figures here")
    return ap


def main(argv=None) -> int:
    """Run, print, optionally write JSON."""
    args = parser().parse_args(argv)
    res = run(args)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
