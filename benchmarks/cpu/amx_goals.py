"""Each goal of kiln's AMX work beside the figures `run_on_amx.sh OUT` measured for it, read from OUT's files.

A goal whose files are missing (a step failed, or was left out on a CPU without AMX) says so; nothing is
filled in. Ratios compare runs of the same machine; the figures recorded on a Xeon before the AMX paths
(the "before" column) come from another machine of the same kind and are context, not a measurement here.

    python benchmarks/cpu/amx_goals.py OUT [--write OUT/goals.txt]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Recorded on a 2-vCPU Intel Xeon with AMX before kiln had AMX paths (docs/benchmarks.md, docs/generation-results.md).
BEFORE = {
    "minilm 1x128": "kiln int8 9.25-9.28 ms, OpenVINO bf16 (its default on AMX) 4.45-4.59 ms",
    "minilm 1x16": "kiln int8 1.60-1.85 ms",
    "smollm2 in process": "16 streams x0.63, 64 streams x0.39 OpenVINO GenAI (greedy)",
    "served": "16 streams x1.41 (0.5B) and x1.46-1.48 (1B) llama-server",
    "prefill 512": "kiln int4 896.6 ms (kiln bench)",
}


def load(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def minilm(out: Path, amx: bool) -> list[str]:
    lines = ["MiniLM (all-MiniLM-L6-v2), in process, 2 threads (openvino-minilm.json):"]
    data = load(out / "openvino-minilm.json")
    if data is None:
        return lines + ["  missing: openvino-minilm.json"]
    # OpenVINO's CPU plugin computes in bf16 by default where the CPU has AMX, else in f32
    default = "openvino-bf16" if amx else "openvino-fp32"
    for batch, seq in ((1, 128), (1, 16)):
        rows = {r["variant"]: r for r in data["rows"] if (r["batch"], r["seq"]) == (batch, seq)}
        if not rows:
            continue
        best = min(rows.values(), key=lambda r: r["median_ms"])
        line = f"  {batch} x {seq}: kiln's fastest variant {best['variant']} ({best['matrix_engine']}) {best['median_ms']:.2f} ms"
        if default in rows:
            ratio = best["median_ms"] / rows[default]["median_ms"]
            line += f"; OpenVINO's default ({default}) {rows[default]['median_ms']:.2f} ms: {ratio:.2f}x its time"
        lines.append(line + f"  [before: {BEFORE[f'minilm {batch}x{seq}']}]")
    lines.append("  goal: 1 x 128 at most 1.00x OpenVINO's default; 1 x 16 no slower than before")
    # serve_variants_ab.sh: VARIANT-roundN.json (STS-B sentences, wrk), squad-long-VARIANT-roundN.json (kiln loadtest)
    served: dict[str, dict[str, list[float]]] = {"STS-B sentences": {}, "SQuAD paragraphs": {}}
    mismatches = []
    for path in sorted((out / "serve-minilm").glob("*-round*.json")):
        data, name = load(path), path.name.rsplit("-round", 1)[0]
        if name.startswith("squad-long-"):
            for step in data["steps"]:
                served["SQuAD paragraphs"].setdefault(name[len("squad-long-"):], []).append(step["requests_per_s"])
                mismatches.append(f"{name[len('squad-long-'):]} {step.get('mismatches', '?')} of {step.get('checked', '?')}")
        else:
            for run in data["median"]["runs"]:
                if run["concurrency"] == 16:
                    served["STS-B sentences"].setdefault(name, []).append(run["rps"])
    for inputs, by_variant in served.items():
        if not by_variant:
            lines.append(f"  missing: serve-minilm/ files for {inputs}")
            continue
        medians = {v: statistics.median(rps) for v, rps in by_variant.items()}
        text = ", ".join(f"{v} {rps:.0f}" for v, rps in sorted(medians.items(), key=lambda kv: -kv[1]))
        lines.append(f"  served c16, {inputs}, requests/s (median of rounds; serve-minilm/): {text}")
        if "int8" in medians:
            best = max(medians, key=medians.get)
            lines.append(f"    goal: the fastest at least 1.5x int8 (kiln's default before): {best} "
                         f"{medians[best] / medians['int8']:.2f}x")
    if mismatches:
        lines.append("  answers under load against alone (kiln loadtest --check): " + ", ".join(mismatches))
    manifest = load(out / "minilm" / "kiln.json")
    if manifest:
        kept = [v for v in manifest["variants"] if v.get("kept")]
        lines.append("  alone = batched, the gate's batch check (minilm/kiln.json): " + ", ".join(
            f"{v['name']} cos {v['validation'].get('batch_min_cosine', float('nan')):.12f}" for v in kept))
    eval_text = out / "minilm-eval.txt"
    if eval_text.is_file():
        rows = [line.strip("│ ") for line in eval_text.read_text().splitlines() if line.startswith("│")]
        lines.append("  STS-B Spearman x100, change against PyTorch fp32 (minilm-eval.txt; goal: within 0.3 of fp32): "
                     + "; ".join(" ".join(cell.strip() for cell in row.split("│")) for row in rows))
    return lines


def inprocess(out: Path, amx_on: int) -> list[str]:
    lines = ["SmolLM2 in process against OpenVINO GenAI, 2 threads, 128 tokens an answer:"]
    for mode in ("greedy", "sampled"):
        for amx in sorted({amx_on, 0}, reverse=True):
            runs = load(out / f"smollm2-inprocess-{mode}-amx{amx}" / "runs.json")
            if runs is None:
                lines.append(f"  missing: smollm2-inprocess-{mode}-amx{amx}/runs.json")
                continue
            by_engine: dict[str, dict[int, list[dict]]] = {}
            for run in runs:
                for result in run["results"]:
                    by_engine.setdefault(run["engine"], {}).setdefault(result["streams"], []).append(result)
            for engine, streams in by_engine.items():
                cells = []
                for n, results in sorted(streams.items()):
                    rate = statistics.median(r["output_tokens_per_s"] for r in results)
                    changed = sorted({r["changed"] for r in results if r.get("changed")})
                    cells.append(f"{n}: {rate:.1f} tok/s" + (f" (changed {', '.join(changed)})" if changed else ""))
                lines.append(f"  {mode}, KILN_AMX={amx}, {engine}: " + "; ".join(cells))  # kiln's names its unit
            kiln = next((s for e, s in by_engine.items() if e.startswith("kiln")), None)
            openvino = next((s for e, s in by_engine.items() if "OpenVINO" in e), None)
            if kiln and openvino:
                ratios = [f"{n} streams x{statistics.median(r['output_tokens_per_s'] for r in kiln[n]) / statistics.median(r['output_tokens_per_s'] for r in openvino[n]):.2f}"
                          for n in sorted(kiln) if n in openvino]
                lines.append(f"  {mode}: kiln / OpenVINO GenAI: " + ", ".join(ratios))
    lines.append(f"  goal: 16 and 64 streams at least x1.00 with 0 answers changed; one stream no slower with AMX on"
                 f"  [before: {BEFORE['smollm2 in process']}]")
    return lines


def bench(out: Path, amx_modes: list[int]) -> list[str]:
    lines = ["SmolLM2 kiln bench (gguf variant), 2 threads, median ms:"]
    cells: dict[int, dict[tuple[str, int, int], float]] = {}
    for amx in amx_modes:
        data = load(out / f"smollm2-bench-amx{amx}.json")
        if data is None:
            lines.append(f"  missing: smollm2-bench-amx{amx}.json")
            continue
        own = [c for c in data["cells"] if c["backend"].startswith("onnxruntime")]
        cells[amx] = {(c["phase"], c["batch"], c["tokens"]): c["median"] for c in own}
        # the unit the bench process ran on (kiln bench names it after loading: AMX on, or refused and why)
        units = sorted({c.get("matrix_engine", "?") for c in own})
        lines.append(f"  KILN_AMX={amx} ran on: {', '.join(units)}")
        if amx == 1 and not all(unit.startswith("AMX") for unit in units):
            why = [n for n in data.get("notes", []) if "KILN_AMX" in n]
            lines.append("  AMX WAS NOT ON in the KILN_AMX=1 runs: their figures are not AMX's" + "".join(f" ({n})" for n in why))
    for key in sorted({k for c in cells.values() for k in c}):
        text = ", ".join(f"KILN_AMX={amx} {cells[amx][key]:.2f}" for amx in sorted(cells) if key in cells[amx])
        if 0 in cells and 1 in cells and key in cells[0] and key in cells[1]:
            text += f" (AMX {cells[0][key] / cells[1][key]:.2f}x as fast)"
        lines.append(f"  {key[0]} batch {key[1]}, {key[2]} tokens: {text}")
    lines.append(f"  goal: prefill of 512 tokens at least 1.5x as fast as before; decode batch 1 no slower"
                 f"  [before: {BEFORE['prefill 512']}]")
    return lines


def served(out: Path, amx_on: int) -> list[str]:
    lines = ["Served against llama-server on the same Q4_K_M file, 16 streams, output tokens/s (median of rounds):"]
    for shape in ("Qwen2.5-0.5B-Instruct", "Llama-3.2-1B-Instruct"):
        data = load(out / f"served-{shape}" / "rows.json")
        if data is None:
            lines.append(f"  missing: served-{shape}/rows.json")
            continue
        # the unit kiln serve said it ran on (its model metadata), where the run recorded it
        units = sorted({r["unit"] for r in data["rows"] if r.get("server") == "kiln serve" and r.get("unit")})
        if units:
            lines.append(f"  {shape}: kiln serve ran on {', '.join(units)}")
            if amx_on and not all(unit.startswith("AMX") for unit in units):
                lines.append(f"  AMX WAS NOT ON in kiln serve's runs of {shape} (KILN_AMX=1): their figures are not AMX's")
        for mode in ("greedy", "sampled"):
            rates = {}
            for server in ("kiln serve", "llama-server"):
                values = [r["output_tokens_per_s"] for r in data["rows"]
                          if r["server"] == server and r["mode"] == mode and r["value"] == 16]
                if values:
                    rates[server] = statistics.median(values)
            if len(rates) == 2:
                lines.append(f"  {shape}, {mode}: kiln serve {rates['kiln serve']:.1f}, llama-server "
                             f"{rates['llama-server']:.1f}: x{rates['kiln serve'] / rates['llama-server']:.2f}")
    lines.append(f"  goal: at least x2.0 at both shapes  [before: {BEFORE['served']}]")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--write", type=Path, help="also write the summary to this file")
    args = parser.parse_args()
    cpu = (args.out / "cpu.txt").read_text() if (args.out / "cpu.txt").is_file() else "cpu.txt missing\n"
    amx = "amx_int8" in cpu
    amx_runs = amx or "REHEARSE=amx" in cpu  # the AMX-on steps ran (on a CPU without AMX: refused, to try them)
    amx_modes = [0, 1] if amx_runs else [0]
    text = "\n".join([cpu.rstrip(), "" if amx else "NO AMX on this CPU: a rehearsal; no AMX goal can be judged here.",
                      "", *minilm(args.out, "amx_bf16" in cpu), "", *bench(args.out, amx_modes), "",
                      *inprocess(args.out, 1 if amx_runs else 0), "", *served(args.out, 1 if amx_runs else 0)])
    print(text)
    if args.write:
        args.write.write_text(text + "\n")


if __name__ == "__main__":
    main()
