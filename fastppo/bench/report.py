"""The bench suite's output: one markdown table per op family, and the same as JSON."""

import json


def _bytes(n) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _time(row) -> str:
    return f"{row['median_ms']:.3f} ({row['min_ms']:.3f}-{row['max_ms']:.3f})"


def markdown(meta: dict, rows: list) -> str:
    memory = "peak allocated above the inputs"
    lines = [
        f"# fastppo bench: {meta['machine']}",
        "",
        f"{meta['date']}, commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"python {meta['python']}{', quick shapes' if meta['quick'] else ''}. "
        f"Copy bandwidth measured in this run: {meta['copy_gbps']:.0f} GB/s (read + write). "
        f"Times in ms: median (min-max). GB/s from the fewest bytes the op must move "
        f"(documented per op in fastppo/bench). Memory: {memory}.",
    ]
    for op in dict.fromkeys(r["op"] for r in rows):
        op_rows = [r for r in rows if r["op"] == op]
        rated = any(r["rate"] is not None for r in op_rows)  # e.g. generated tokens per second
        lines += [
            "",
            f"## {op}",
            "",
            "| shape | contender | pass | ms | x naive | GB/s | % copy | memory |" + (" items/s |" if rated else ""),
            "| --- " * (9 if rated else 8) + "|",
        ]
        for r in op_rows:
            if r["status"] != "ok":
                lines.append(
                    f"| {r['case']} | {r['contender']} | {r['mode']} | {r['status']} | | | | |"
                    + (" |" if rated else "")
                )
                continue
            speedup = f"{r['speedup']:.2f}" if r["speedup"] is not None else ""
            rate = f" {r['rate']:.0f} |" if rated else ""
            name = f"{r['contender']} ({r['note']})" if r.get("note") else r["contender"]
            lines.append(
                f"| {r['case']} | {name} | {r['mode']} | {_time(r)} | {speedup} | "
                f"{r['gbps']:.1f} | {r['pct_copy']:.0f} | {_bytes(r['memory_bytes'])} |{rate}"
            )
    return "\n".join(lines) + "\n"


def to_json(meta: dict, rows: list) -> str:
    return json.dumps({"meta": meta, "rows": rows}, indent=1)
