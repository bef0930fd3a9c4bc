"""Running ``python -m minddp.simulate`` in-process, for the simulator's tests: exit code, stdout, stderr."""

from minddp.simulate.__main__ import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
