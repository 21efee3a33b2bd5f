"""``tools/bench_failover.py`` on the tiny model: the whole stack, as an operator runs
it (``llmgw server`` routing to two real llama-servers named as static
``llama.cpp`` endpoints), loses no stream when one engine is killed or stopped."""

from __future__ import annotations

from pathlib import Path

from tests.realparts import needs_server
from tools import bench_failover as bf


@needs_server
def test_no_stream_is_lost_when_an_engine_is_killed_or_stopped(tmp_path: Path) -> None:
    model = bf.write_model("tiny", tmp_path)
    reference: dict[int, str] = {}
    results = {}
    for event in ("unbroken", "kill", "stop"):
        # on a busy machine the tiny model can finish every stream between two reads
        # of its slots, before the fault, or finish the faulted engine's streams between
        # the read and the signal (every stream intact, none resumed): such a run says
        # nothing of a fault, so again
        for attempt in range(3):
            workdir = tmp_path / f"{event}-{attempt}"
            workdir.mkdir()
            r = results[event] = bf.run_event(event, model, workdir, reference)
            print(bf.table([r]))
            if event == "unbroken" or (r.faulted and (r.resumed or r.intact < bf.STREAMS)):
                break
    assert len(reference) == bf.STREAMS
    for event, r in results.items():
        assert r.intact == bf.STREAMS, (event, r.notes)
    for event in ("kill", "stop"):
        r = results[event]
        assert r.faulted, (event, r)
        assert r.identical == bf.STREAMS, (event, r.notes)
        assert 1 <= r.resumed < bf.STREAMS, (event, r)  # the stopped engine's share
        assert r.stall_p95_s is not None and r.prefill_p95_s is not None
    # found by silence (router.silent_after_s, 6 s), long before idle_timeout_s (60 s)
    detect = results["stop"].detect_s
    assert detect is not None and detect < 30, detect
    assert results["stop"].stall_max_s is not None and results["stop"].stall_max_s < 30
