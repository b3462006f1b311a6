"""Start-up phases: the engine logs each phase as one structured line; `slipstream serve` reads
them back from tritonserver's log (with Triton's prefix and quoting around them) and prints
each as it happens, with its time, and a bar for a phase with steps."""

import io
import logging

from slipstream.server.launch.server_log import ServerLog
from slipstream.server.launch.startup_report import StartupReport
from slipstream.startup_log import Event, Phase, parse, phase


def phase_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("slipstream phase")]


def test_a_phase_logs_its_start_progress_and_end_with_its_time_and_detail(caplog):
    caplog.set_level(logging.INFO, logger="slipstream")
    with phase(Phase.KERNEL_BUILD, total=3, directory="/k") as progress:
        progress.step(1)
        progress.detail["flags"] = "avx512"
    events = [parse(line) for line in phase_lines(caplog)]
    assert [e.event for e in events] == [Event.START, Event.PROGRESS, Event.END]
    assert events[1].done == 1 and events[1].total == 3
    assert events[2].phase == "kernel build" and events[2].seconds >= 0
    assert events[2].detail == {"directory": "/k", "flags": "avx512"}


def test_a_failed_phase_logs_no_end(caplog):
    caplog.set_level(logging.INFO, logger="slipstream")
    try:
        with phase(Phase.WEIGHT_LOAD):
            raise RuntimeError("no weights")
    except RuntimeError:
        pass
    assert [parse(line).event for line in phase_lines(caplog)] == [Event.START]


def test_phase_lines_are_read_through_tritons_prefix_and_quotes():
    """As Triton 2.51 writes a pb_utils.Logger line: its prefix, the message quoted and escaped."""
    line = (
        r'I1129 00:44:41.557829 18505 triton_log.py:31] "slipstream: slipstream phase {\"phase\":'
        r' \"KV allocation\", \"event\": \"end\", \"seconds\": 0.25, \"blocks\": 900}"'
    )
    event = parse(line)
    assert event.phase == "KV allocation" and event.seconds == 0.25
    assert event.detail == {"blocks": 900}
    assert parse('I1129 model_lifecycle.cc:472] "loading: slipstream:1"') is None


def test_serve_prints_each_phase_of_the_server_log_as_it_grows(tmp_path):
    log = ServerLog(tmp_path / "triton.log")
    sink = log.open()
    out = io.StringIO()
    report = StartupReport(out)
    sink.write(rb'I0 x] "slipstream: slipstream phase {\"phase\": \"weight load\", ')
    sink.write(rb'\"event\": \"start\"}"' + b"\n")
    sink.write(rb'I0 x] "slipstream: slipstream phase {\"phase\": \"weight load\", \"event\": ')
    report.poll(log)  # the second line is not complete yet: not shown
    assert out.getvalue() == "  ... weight load\n"
    sink.write(rb'\"end\", \"seconds\": 2.5, \"model\": \"/m\"}"' + b"\n")
    report.poll(log)
    assert out.getvalue().splitlines()[-1] == "  weight load             2.5 s  (/m)"
    log.close()
