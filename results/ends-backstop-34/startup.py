"""One line per records file: its hit rate, and a character per returning turn that stayed on its
backend, in the order sent: '0' where kvroute predicted nothing cached and the engine found some
(the previous turn was not learned), '.' otherwise. Run from the repository with agentic.jsonl
(kvroute-dev bench skew-trace --shape agentic) in the current folder or named by AGENTIC."""

import json
import os
import sys
from pathlib import Path

trace = [json.loads(line) for line in Path(os.environ.get("AGENTIC", "agentic.jsonl")).read_text().splitlines()]
for path in sys.argv[1:]:
    records = sorted(json.loads(Path(path).read_text()), key=lambda r: r["sent_at"])
    last: dict[str, dict] = {}
    marks = []
    for record in records:
        session = trace[record["index"]]["session_id"]
        previous = last.get(session)
        if previous and record["decision"] == "session_match" and previous["backend"] == record["backend"]:
            unlearned = record["predicted_tokens"] == 0 and record["cached_tokens"] > 0
            marks.append("0" if unlearned else ".")
        last[session] = record
    hit = sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records)
    print(f"{hit:.3f} {''.join(marks)[:80]}  {os.path.basename(path)}")
