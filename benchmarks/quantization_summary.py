"""Ratios of the quantized runs of benchmarks/quantization.sh against bf16 from the same call:
reads latency-llama-3.1-8b-{q}-{gpu}.json / throughput-...json in DIR, prints a table and writes
quantization-summary-{gpu}.json beside them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _metric(path: Path, key: str) -> float | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text())["metrics"].get(key)


def main(out: str, gpu: str) -> None:
    root = Path(out)
    rows = {}
    for kind, key in (("latency", "decode_tokens_per_s"), ("throughput", "output_tokens_per_s")):
        for path in sorted(root.glob(f"{kind}-llama-3.1-8b-*-{gpu}.json")):
            quant = path.stem.removeprefix(f"{kind}-llama-3.1-8b-").removesuffix(f"-{gpu}")
            rows.setdefault(quant, {})[kind] = _metric(path, key)
            if kind == "latency":
                rows[quant]["roofline_fraction"] = _metric(path, "roofline_fraction")
    base = rows.get("none", {})
    for values in rows.values():
        for kind in ("latency", "throughput"):
            if values.get(kind) and base.get(kind):
                values[f"{kind}_vs_bf16"] = values[kind] / base[kind]
    print(f"{'quantization':<14}{'decode tok/s':>14}{'x bf16':>9}{'roofline':>10}{'offline tok/s':>15}{'x bf16':>9}")
    for quant, v in rows.items():
        def fmt(x, spec):
            return format(x, spec) if x is not None else "-"
        print(
            f"{quant:<14}{fmt(v.get('latency'), '14.1f')}{fmt(v.get('latency_vs_bf16'), '9.2f')}"
            f"{fmt(v.get('roofline_fraction'), '10.3f')}{fmt(v.get('throughput'), '15.0f')}"
            f"{fmt(v.get('throughput_vs_bf16'), '9.2f')}"
        )
    (root / f"quantization-summary-{gpu}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", help="the OUT directory of benchmarks/quantization.sh")
    parser.add_argument("gpu", help="the result files' GPU suffix (h100, h200)")
    args = parser.parse_args()
    main(args.dir, args.gpu)
