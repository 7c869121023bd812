"""`ds4`: make the tiny model, generate text from a prompt, export the job statechart."""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from pathlib import Path
from typing import TextIO

from ds4.cli.flags import (
    ShowDefaults,
    add_gpus,
    add_mtp,
    add_version,
    expert_owners,
    gpus_refusal,
    positive_float,
)
from ds4.jobs.events import SamplingOptions
from ds4.tokenizer import EOS_ID

BOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def plain_chat(text: str) -> str:
    """One user turn answered without thinking (the prompt `ds4 generate` sends)."""
    return f"{BOS}{USER}{text}{ASSISTANT}</think>"


def parser() -> argparse.ArgumentParser:
    """The command line of `ds4`."""
    p = argparse.ArgumentParser(prog="ds4", description=__doc__, formatter_class=ShowDefaults)
    add_version(p)
    sub = p.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write the built-in tiny random model into DIR",
                          formatter_class=ShowDefaults)
    tiny.add_argument("dir", type=Path, help="directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    generate_flags(sub.add_parser("generate", formatter_class=ShowDefaults,
                                  help="stream a reply to one prompt, then print tokens/s"))
    chart = sub.add_parser("statechart", help="export the job state machine diagram",
                           formatter_class=ShowDefaults)
    chart.add_argument("--format", choices=["mermaid", "dot", "svg"], default="mermaid",
                       help="svg needs graphviz's `dot` program")
    chart.add_argument("-o", "--output", type=Path, required=True, help="file to write")
    return p


def generate_flags(gen: argparse.ArgumentParser) -> None:
    """The flags of `ds4 generate`."""
    gen.add_argument("-p", "--prompt", required=True, help="user message")
    gen.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--model", help="model directory, or with --load-format dummy the name "
                     "of a shipped config (deepseek-v4-flash); none: the built-in tiny model")
    gen.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                     help="dummy: random weights in the checkpoint's formats from config.json "
                          "alone (drawn by --seed, 0 when unset)")
    gen.add_argument("--gpu-memory-gib", type=positive_float, default=None, metavar="N",
                     help="device memory for the weights; routed experts beyond it live in "
                          "mapped host memory")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--min-p", type=float, default=0.05,
                     help="drop tokens below this fraction of the likeliest one's probability")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (none: random)")
    gen.add_argument("--backend", choices=["auto", "numpy", "cupy"], default="auto",
                     help="auto: CuPy when a CUDA device is present, else NumPy")
    gen.add_argument("--ctx", type=int, default=4096, help="context size in tokens")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt text as is, no chat template")
    add_mtp(gen)
    add_gpus(gen)


def make_tiny_command(args: argparse.Namespace, out: TextIO) -> int:
    """`ds4 make-tiny DIR`."""
    from ds4.engine import make_tiny

    print(make_tiny(args.dir, seed=args.seed), file=out)
    return 0


def statechart_command(args: argparse.Namespace, out: TextIO) -> int:
    """`ds4 statechart --format F -o FILE`."""
    from ds4.jobs.statechart import export

    print(export(args.format, args.output), file=out)
    return 0


def generate_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """`ds4 generate`: prefill the prompt, stream sampled tokens, report speeds on stderr."""
    from ds4.engine import ContextOverflow, Engine, default_model_dir
    from ds4.sampling import make_rng, sample
    from ds4.server.runtime import check_vocabulary

    model = args.model or default_model_dir()
    engine = Engine.open(model, backend=args.backend, load_format=args.load_format,
                         seed=args.seed or 0, gpu_memory_gib=args.gpu_memory_gib, ctx=args.ctx,
                         mtp=args.mtp, gpus=args.gpus, expert_owners=args.owners)
    check_vocabulary(engine)  # as the server does: no id may fall outside the embedding
    options = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, seed=args.seed)
    prompt = engine.tokenizer.encode(args.prompt if args.raw else plain_chat(args.prompt))
    session = engine.new_session(ctx_size=args.ctx)
    start = time.perf_counter()
    logits = session.sync(prompt)  # ContextOverflow (a ValueError) is reported by main
    prefill_s = time.perf_counter() - start
    rng, text = make_rng(args.seed), codecs.getincrementaldecoder("utf-8")(errors="replace")
    speculator = mtp_speculator(args, options)
    generated, start = 0, time.perf_counter()
    while generated < args.max_tokens:
        token = sample(logits, options, rng)
        if token == EOS_ID:
            generated += 1
            break
        try:
            took = evaluate(session, token, speculator, args.max_tokens - generated)
        except ContextOverflow:  # the sampled token is still output; nothing follows it
            generated += 1
            out.write(text.decode(engine.tokenizer.token_bytes(token)))
            print(f"\n[context of {args.ctx} tokens is full]", file=err)
            break
        generated += len(took)
        for tok in took:
            out.write(text.decode(engine.tokenizer.token_bytes(tok)))
        out.flush()
        logits = session.logits
    decode_s = time.perf_counter() - start
    out.write(text.decode(b"", final=True) + "\n")
    out.flush()  # the text's last line before the speed lines on stderr
    report_speed(err, len(prompt), prefill_s, generated, decode_s)
    if speculator is not None:
        print(speculator.stats.summary(), file=err)
    elif args.mtp:
        print("mtp: off (only greedy generation, --temperature 0, drafts)", file=err)
    return 0


def mtp_speculator(args: argparse.Namespace, options: SamplingOptions):
    """The MTP policy of a --mtp run whose sampling is greedy (None: decode plainly)."""
    if not args.mtp:
        return None
    from ds4.jobs.speculative import SpeculationConfig, Speculator

    speculator = Speculator(SpeculationConfig(args.mtp_draft, args.mtp_margin))
    return speculator if speculator.applies(options) else None


def evaluate(session, token: int, speculator, room: int) -> list[int]:
    """Decode `token` (with --mtp: and the verified drafts after it); the tokens taken."""
    if speculator is None:
        session.decode(token)
        return [token]
    return speculator.round(session, token, room)


def report_speed(err: TextIO, prompt_tokens: int, prefill_s: float, generated: int,
                 decode_s: float) -> None:
    """The two tokens/s lines printed after generation."""
    print(f"prefill: {prompt_tokens} tokens in {prefill_s:.3f} s, "
          f"{prompt_tokens / max(prefill_s, 1e-9):.1f} tokens/s", file=err)
    print(f"decode: {generated} tokens in {decode_s:.3f} s, "
          f"{generated / max(decode_s, 1e-9):.1f} tokens/s", file=err)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ds4` command."""
    p = parser()
    args = p.parse_args(argv)
    if args.command == "generate":
        owners, why = expert_owners(args.expert_owners, args.gpus)
        why = why or gpus_refusal(args.gpus, args.backend, args.gpu_memory_gib)
        if why:
            p.error(why)
        args.owners = owners
    try:
        if args.command == "make-tiny":
            return make_tiny_command(args, sys.stdout)
        if args.command == "statechart":
            return statechart_command(args, sys.stdout)
        return generate_command(args, sys.stdout, sys.stderr)
    except (OSError, ValueError, RuntimeError) as e:  # bad model dir, config, missing `dot`, ...
        print(f"ds4: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
