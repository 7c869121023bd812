"""tools/agent_smoke.py's plumbing with stand-ins for the agent CLIs (the real ones come from
npm, outside CI): a stand-in that sends a well-formed Messages request the way README
configures Claude Code passes; one whose request is refused (400) fails."""

from __future__ import annotations

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
    assert line.startswith("claude") and " ok " in line and "1 jobs (4 tokens)" in line
    failed = smoke(bad)
    assert failed.returncode == 1 and "FAIL" in failed.stdout
    assert "non-2xx: ['POST /v1/messages 400']" in failed.stdout
