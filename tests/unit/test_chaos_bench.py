"""benchmarks/chaos.py: its command line."""
from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.unit

chaos = load_benchmark("chaos")


def test_topologies_and_the_gap_between_faults_are_read_and_saturation_runs_ten_minutes(tmp_path):
    args = chaos.parse_args(["--topology", "1p1d, 2p2d", "--gap", "0.5,2", "--out", str(tmp_path)])
    assert (args.shapes, args.gap_s, args.minutes, args.saturate) == (["1p1d", "2p2d"], (0.5, 2.0), None, False)
    assert chaos.parse_args(["--saturate", "--topology", "1p1d", "--out", str(tmp_path)]).minutes == 10.0


@pytest.mark.parametrize("argv, said", [(["--topology", "1p1d,3p3d"], "--topology: unknown 3p3d; choose from 1p1d"),
                                        (["--gap", "5,1"], "--gap '5,1': give MIN,MAX seconds")])
def test_bad_arguments_are_refused_in_one_line_naming_the_option(argv, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        chaos.parse_args([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2 and said in capsys.readouterr().err
