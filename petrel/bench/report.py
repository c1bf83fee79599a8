"""What the benchmarks report and how: the checks that decide whether a figure counts, the statistics over runs,
ratios between engines, the progress and summary lines on stderr, the markdown table of `petrel bench compare` and
the plot of `petrel bench serve --sweep`."""

from __future__ import annotations

import statistics
import sys


def log(msg: str) -> None:
    """A progress line of `petrel bench` on stderr (stdout carries the JSON results)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- figures


def w1_metrics(t_start: float, token_times: list[float]) -> dict:
    """W1's figures from the send time and each new token's arrival time: TTFT, and decode tok/s =
    (n - 1) / (t_last - t_first)."""
    n = len(token_times)
    if n == 0:
        return {"new_tokens": 0, "ttft_s": None, "decode_s": None, "decode_tok_s": None, "total_s": None}
    decode_s = token_times[-1] - token_times[0]
    return {
        "new_tokens": n,
        "ttft_s": token_times[0] - t_start,
        "decode_s": decode_s,
        "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else None,
        "total_s": token_times[-1] - t_start,
    }


def w6_metrics(requests: list[dict], kv_bytes_per_token: int) -> dict:
    """W6's figures from each request's send time, prompt length and new tokens' arrival times
    ({"t_send", "prompt_len", "times"}): TTFT per request; decode tok/s over the window in which every request is
    decoding (from the last first token to the last token: the tokens that arrived after it over its length); and
    the KV bandwidth the decode attention achieved in that window: the KV bytes its tokens read (a token at
    context c reads c tokens' keys and values) over the window's time. The window's time is whole steps (weights,
    sampling and all), so that figure is a lower bound of the attention's own."""
    firsts = [r["times"][0] for r in requests if r["times"]]
    out = {
        "ttft_s": [(r["times"][0] - r["t_send"]) if r["times"] else None for r in requests],
        "new_tokens": [len(r["times"]) for r in requests],
        "prompt_tokens": [r["prompt_len"] for r in requests],
        "decode_tok_s": None,
        "decode_window_s": None,
        "kv_read_gb_s": None,
    }
    if len(firsts) != len(requests):
        return out
    start = max(firsts)
    end = max(r["times"][-1] for r in requests)
    tokens = kv_read = 0
    for r in requests:
        for k, t in enumerate(r["times"]):
            if t > start:
                tokens += 1
                kv_read += (r["prompt_len"] + k) * kv_bytes_per_token
    if end > start and tokens:
        out.update(
            decode_tok_s=tokens / (end - start), decode_window_s=end - start, kv_read_gb_s=kv_read / (end - start) / 1e9
        )
    return out


