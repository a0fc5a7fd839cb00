#!/usr/bin/env python3
"""The table of scripts/bench-compare: Petal's figures (petal-bench compare) against llama-bench's, as ratios
beside the issue's targets. Reads the run's files from --work, prints the table on stdout and writes every
figure, ratio and target to --out (JSON). Standard library only."""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys


# Repetitions whose largest and smallest differ by more than this factor: the machine was busy, the row is suspect.
NOISY = 1.5


def load(path):
    with open(path) as f:
        return json.load(f)


def maybe(path):
    return load(path) if os.path.exists(path) else None


def llama_entry(entries, n_prompt, n_gen, n_depth=0):
    """The llama-bench result of one test (pp: n_gen 0; tg: n_prompt 0), or an error naming it."""
    for e in entries or []:
        if e.get("n_prompt") == n_prompt and e.get("n_gen") == n_gen and e.get("n_depth", 0) == n_depth:
            return e
    sys.exit(f"bench-compare-report: no llama-bench result for p={n_prompt} n={n_gen} d={n_depth}")


def ts(e):
    """Median tokens/s over llama-bench's repetitions (it reports the mean; Petal's figures are medians, and the
    median resists a repetition hit by load from other work on the machine)."""
    return statistics.median(e["samples_ts"]) if e.get("samples_ts") else ts(e)


def ms(e):
    """Median time of one repetition, in ms."""
    return (statistics.median(e["samples_ns"]) if e.get("samples_ns") else e["avg_ns"]) / 1e6


def llama_batched(work):
    """llama-batched-bench's decode throughput (S_TG, tokens/s over all sequences) per number of parallel
    sequences, one figure per repetition; None when it did not run."""
    path = os.path.join(work, "llama-batched.jsonl")
    if not os.path.exists(path):
        return None
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                e = json.loads(line)
                out.setdefault(e["pl"], []).append(e["speed_tg"])
    return out


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def gpu_model():
    """The GPUs' names and driver, as nvidia-smi reports them; None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout.strip()
        return out or None
    except (OSError, subprocess.CalledProcessError):
        return None


def spread(runs):
    """Largest over smallest of a figure's repetitions (1.0: all alike); None without at least two."""
    runs = [r for r in runs or [] if r]
    return max(runs) / min(runs) if len(runs) >= 2 else None


def row(name, unit, petal, reference, reference_name, better, target_op, target, how, note="", runs=(None, None)):
    """One line of the table. ratio = petal / reference; `better` says which direction is good for the ratio;
    the target is checked as `ratio target_op target`. `runs`: the repetitions of each side, whose spread tells
    how much load from other work moved the figures."""
    ratio = None if petal is None or not reference else petal / reference
    spreads = [x for x in map(spread, runs) if x is not None]
    met = None
    if ratio is not None and target is not None:
        met = ratio >= target if target_op == ">=" else ratio <= target if target_op == "<=" else ratio > target
    return {
        "row": name,
        "unit": unit,
        "petal": petal,
        "reference": reference,
        "reference_is": reference_name,
        "ratio": None if ratio is None else round(ratio, 3),
        "better": better,
        "target": None if target is None else f"{target_op} {target}",
        "met": met,
        "spread": round(max(spreads), 2) if spreads else None,
        "petal_runs": runs[0],
        "reference_runs": runs[1],
        "how": how,
        "note": note,
    }


def missing(name, unit, reason, target):
    return {
        "row": name, "unit": unit, "petal": None, "reference": None, "reference_is": None, "ratio": None,
        "better": None, "target": target, "met": None, "spread": None, "how": "", "note": f"MISSING: {reason}",
    }


