"""`ds4-replay`: re-POST the jobs of a --trace file to a running server and compare outputs.

Jobs are sent in trace order, non-streamed. For greedy or seeded jobs the visible text the
server returns must equal the visible text recorded in the trace (reasoning and tool calls
are compared through the same parser the server uses).
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

from ds4.chat import parse_output
from ds4.jobs.trace import read_trace


def replayable(record: dict) -> bool:
    """Jobs that ended on their own (not cancelled, not failed) and whose request was kept."""
    return bool(record.get("raw_request") and record.get("endpoint")) and \
        record.get("finish_reason") in ("stop", "length", "tool_calls")


def deterministic(record: dict) -> bool:
    """Greedy jobs, and jobs whose request carried its own seed, must reproduce exactly."""
    if record["sampling"].get("temperature", 1.0) <= 0:
        return True
    return record["sampling"].get("seed") is not None


def recorded_text(record: dict) -> str:
    """What a client saw of the recorded generation: raw text for completions, else content."""
    if record["endpoint"] == "/v1/completions":
        return record["text"]
    return parse_output(record["text"], thinking=record["thinking"],
                        tools_active=record["tools_active"]).content


def returned_text(endpoint: str, body: dict) -> str:
    """The same view of a server response."""
    if endpoint == "/v1/completions":
        return body["choices"][0]["text"]
    if endpoint == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if endpoint == "/v1/messages":
        return "".join(b["text"] for b in body["content"] if b["type"] == "text")
    return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])


def replay(records: list[dict], base_url: str, api_key: str | None = None) -> list[str]:
    """POST every record's request; return one line per compared job that differs."""
    headers = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
    problems = []
    with httpx.Client(base_url=base_url, timeout=None, headers=headers) as client:
        for record in records:
            request = json.loads(record["raw_request"])
            request["stream"] = False
            response = client.post(record["endpoint"], json=request)
            if response.status_code != 200:
                problems.append(f"job {record['seq']}: HTTP {response.status_code} "
                                f"{response.text.strip()}")
            elif deterministic(record):
                got, want = returned_text(record["endpoint"], response.json()), recorded_text(record)
                if got != want:
                    problems.append(f"job {record['seq']}: text differs: {got!r} != {want!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Entry point of ds4-replay; exit 1 when a deterministic job differs."""
    p = argparse.ArgumentParser(prog="ds4-replay", description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a file written by ds4-server --trace")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--api-key")
    a = p.parse_args(argv)
    records = [r for r in read_trace(a.trace) if replayable(r)]
    problems = replay(records, a.url, a.api_key)
    for line in problems:
        print(line)
    print(f"ds4-replay: {len(records)} job(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
