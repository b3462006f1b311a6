"""The ration of cancellation polls (each a round trip to tritonserver): few requests are asked
often, many together no more than the budget, and none is forgotten."""

from slipstream.server.stub.cancel_polls import CancelPolls


def _simulate(
    polls: CancelPolls, num_active: int, has_output: bool, seconds: float, tick: float = 0.02
) -> list[list[float]]:
    """When each of ``num_active`` requests is asked, with the sender passing every ``tick``."""
    last = [float("-inf")] * num_active
    asked: list[list[float]] = [[] for _ in range(num_active)]
    now = 0.0
    while now < seconds:
        for i in range(num_active):
            if polls.due(last[i], now, has_output, num_active):
                last[i] = now
                asked[i].append(now)
        now += tick
    return asked


def test_a_few_streaming_requests_are_asked_every_streaming_interval():
    polls = CancelPolls()
    asked = _simulate(polls, num_active=4, has_output=True, seconds=2.0)
    for times in asked:
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) < polls.streaming_s + 0.03, gaps


def test_many_requests_together_stay_within_the_polls_per_second_budget():
    polls = CancelPolls()
    seconds, num_active = 10.0, 64
    asked = _simulate(polls, num_active, has_output=True, seconds=seconds)
    total = sum(len(t) for t in asked) - num_active  # each request's first ask is at once
    assert total <= polls.per_second * seconds, total
    # ...and every request is still asked within its share of the budget
    for times in asked:
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert gaps and max(gaps) < num_active / polls.per_second + 0.03, gaps


def test_a_request_with_nothing_to_send_is_asked_at_the_idle_interval():
    polls = CancelPolls()
    assert polls.interval(has_output=False, num_active=1) == polls.idle_s
    assert polls.interval(has_output=True, num_active=1) == polls.streaming_s
    assert polls.interval(has_output=False, num_active=200) == 200 / polls.per_second
