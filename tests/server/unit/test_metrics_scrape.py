"""Metrics text read with prometheus_client's parser: label values holding spaces, braces and
escaped quotes (which splitting lines on spaces got wrong), histograms, and lookups by labels."""

from slipstream.server.launch.scrape import family_types, matching, parse_samples, sample_value

TEXT = r"""# HELP slipstream_requests_running Requests running.
# TYPE slipstream_requests_running gauge
slipstream_requests_running{model="a b",version="1"} 3
slipstream_requests_running{model="c}\"d",version="1"} 4
# TYPE slipstream_ttft_seconds histogram
slipstream_ttft_seconds_bucket{model="a b",le="0.1"} 1
slipstream_ttft_seconds_bucket{model="a b",le="+Inf"} 2
slipstream_ttft_seconds_sum{model="a b"} 0.5
slipstream_ttft_seconds_count{model="a b"} 2
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="length",model_name="a b"} 7
"""


def test_label_values_with_spaces_braces_and_quotes_are_read_whole():
    samples = parse_samples(TEXT)
    assert sample_value(samples, "slipstream_requests_running", model="a b") == 3
    assert sample_value(samples, "slipstream_requests_running", model='c}"d') == 4
    assert sum(s.value for s in matching(samples, "slipstream_requests_running")) == 7


def test_histogram_series_and_counters_are_samples_of_their_family():
    samples = parse_samples(TEXT)
    assert sample_value(samples, "slipstream_ttft_seconds_bucket", le="+Inf") == 2
    assert sample_value(samples, "slipstream_ttft_seconds_count") == 2
    assert sample_value(samples, "vllm:request_success_total", finished_reason="length") == 7
    assert sample_value(samples, "vllm:request_success_total", finished_reason="stop") is None
    assert family_types(TEXT) == {
        "slipstream_requests_running": "gauge",
        "slipstream_ttft_seconds": "histogram",
        "vllm:request_success": "counter",
    }
