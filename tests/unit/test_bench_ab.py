"""clients/bench/ab.py: variants alternate A B, B A, ... in their own processes with their own
environment; the summary's medians and ratios come from the rounds; bad variants and failing
commands are reported, not summarized."""

from __future__ import annotations

import json
import sys

import pytest

from clients.bench import ab

# prints two rows whose value is batch x $F, and logs which variant ran to $LOG
FAKE = [sys.executable, "-c",
        "import json, os\n"
        "f = float(os.environ.get('F', '1'))\n"
        "open(os.environ['LOG'], 'a').write(os.environ.get('TAG', '-') + '\\n')\n"
        "print('warming up')\n"
        "for b in (16, 48):\n"
        "    print(json.dumps({'batch': b, 'graph_forward_gpu_ms': b * f, 'other': 1}))\n"]


def test_variants_alternate_and_the_summary_gives_medians_and_ratios(tmp_path, monkeypatch):
    log = tmp_path / "log"
    monkeypatch.setenv("LOG", str(log))
    variants = [ab.parse_variant("base:TAG=a,F=1"), ab.parse_variant("fast:TAG=b,F=0.9")]
    results = ab.run_rounds(FAKE, variants, 3, "batch", "graph_forward_gpu_ms")
    assert log.read_text().split() == ["a", "b", "b", "a", "a", "b"]
    assert results["base"] == [{"16": 16.0, "48": 48.0}] * 3
    table = ab.summarize(results)
    assert [row["key"] for row in table] == ["16", "48"]
    assert table[1]["fast"] == pytest.approx(43.2) and table[1]["fast/base"] == pytest.approx(0.9)
    assert table[0]["fast/base range"] == pytest.approx((0.9, 0.9))
    text = ab.format_summary(table, ["base", "fast"], "graph_forward_gpu_ms")
    assert "fast/base 0.900 (0.900-0.900)" in text


def test_the_command_line_writes_the_rounds_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOG", str(tmp_path / "log"))
    out = tmp_path / "ab.json"
    flags = ["--variant", "a:F=2", "--variant", "b:", "--rounds", "2", "--out", str(out)]
    assert ab.main([*flags, "--", *FAKE]) == 0
    saved = json.loads(out.read_text())
    assert saved["variants"] == {"a": {"F": "2"}, "b": {}} and len(saved["rounds"]["a"]) == 2
    assert saved["summary"][0]["b/a"] == pytest.approx(0.5)
    with pytest.raises(SystemExit):  # one variant only
        ab.main(["--variant", "a:", "--", *FAKE])
    with pytest.raises(SystemExit):
        ab.main(["--variant", "a:", "--variant", "a:F=1", "--", *FAKE])  # the same name twice
    with pytest.raises(SystemExit):
        ab.main(["--variant", "a:NOEQUALS", "--variant", "b:", "--", *FAKE])
    assert ab.main(["--variant", "a:", "--variant", "b:"]) == 2  # no `--` and no command
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]
    assert ab.main(["--variant", "a:", "--variant", "b:", "--", *failing]) == 1
    assert "exit 3: boom" in capsys.readouterr().err
    silent = [sys.executable, "-c", "print('no json')"]
    assert ab.main(["--variant", "a:", "--variant", "b:", "--", *silent]) == 1


def test_rows_from_one_json_document_or_json_lines_among_text():
    """`bench throughput --json` prints one indented document whose rows are its `runs`; the step bench
    prints JSON lines among log text. A dotted --value reaches into a row; rows without the key or with
    a value that is not a number are left out, and a line that starts like JSON but is not is skipped."""
    doc = {"mode": "throughput", "runs": [
        {"label": "ours[400]", "output_tok_s": 12158.2, "ideal": {"measured_over_ideal": 0.684}},
        {"label": "hf-cb", "output_tok_s": 697.5, "ideal": None},
        {"output_tok_s": 1.0},
    ]}
    text = "pagedserve scheduler listening on 127.0.0.1:1\n" + json.dumps(doc, indent=2) + "\ndone\n"
    assert ab.values_by_key(text, "label", "output_tok_s", "runs") == {"ours[400]": 12158.2, "hf-cb": 697.5}
    assert ab.values_by_key(text, "label", "ideal.measured_over_ideal", "runs") == {"ours[400]": 0.684}
    assert ab.values_by_key(text, "label", "output_tok_s") == {}  # the rows are in `runs`
    assert ab.values_by_key(text, "label", "output_tok_s", "missing") == {}
    lines = "\n".join([
        "warming up", "{not json", json.dumps({"batch": 16, "graph_forward_gpu_ms": 4.9}),
        json.dumps({"batch": 48, "graph_forward_gpu_ms": True}), json.dumps({"batch": 64, "x": 1}),
    ])
    assert ab.values_by_key(lines, "batch", "graph_forward_gpu_ms") == {"16": 4.9}


def test_the_command_line_pairs_a_json_document(tmp_path, capsys):
    script = tmp_path / "doc.py"
    script.write_text(
        "import json, os\n"
        "f = float(os.environ.get('F', '1'))\n"
        "print(json.dumps({'runs': [{'label': 'ours', 'output_tok_s': 100 * f}]}, indent=2))\n"
    )
    command = [sys.executable, str(script)]
    flags = ["--variant", "a:", "--variant", "b:F=1.1", "--rounds", "2", "--key", "label",
             "--value", "output_tok_s"]
    assert ab.main([*flags, "--rows", "runs", "--", *command]) == 0
    assert "b/a 1.100 (1.100-1.100)" in capsys.readouterr().out
    assert ab.main([*flags, "--", *command]) == 1  # without --rows: no row at the top level
    assert "no JSON row with 'label' and 'output_tok_s'" in capsys.readouterr().err


def test_a_sigterm_reaches_the_command_and_ends_the_rounds(tmp_path):
    """`timeout` ending an A/B run: the running command gets the SIGTERM (so a bench stops its
    servers), ab waits for it, then exits 143 instead of starting the next round."""
    import signal
    import subprocess
    import time

    child = tmp_path / "child.py"
    child.write_text(
        "import pathlib, signal, sys, time\n"
        f"mark = pathlib.Path({str(tmp_path / 'stopped')!r})\n"
        f"pathlib.Path({str(tmp_path / 'started')!r}).write_text('1')\n"
        "def stop(signum, frame):\n"
        "    time.sleep(0.5)  # stopping what it started\n"
        "    mark.write_text('stopped')\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n"
        "print('{\"batch\": 1, \"graph_forward_gpu_ms\": 1.0}')\n"
    )
    proc = subprocess.Popen([sys.executable, "-m", "clients.bench.ab", "--variant", "a:", "--variant", "b:",
                             "--rounds", "3", "--", sys.executable, str(child)])
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "started").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert (tmp_path / "stopped").read_text() == "stopped"  # the command stopped before ab exited
