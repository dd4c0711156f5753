"""tools/bench_context.py: the predictions and the table (the measurement is the benchmark's,
run by hand: it spawns fresh interpreters at s = 2k..32k)."""

import argparse

import tools.bench_context as tool


def test_predictions_fall_by_c_and_the_table_shows_every_row():
    a = argparse.Namespace(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    rows = []
    for c in (1, 2, 4):
        row = {"seq": 2048, "c": c, **tool.predict_row(a, 2048, c)}
        row.update(saved_bytes=row["pred_saved_bytes"], rss_rise_bytes=row["pred_step_bytes"],
                   ring_bytes_per_iter=row["pred_ring_bytes"], step_s=1.0,
                   saved_vs_c1=1 / c, pred_saved_vs_c1=1 / c)
        rows.append(row)
    assert rows[1]["pred_saved_bytes"] * 2 == rows[0]["pred_saved_bytes"]
    assert rows[0]["pred_ring_bytes"] == 0 and rows[2]["pred_ring_bytes"] > rows[1]["pred_ring_bytes"]
    text = tool.table(rows)
    assert len(text.splitlines()) == 5 and "pred_step_MB" in text
