"""tools/agent_smoke.py's plumbing with stand-ins for the agent CLIs (the real ones come from
npm, outside CI): a stand-in that sends a well-formed Messages request the way README
configures Claude Code passes; one whose request is refused (400) fails; and the tool
configures each agent exactly as README tells users to."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "agent_smoke.py"
CLAUDE = """#!{python}
import os, sys, httpx
base = os.environ["ANTHROPIC_BASE_URL"]
assert httpx.head(base + "/").status_code == 200
body = {{"model": os.environ["ANTHROPIC_MODEL"], "stream": True,
        "max_tokens": int(os.environ["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]),
        "messages": [{{"role": "user", "content": sys.argv[2]}}]{extra}}}
r = httpx.post(base + "/v1/messages", json=body, timeout=120)
print(r.status_code, r.text[-200:])
"""


def stand_in(folder: Path, extra: str = "") -> None:
    path = folder / "claude"
    path.write_text(CLAUDE.format(python=sys.executable, extra=extra))
    path.chmod(0o755)


def smoke(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--bin", str(folder), "--tokens", "4",
                           "--agents", "claude", "--timeout", "120"],
                          capture_output=True, text=True, timeout=600)


def test_a_well_formed_agent_passes_and_a_refused_one_fails(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    stand_in(good)
    stand_in(bad, extra=', "top_k": "x"')  # not an integer: a 400
    passed = smoke(good)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    line = passed.stdout.splitlines()[0]
    assert line.startswith("claude") and " ok " in line and "1 jobs (4 tokens generated" in line
    failed = smoke(bad)
    assert failed.returncode == 1 and "FAIL" in failed.stdout
    assert "non-2xx: ['POST /v1/messages 400']" in failed.stdout


def readme_block(fence: str) -> str:
    text = (TOOL.parents[1] / "README.md").read_text()
    return text.split(f"```{fence}\n", 1)[1].split("```", 1)[0]


def test_the_agents_are_configured_as_readme_says():
    sys.path.insert(0, str(TOOL.parent))  # it imports bench_parallel by module name
    try:
        spec = importlib.util.spec_from_file_location("agent_smoke", TOOL)
        tool = importlib.util.module_from_spec(spec)
        sys.modules["agent_smoke"] = tool  # dataclasses look their module up
        spec.loader.exec_module(tool)
    finally:
        sys.path.remove(str(TOOL.parent))
    agents = {a.name: a for a in tool.AGENTS}
    fill = {"url": "http://127.0.0.1:8000", "tokens": "16384"}
    assert agents["codex"].files[".codex/config.toml"](fill) == readme_block("toml")
    assert (json.loads(agents["opencode"].files["work/opencode.json"](fill))
            == json.loads(readme_block("json")))
    readme = (TOOL.parents[1] / "README.md").read_text()
    command = readme.split("ANTHROPIC_BASE_URL=", 1)[1].split(" claude\n", 1)[0]
    told = dict(kv.split("=") for kv in ("ANTHROPIC_BASE_URL=" + command).split()
                if "=" in kv)
    env = {k: v.format(**fill) for k, v in agents["claude"].env.items()}
    assert told.items() <= env.items() and "CLAUDE_CODE_MAX_CONTEXT_TOKENS" in told
