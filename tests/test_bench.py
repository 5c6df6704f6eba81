"""bench.py --quick runs the whole harness on the CPU: every configuration, the HF baseline, the
quality column and the output files."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_quick_runs_every_configuration(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "bench.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in results["configs"]}
    from bench import CONFIGS
    assert set(rows) == set(CONFIGS) | {"HF transformers"}
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["prefill_tok_s"] > 0 and row["decode_b1_tok_s"] > 0
    assert rows["dense"]["agreement"] == 1.0
    quality = results["quality"]
    assert all(v["perplexity"] > 1 and 0 < v["top1_agreement"] <= 1 for v in quality.values()), quality
    assert quality["dense"]["top1_agreement"] == 1.0
    assert (out / "results.md").read_text().count("|") > 20
    assert (out / "tokens_per_sec.png").stat().st_size > 1000
    assert (out / "roofline.png").stat().st_size > 1000
    assert {p["config"] for p in results["gemm_points"]} == set(CONFIGS) - {"fused-off"}