def rows(work, petal):
    main = load(os.path.join(work, "llama-main.json"))
    depth = load(os.path.join(work, "llama-depth.json"))
    out = []

    tg = llama_entry(main, 0, 128)
    # llama.cpp's tg128 is measured again at the end, beside the RPC run: two figures far apart say that load
    # from other work slowed one stretch of the run evenly (which the spread of repetitions does not show).
    again = maybe(os.path.join(work, "llama-rpc-local.json"))
    note = f"llama.cpp tg128 again at the end of the run: {ts(llama_entry(again, 0, 128)):.1f}" if again else ""
    out.append(row("decode tg128", "tokens/s", petal["decode"]["tokens_per_second"], ts(tg),
                   "llama.cpp tg128", "higher", ">=", 0.9,
                   "128 single-token steps after a 1-token prompt", note,
                   runs=(petal["decode"]["runs_tokens_per_second"], tg.get("samples_ts"))))
    for n, target in ((512, 0.7), (2048, None)):
        pp = llama_entry(main, n, 0)
        p = next(x for x in petal["prefill"] if x["tokens"] == n)
        out.append(row(f"prefill pp{n}", "tokens/s", p["tokens_per_second"], ts(pp), f"llama.cpp pp{n}",
                       "higher", ">=", target, f"one forward of {n} token ids + head on the last position",
                       runs=(p["runs_ms"], pp.get("samples_ts"))))
    for d, target in ((2048, 0.8), (4096, None)):
        e = llama_entry(depth, 0, 32, d)
        p = next(x for x in petal["decode_at_depth"] if x["depth"] == d)
        out.append(row(f"decode at depth {d}", "tokens/s", p["tokens_per_second"], ts(e),
                       f"llama.cpp tg32 @ d{d}", "higher", ">=", target,
                       f"32 decode steps after a {d}-token prefill",
                       runs=(p["runs_tokens_per_second"], e.get("samples_ts"))))
    pp2048 = llama_entry(main, 2048, 0)
    p = next(x for x in petal["prefill"] if x["tokens"] == 2048)
    out.append(row("TTFT, 2048-token prompt", "ms", p["ms"], round(ms(pp2048), 2),
                   "llama.cpp pp2048 time", "lower", "<=", 1.5, "time of the 2048-token prefill",
                   runs=(p["runs_ms"], pp2048.get("samples_ns"))))

    rss = petal.get("node_rss")
    if rss is None:
        out.append(missing("peak RSS, node with all blocks", "MiB",
                           "not measured on a GPU (the weights live in device memory)", "<= 1.3"))
    else:
        llama_kb = int(open(os.path.join(work, "llama-rss.kb")).read().split()[-1])
        gguf = rss["gguf_bytes"]
        out.append(row("peak RSS, node with all blocks", "MiB", round(rss["vm_hwm_bytes"] / 2**20, 1),
                       round(gguf / 2**20, 1), "GGUF file size", "lower", "<=", 1.3,
                       "petal-node serve 0..30, no session: VmHWM",
                       f"llama-bench tg128 peak RSS {llama_kb / 1024:.1f} MiB = {llama_kb * 1024 / gguf:.2f}x GGUF; "
                       f"petal/llama.cpp {rss['vm_hwm_bytes'] / (llama_kb * 1024):.2f}x"))

    s = petal["sessions"]
    n = s["sessions"]
    out.append(row(f"{n} sessions, aggregate decode", "tokens/s", s["aggregate_tokens_per_second"],
                   s["lone_tokens_per_second"], "petal, 1 session alone", "higher", ">=", 6,
                   f"one node serving all blocks; {n} sessions x {s['tokens_each']} tokens at once",
                   runs=(s["runs_aggregate_tokens_per_second"], s["runs_lone_tokens_per_second"])))
    out.append(row(f"{n} sessions, per-token latency", "ms", s["concurrent"]["ms_per_token_median"],
                   s["lone"]["ms_per_token_median"], "petal, 1 session alone", "lower", "<=", 3,
                   "median step time of every session's steps"))
    batched = llama_batched(work)
    if batched and n in batched and 1 in batched:
        one, many = batched[1], batched[n]
        gain = statistics.median(many) / statistics.median(one)
        petal_gain = s["aggregate_tokens_per_second"] / s["lone_tokens_per_second"]
        out.append(row(f"{n} sessions, aggregate vs llama.cpp batched", "tokens/s",
                       s["aggregate_tokens_per_second"], statistics.median(many),
                       f"llama-batched-bench, {n} sequences", "higher", None, None,
                       f"llama-batched-bench -npp 8 -ntg 32 -npl 1,{n}: S_TG of {n} sequences",
                       f"batching gain (aggregate / one sequence): petal {petal_gain:.2f}x, llama.cpp {gain:.2f}x "
                       f"({statistics.median(one):.1f} -> {statistics.median(many):.1f} tokens/s)",
                       runs=(s["runs_aggregate_tokens_per_second"], many)))
    else:
        out.append(missing(f"{n} sessions, aggregate vs llama.cpp batched", "tokens/s",
                           f"no llama-batched-bench result for 1 and {n} sequences", None))

    sw = petal["swarm"]
    # The floor: the same spans chained over plain sockets, no libp2p (petal-bench's chain_floor), against a
    # local loop with no hand-off: what this machine allows any chain.
    floor = sw.get("floor")
    floor_note = (f"floor on this machine (the same spans over plain loopback sockets, no libp2p): "
                  f"{floor['ratio_to_local']:.3f} ({floor['chain_tokens_per_second']:.1f} vs "
                  f"{floor['local_tokens_per_second']:.1f} tokens/s); petal's chain is "
                  f"{sw['chain_tokens_per_second'] / floor['chain_tokens_per_second']:.3f}x the floor's chain"
                  if floor else "")
    out.append(row(f"{sw['nodes']} nodes vs local (petal)", "tokens/s", sw["chain_tokens_per_second"],
                   sw["local_tokens_per_second"], "petal local", "higher", ">=", 0.95,
                   f"tg{sw['tokens']} through {', '.join(sw['spans'])} on loopback, alternated with local",
                   floor_note, runs=(sw["runs_chain"], sw["runs_local"])))
    err = os.path.join(work, "llama-rpc.error")
    if os.path.exists(err):
        out.append(missing(f"{sw['nodes']} nodes vs llama.cpp RPC", "tokens/s", open(err).read().strip(), "> 1"))
    else:
        rpc = llama_entry(load(os.path.join(work, "llama-rpc.json")), 0, 128)
        local = llama_entry(load(os.path.join(work, "llama-rpc-local.json")), 0, 128)
        out.append(row(f"{sw['nodes']} nodes vs llama.cpp RPC", "tokens/s", sw["chain_tokens_per_second"],
                       ts(rpc), "llama.cpp over 3 rpc-servers", "higher", ">", 1,
                       "tg128; llama.cpp: -ngl 99 -ts 1/1/1 --rpc (3 local servers)",
                       f"llama.cpp RPC/local {ts(rpc) / ts(local):.3f} "
                       f"({ts(rpc):.2f} vs {ts(local):.2f} tokens/s)",
                       runs=(sw["runs_chain"], rpc.get("samples_ts"))))
    return out, tg


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table(report):
    head = ["row", "unit", "petal", "reference", "ratio", "better", "target", "met", "spread"]
    lines = [[r["row"], r["unit"], fmt(r["petal"]), f"{fmt(r['reference'])} ({r['reference_is']})"
              if r["reference_is"] else "-", fmt(r["ratio"]), r["better"] or "-", r["target"] or "-",
              {True: "yes", False: "NO", None: "-"}[r["met"]],
              "-" if r["spread"] is None else f"{r['spread']:.2f}x" + (" NOISY" if r["spread"] > NOISY else "")]
             for r in report["rows"]]
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(l, widths)) for l in lines]
    out += [f"  note: {r['row']}: {r['note']}" for r in report["rows"] if r["note"]]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    for a in ("--work", "--out", "--threads", "--model", "--started", "--load-start", "--load-end"):
        ap.add_argument(a, required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    petal = load(os.path.join(args.work, "petal.json"))
    table_rows, tg = rows(args.work, petal)
    report = {
        "started": args.started,
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": int(args.threads),
                    "device": args.device, "gpu": gpu_model() if args.device != "cpu" else None,
                    "load_avg_start": args.load_start, "load_avg_end": args.load_end},
        "model": args.model,
        "llama_cpp": {"build_commit": tg.get("build_commit"), "build_number": tg.get("build_number"),
                      "cpu_info": tg.get("cpu_info"), "backends": tg.get("backends"),
                      "flags": open(os.path.join(args.work, "llama-flags.txt")).read().strip()},
        "ratio": "petal / reference; 'better' says which direction is good; figures are medians of repetitions",
        "rows": table_rows,
        "petal": petal,
        "llama_bench": {name: maybe(os.path.join(args.work, f"llama-{name}.json"))
                        for name in ("main", "depth", "rss", "rpc", "rpc-local")},
        "llama_batched_bench": llama_batched(args.work),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    m = report["machine"]
    on = f"on {args.device} ({m['gpu']}), " if m["gpu"] else ""
    print(f"Petal vs llama.cpp: {args.model}, {on}{m['threads']} threads, {m['cpu']} ({m['cpus']} cpus), "
          f"load {args.load_start} -> {args.load_end}, llama.cpp {report['llama_cpp']['build_commit']} "
          f"({report['llama_cpp']['flags']}); KV cache: petal {petal.get('kv_dtype', '?')}, llama.cpp f16 (its default)")
    print("ratio = petal / reference (throughput rows: higher is better; ms and MiB rows: lower is better); "
          "every figure is a median over repetitions;\nspread = largest/smallest repetition of either side "
          f"(above {NOISY}x: NOISY, load from other work moved it; rerun on a quiet machine)")
    print(table(report))


if __name__ == "__main__":
    main()