def median(values):
    """The median of the values that are not None, or None when none are."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, interpolated linearly between the two nearest ranks (numpy's default); None if empty."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def count_problems(counts: list[int], expected: int, what: str = "request") -> list[str]:
    """The problem that makes a figure not count: requests that did not produce `expected` tokens (none: [])."""
    bad = [(i, c) for i, c in enumerate(counts) if c != expected]
    if not bad:
        return []
    shown = ", ".join(f"#{i}: {c}" for i, c in bad[:5]) + (" ..." if len(bad) > 5 else "")
    return [f"{len(bad)} of {len(counts)} {what}s did not produce {expected} tokens ({shown})"]


def ratio(workload: str, metric: str, a: dict | None, b: dict | None, extra: dict | None = None) -> dict:
    """petrel's figure over transformers' (a over b) for one workload; no value when either does not count."""
    result = {"workload": workload, "ratio": "petrel/hf-transformers", "metric": metric, "value": None}
    if a is None or b is None:
        result["note"] = "not measured on both engines"
    elif not a["valid"] or not b["valid"]:
        bad = [r["engine"] for r in (a, b) if not r["valid"]]
        result["note"] = f"does not count: wrong token counts from {', '.join(bad)}"
    elif a.get(metric) and b.get(metric):
        result["value"] = a[metric] / b[metric]
    for key, value in (extra or {}).items():  # the side figures count only when the main one does
        result[key] = value if result["value"] is not None else None
    return result


def matching_prefix(x: list[int], y: list[int]) -> int:
    """How many tokens two greedy outputs agree on from the start."""
    k = 0
    for p, q in zip(x, y):
        if p != q:
            break
        k += 1
    return k


# ---------------------------------------------------------------------------------------------- summaries


def summary(doc: dict) -> None:
    """The end of a `petrel bench` run on stderr: each engine's figures and each ratio, flagged when it does not
    count."""
    log(f"summary ({doc['meta']['dtype']}{', QUICK (not comparable)' if doc['meta']['quick'] else ''}):")
    for r in doc["results"]:
        flag = "" if r["valid"] else "  [DOES NOT COUNT]"
        if r["workload"] == "w1":
            ttft = f"{1000 * r['ttft_s']:.1f} ms" if r["ttft_s"] is not None else "n/a"
            dec = f"{r['decode_tok_s']:.2f}" if r["decode_tok_s"] is not None else "n/a"
            log(f"  {r['engine']:16s} w1: TTFT {ttft}, decode {dec} tok/s{flag}")
        elif r["workload"] == "w6":
            for key in ("batch", "long"):
                m = r[key]
                ttft = ", ".join(f"{t:.2f}" for t in m["ttft_s"] if t is not None) or "n/a"
                dec = f"{m['decode_tok_s']:.2f}" if m["decode_tok_s"] is not None else "n/a"
                bw = f"{m['kv_read_gb_s']:.2f}" if m["kv_read_gb_s"] is not None else "n/a"
                log(f"  {r['engine']:16s} w6 {key}: TTFT {ttft} s, decode {dec} tok/s, KV read {bw} GB/s{flag}")
        else:
            log(
                f"  {r['engine']:16s} {r['workload']}: wall {r['wall_s']:.2f}s, "
                f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, "
                f"cached {r['cached_prompt_tokens']}{flag}"
            )
    for q in doc["ratios"]:
        value = f"{q['value']:.2f}x" if q["value"] is not None else q.get("note", "n/a")
        log(f"  ratio petrel/hf {q['workload']} {q['metric']}: {value}")


def ratio_table(rows: list[dict], engines: list[str]) -> list[str]:
    """Markdown: one line per (workload, metric), a column per engine, then petrel / peer for each peer.

    Rows of several rounds (a "round" in each, `petrel bench compare --rounds`) make one line per figure: each
    engine's median over the rounds, and as the ratio the median of the rounds' own ratios (each petrel figure over
    the peer's of the same round), with the lowest and highest of them."""
    keys, values = [], {}
    for r in rows:
        key = (r["workload"], r["metric"])
        if key not in values:
            keys.append(key)
            values[key] = {"unit": r["unit"]}
        values[key].setdefault(r["engine"], {})[r.get("round", 0)] = r["value"]
    peers = [e for e in engines if e != "petrel"]
    head = ["workload", "metric"] + engines + [f"petrel / {p}" for p in peers]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    for key in keys:
        v = values[key]
        cells = [key[0], f"{key[1]} ({v['unit']})" if v["unit"] else key[1]]
        cells += [_cell(median((v.get(e) or {}).values())) for e in engines]
        cells += [_ratio_cell(v.get("petrel") or {}, v.get(p) or {}) for p in peers]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _ratio_cell(a: dict, b: dict) -> str:
    """petrel over a peer: their one figure's ratio, or over rounds ({round: figure}) the median of each round's
    ratio with its range; empty where no round has both."""
    ratios = [a[r] / b[r] for r in a if isinstance(a[r], (int, float)) and isinstance(b.get(r), (int, float)) and b[r]]
    if not ratios:
        return ""
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _cell(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x:,}"


def plot_sweep(results: list[dict], path: str, title: str = "petrel bench serve") -> None:
    """Output tok/s, and TTFT / TPOT (p50 and p99), against client concurrency; written as an image."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(xs, [r["output_tok_s"] for r in results], marker="o")
    ax1.set(xlabel="client concurrency", ylabel="output tokens/s", title="throughput")
    for key, label, style in [
        ("ttft_p50_s", "TTFT p50", "o-"),
        ("ttft_p99_s", "TTFT p99", "o--"),
        ("tpot_p50_s", "TPOT p50", "s-"),
        ("tpot_p99_s", "TPOT p99", "s--"),
    ]:
        ax2.plot(xs, [r[key] for r in results], style, label=label)
    ax2.set(xlabel="client concurrency", ylabel="seconds", title="latency", yscale="log")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
