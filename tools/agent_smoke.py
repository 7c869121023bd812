"""The coding agents themselves against ds4-server: Claude Code (`claude -p`), Codex (`codex
exec`) and opencode (`opencode run`), each given one prompt non-interactively, configured the
way README tells users to. The server runs the built-in tiny model unless --model says
otherwise; the tiny model's random weights never end a turn, so every answer stops at the output
cap (--tokens), which each agent reports in its own words (a finished stream all the same).

A run passes an agent when every request it sent got a 2xx (the server's access log), at
least one of them generated tokens and finished without an error (the server's --trace), and
the CLI exited before the timeout. The CLIs come from npm (not a dependency of ds4):

    npm install --prefix /tmp/agents @anthropic-ai/claude-code @openai/codex opencode-ai
    python3 tools/agent_smoke.py --bin /tmp/agents/node_modules/.bin
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench_parallel import wait_healthy

MODEL = "deepseek-v4-flash"
CTX = 65536  # the server's --ctx, and the window each agent is told (README)
COMPACT = 52000  # Codex compacts its conversation past this many tokens (~80% of CTX)
ACCESS = re.compile(r"ds4-server: \S+ (\w+) (\S+) (\d{3}) ")


@dataclass
class Agent:
    """One CLI: its command and the environment README gives it ({url}, {tokens}, {home} and
    {prompt} filled in), and the config files it reads (path under the run's home -> the
    text, made from those same values)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, Callable[[dict], str]] = field(default_factory=dict)


def codex_toml(fill: dict) -> str:
    """Codex's config.toml as README gives it."""
    return (f'model = "{MODEL}"\nmodel_provider = "ds4"\nmodel_context_window = {CTX}\n'
            f'model_auto_compact_token_limit = {COMPACT}\n\n[model_providers.ds4]\n'
            f'name = "ds4"\nbase_url = "{fill["url"]}/v1"\nwire_api = "responses"\n')


def opencode_json(fill: dict) -> str:
    """opencode's opencode.json as README gives it, with the answer capped (its `limit`)."""
    card = {"name": "DeepSeek V4 Flash",
            "limit": {"context": CTX, "output": int(fill["tokens"])}}
    return json.dumps({"$schema": "https://opencode.ai/config.json",
                       "provider": {"ds4": {"npm": "@ai-sdk/openai-compatible", "name": "ds4",
                                            "options": {"baseURL": fill["url"] + "/v1"},
                                            "models": {MODEL: card}}},
                       "model": f"ds4/{MODEL}"})


AGENTS = [
    Agent("claude", ["claude", "-p", "{prompt}", "--output-format", "json"],
          {"ANTHROPIC_BASE_URL": "{url}", "ANTHROPIC_AUTH_TOKEN": "unused",
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(CTX),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "{tokens}", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}),
    Agent("codex", ["codex", "exec", "--skip-git-repo-check", "{prompt}"],
          {"CODEX_HOME": "{home}/.codex"}, {".codex/config.toml": codex_toml}),
    Agent("opencode", ["opencode", "run", "{prompt}"], {},
          {"work/opencode.json": opencode_json}),
]


def main() -> int:
    """Start the server, run each agent found, print one line per agent; 1 if any failed."""
    args = parse_args()
    found = [a for a in AGENTS if a.name in args.agents
             and shutil.which(a.name, path=args.bin or None)]  # (not installed: not run)
    if not found:
        print("no agent CLI found (see --bin)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        server, url, log = start_server(args, home)
        try:
            results = [run_agent(a, args, url, home, log) for a in found]
        finally:
            server.terminate()
            server.wait(timeout=30)
    for line in results:
        print(line)
    return 0 if all(" ok " in line for line in results) else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="", help="folder of the agent CLIs (else PATH)")
    p.add_argument("--agents", default="claude,codex,opencode", type=lambda s: s.split(","))
    p.add_argument("--model", default=None, help="ds4-server --model (default: the tiny one)")
    p.add_argument("--tokens", type=int, default=40, help="output cap of every answer")
    p.add_argument("--prompt", default="say hi")
    p.add_argument("--timeout", type=float, default=600, help="seconds an agent may take")
    return p.parse_args()


def start_server(args, home: Path) -> tuple[subprocess.Popen, str, Path]:
    """ds4-server (this Python's, whatever PATH holds) on a free port with a trace and its
    access log in files; waits for /health."""
    port = free_port()
    log = home / "server.log"
    cmd = [sys.executable, "-m", "ds4.cli.server", "--port", str(port), "--ctx", str(CTX),
           "--parallel", "2", "--tokens", str(args.tokens), "--trace", str(home / "trace.jsonl")]
    if args.model:
        cmd += ["--model", args.model]
    server = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    with log.open("rb") as seen:
        wait_healthy(url, server, seen, 300)
    return server, url, log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agent(agent: Agent, args, url: str, home: Path, log: Path) -> str:
    """Run one agent in its own home and working folder; its verdict line."""
    fill = {"url": url, "tokens": str(args.tokens), "home": str(home), "prompt": args.prompt}
    for rel, text in agent.files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text(fill))
    (home / "work").mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "PWD": str(home / "work"),  # (opencode reads PWD)
           **{k: v.format(**fill) for k, v in agent.env.items()}}
    if args.bin:
        env["PATH"] = f"{args.bin}:{env['PATH']}"
    before_log, before_trace = len(log.read_text().splitlines()), trace_jobs(home)
    argv = [a.format(**fill) for a in agent.argv]
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=home / "work", env=env, capture_output=True, text=True,
                              timeout=args.timeout, stdin=subprocess.DEVNULL)
        code, said = str(done.returncode), done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, said = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
    requests = [m.groups() for m in map(ACCESS.match, log.read_text().splitlines()[before_log:])
                if m]
    jobs = trace_jobs(home)[len(before_trace):]
    line = verdict(agent.name, code, time.monotonic() - t0, requests, jobs)
    return line if " ok " in line else f"{line}\n    its last output: {said[-600:]!r}"


def trace_jobs(home: Path) -> list[dict]:
    """The trace's job records so far (its first line is the run's header)."""
    path = home / "trace.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if "seq" in x]


def verdict(name: str, code: str, took: float, requests: list, jobs: list) -> str:
    """'<agent> ok|FAIL ...': every request 2xx, a job that generated and ended cleanly, no
    timeout."""
    bad = [f"{m} {p} {s}" for m, p, s in requests if not s.startswith("2")]
    generated = [j for j in jobs if j["generated_tokens"] and not j["error"]]
    errors = [j["error"] for j in jobs if j["error"]]
    ok = not bad and generated and not errors and code != "timeout"
    routes = sorted({p for _, p, _ in requests})
    return (f"{name:9s}{' ok ' if ok else ' FAIL '} exit {code}, {took:.1f} s, "
            f"{len(requests)} requests {routes}, {len(jobs)} jobs "
            f"({sum(len(j['generated_tokens']) for j in jobs)} tokens generated, "
            f"{sum(j['cached_tokens'] for j in jobs)} prompt tokens reused)"
            + (f"; non-2xx: {bad}" if bad else "") + (f"; errors: {errors}" if errors else ""))


if __name__ == "__main__":
    sys.exit(main())
