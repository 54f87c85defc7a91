"""Output that reads in a file or a CI log. With stdout piped (`labkit run > out.txt`, a CI log) rich laid
every table at 80 columns and folded each cell into slices of its share (`runs/pat` / `ches/no-` / ...); without a
terminal a table is now laid out by labkit.console.plain_table."""
from __future__ import annotations

from typer.testing import CliRunner


def test_tables_without_a_terminal_read_at_80_columns_and_keep_paths_whole():
    """rich folds a table into its 80-column grid when stdout is a file: runs/pat / ches/no- / ... Without a
    terminal the short columns stay side by side and the long ones (reasons, paths) get lines of their own."""
    import io

    from labkit.console import LabConsole, plain_table, rows_table

    path = "runs/patches/no-graph-fallback-with-a-long-name.json"
    rows = [{"id": "patches.no-graph-fallback", "verdict": "FAIL", "seconds": 12.3, "evidence": path,
             "reason": "facts.graph_fallback_steps: expected eq 0, got 3 (the padded batch ran eager) " * 2}]
    out = io.StringIO()
    LabConsole(file=out, width=80, force_terminal=False).print(rows_table(rows, title="labkit run"))
    text = out.getvalue()
    assert path in text, text                                 # not sliced into 8-character cells
    lines = text.splitlines()
    assert all(len(line) <= 80 or " " not in line.strip() for line in lines), text
    assert any(line.startswith("patches.no-graph-fallback") and "FAIL" in line for line in lines), text
    assert "│" not in text and "┃" not in text
    kv = plain_table(__import__("labkit.console", fromlist=["kv_table"]).kv_table({"model": path, "rows": 3}))
    assert kv == [f"model  {path}", "rows   3"], kv


def test_labkit_check_piped_lists_every_evidence_path_whole(cli_app, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = CliRunner().invoke(cli_app, ["check", "setup"], env={"COLUMNS": ""})
    from labkit.checks import load_checkpoints
    from labkit.console import rel

    for cp in load_checkpoints():
        if cp.stage == "setup":
            assert rel(cp.evidence_path()) in res.output, (cp.id, res.output)      # whole: the long tmp path too
