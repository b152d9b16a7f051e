"""The plan-cost benchmark runs end to end (figures are printed, not asserted: no timed tests)."""

from clients.bench import plan as bench_plan


def test_bench_plan_prints_a_row_per_context(capsys):
    assert bench_plan.main(["--seqs", "16", "--steps", "5", "--contexts", "64", "512"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {int(line.split()[0]): [float(v) for v in line.split()[1:]] for line in lines[-2:]}
    assert set(rows) == {64, 512}
    for plan_us, build_us, step_us, total_us, *_, plan_bytes in rows.values():
        assert 0 < build_us < plan_us  # the plan's delivery includes its build
        assert total_us == round(build_us + step_us) or abs(total_us - (build_us + step_us)) <= 1
        assert plan_bytes > 0
