"""Issue 31 tables: per-class (long > 1,000 prompt tokens, short) TTFT and ITL from a run's records,
nearest rank; "all" columns from the run's summary. python results/pd-31/table.py conc2 decider-conc6 ..."""
import json, sys
def pct(v,q):
    v=sorted(v); return round(v[min(len(v)-1,int(len(v)*q))]) if v else None
for d in sys.argv[1:]:
    res=json.load(open(f"results/pd-31/{d}/results.json")); c=res["pacing"]["concurrency"]
    for name in ("kvroute-pd","kvroute","sglang-router-cache_aware"):
        if name not in res["routers"]: continue
        recs=[r for r in json.load(open(f"results/pd-31/{d}/records/{name}.json")) if r["status"]==200]
        L=[r for r in recs if r["prompt_tokens"]>1000]; S=[r for r in recs if r["prompt_tokens"]<=1000]
        t=lambda g:[r["ttft_ms"] for r in g if r["ttft_ms"] is not None]
        gp=lambda g:[x for r in g for x in r["token_gaps_ms"]]
        row=res["routers"][name]
        f=lambda x: f"{round(x):,}"
        print(f"| {c} | {name} | {f(row['ttft_p50_ms'])} / {f(row['ttft_p90_ms'])} | {pct(t(L),.5):,} / {pct(t(L),.9):,} | {pct(t(S),.5):,} / {pct(t(S),.9):,} | {f(row['itl_p50_ms'])} / {f(row['itl_p90_ms'])} | {pct(gp(L),.9):,} / {pct(gp(S),.9):,} | {f(row['e2e_p50_ms'])} | {round(row['wall_s'])} | {row['router_cpu_s']} | {sum(row['requests_per_backend'].values())-80 if name=='kvroute-pd' else '-'} |")
