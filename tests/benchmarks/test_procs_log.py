"""A ``Proc`` reads the lines its own runs wrote: a benchmark run again in the same
folder (``--workdir``) found the earlier run's llama-server port in the log it appends
to, and waited 60 s for that dead server's health, "no health (200) after 60 s"."""

from __future__ import annotations

from pathlib import Path

from tools.support.procs import Proc

LISTENS = r"listening on (\S+)"


def _server(tmp_path: Path, port: int) -> Proc:
    says = f"sleep 0.2; echo listening on http://127.0.0.1:{port}; sleep 0.2"
    return Proc("engine-0", ["sh", "-c", says], tmp_path, session=True)


def test_a_wait_is_answered_by_this_runs_lines_not_an_earlier_runs(tmp_path: Path) -> None:
    earlier = _server(tmp_path, 1111).start()
    assert earlier.wait_log(LISTENS, timeout=10)[1] == "http://127.0.0.1:1111"
    earlier.popen.wait(10)

    again = _server(tmp_path, 2222).start()  # the next run, in the same folder
    try:
        assert again.wait_log(LISTENS, timeout=10)[1] == "http://127.0.0.1:2222"
        assert "1111" not in again.log()
    finally:
        again.stop()
    assert "1111" in (tmp_path / "engine-0.log").read_text()  # the file keeps every run


def test_a_proc_started_again_still_reads_each_of_its_runs(tmp_path: Path) -> None:
    (tmp_path / "engine-0.log").write_text("listening on http://127.0.0.1:1111\n")
    proc = _server(tmp_path, 2222)
    proc.start().popen.wait(10)
    proc.start()  # a restart of the same process appends, and counts
    try:
        second = proc.wait_log(LISTENS, count=2, timeout=10)
        assert second[1] == "http://127.0.0.1:2222"
        assert proc.log().count("listening on") == 2
    finally:
        proc.stop()
