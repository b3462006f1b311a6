"""The per-step scheduler trace and its Chrome trace export."""

from __future__ import annotations

import json
from collections import defaultdict

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from slipstream.engine.loop import EngineLoop
from slipstream.trace import StepTracer
from support import random_workload, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)


def make_engine(**overrides) -> LLMEngine:
    settings = dict(
        model=str(tiny_model_dir("llama")),
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=256,
        num_gpu_blocks_override=200,
        enable_prefix_caching=False,
        trace_steps=True,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def capture_scheduled_tokens(engine: LLMEngine) -> list:
    """(record, tokens the scheduler put in that step) for every traced step."""
    seen = []
    record = engine.tracer.record

    def wrapped(sched, *args):
        rec = record(sched, *args)
        seen.append((rec, sched.num_tokens))
        return rec

    engine.tracer.record = wrapped
    return seen


def runs_by_request(records) -> dict:
    """request id -> its entries, in step order, as (step, entry)."""
    runs = defaultdict(list)
    for rec in records:
        for e in rec.entries:
            runs[e.request_id].append((rec.step, e))
    return runs


def assert_slots_exclusive(records) -> None:
    """No step has two requests in one slot, and a slot is never handed to another request
    while its holder is still running (between its preemptions)."""
    owner = {}  # slot -> request id holding it
    for rec in records:
        slots = [e.slot for e in rec.entries]
        assert len(slots) == len(set(slots)), f"step {rec.step} shares a slot: {rec.entries}"
        for e in rec.entries:
            assert owner.get(e.slot, e.request_id) == e.request_id, (rec.step, e, owner)
            owner[e.slot] = e.request_id
        for e in rec.entries:
            if e.finished:
                owner.pop(e.slot)
        for rid in rec.preempted:
            for slot in [s for s, r in owner.items() if r == rid]:
                owner.pop(slot)


def test_chunked_prefill_then_decodes_and_token_counts():
    engine = make_engine()
    seen = capture_scheduled_tokens(engine)
    prompts = [list(range(100, 140)), [5, 6, 7], list(range(200, 230)), list(range(300, 310))]
    engine.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    records = list(engine.tracer.records)
    assert len(records) == engine.stats.steps == len(seen)
    for rec, scheduled in seen:
        assert rec.num_tokens == scheduled <= engine.config.max_num_batched_tokens
        assert rec.end >= rec.start and rec.kv_blocks_total == 200
    assert sum(r.num_tokens for r in records) == engine.stats.batched_tokens_total
    runs = runs_by_request(records)
    for i, prompt in enumerate(prompts):
        entries = [e for _, e in runs[f"req-{i}"]]
        kinds = ["prefill" if e.num_prefill_tokens else "decode" for e in entries]
        first_decode = kinds.index("decode")
        assert set(kinds[:first_decode]) == {"prefill"} and set(kinds[first_decode:]) == {"decode"}
        assert sum(e.num_prefill_tokens for e in entries) == len(prompt)
        # The prompt's last chunk samples the first token; each decode step one more.
        assert [e.num_decode_tokens for e in entries[first_decode:]] == [1] * 5
        assert entries[-1].finished and not any(e.finished for e in entries[:-1])
    # The 40-token prompt needed several chunks (budget 16), decodes ran beside prefills.
    assert len([e for _, e in runs["req-0"] if e.num_prefill_tokens]) >= 3
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in records)
    assert_slots_exclusive(records)
    for entries in runs.values():
        assert len({e.slot for _, e in entries}) == 1  # no preemption: one slot throughout
    assert records[-1].kv_blocks_used == 0 and records[-1].num_running == 0


def test_preemption_is_traced_and_slots_stay_exclusive():
    prompts, outs = random_workload(6, seed=5, lengths=(10, 30, 50), max_out=24)
    engine = make_engine(num_gpu_blocks_override=24, max_num_batched_tokens=64, max_num_seqs=8)
    seen = capture_scheduled_tokens(engine)
    engine.generate(prompts, [SamplingParams(max_tokens=o, **GREEDY) for o in outs])
    records = list(engine.tracer.records)
    preempted = [rid for r in records for rid in r.preempted]
    assert preempted and len(preempted) == engine.scheduler.num_preemptions
    for rec, scheduled in seen:
        assert rec.num_tokens == scheduled <= 64
    assert_slots_exclusive(records)
    assert max(e.slot for r in records for e in r.entries) < 8  # never more than max_num_seqs
    # A request preempted by recompute prefills again (prompt plus its outputs so far).
    runs = runs_by_request(records)
    victim = preempted[0]
    step = next(r.step for r in records if victim in r.preempted)
    after = [e for s, e in runs[victim] if s > step]
    assert after and after[0].num_prefill_tokens > 0
    events = engine.tracer.to_chrome_trace()["traceEvents"]
    instants = [ev for ev in events if ev["ph"] == "i"]
    assert len(instants) == len(preempted)
    assert all(ev["args"]["mode"] == "recompute" for ev in instants)


def test_chrome_trace_json(tmp_path):
    engine = make_engine()
    engine.generate([list(range(100, 130)), [7, 8, 9]], SamplingParams(max_tokens=4, **GREEDY))
    path = engine.tracer.save(tmp_path / "sub" / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert {ev["ph"] for ev in events} == {"M", "X", "C"}  # no preemption here: no "i"
    spans = [ev for ev in events if ev["ph"] == "X" and ev["cat"] != "step"]
    steps = [ev for ev in events if ev["ph"] == "X" and ev["cat"] == "step"]
    assert len(steps) == engine.stats.steps
    assert {ev["name"] for ev in spans} == {"req-0", "req-1"}
    assert {ev["cat"] for ev in spans} >= {"prefill", "decode"}
    assert all(ev["dur"] >= 0 and ev["ts"] >= 0 for ev in spans + steps)
    assert [ev["ts"] for ev in steps] == sorted(ev["ts"] for ev in steps)
    tokens = sum(ev["args"]["prefill_tokens"] + ev["args"]["decode_tokens"] for ev in spans)
    assert tokens == engine.stats.batched_tokens_total
    counters = {ev["name"] for ev in events if ev["ph"] == "C"}
    assert counters == {"kv_blocks", "requests", "tokens"}
    names = {ev["args"]["name"] for ev in events if ev["ph"] == "M" and ev["name"] == "thread_name"}
    assert {"slot 0", "slot 1", "steps"} <= names


def test_static_batching_padding_is_traced():
    engine = make_engine(batching="static", max_batch_size=4, max_num_batched_tokens=256)
    engine.generate(
        [[5, 6, 7], list(range(100, 110))],
        [SamplingParams(max_tokens=2, **GREEDY), SamplingParams(max_tokens=6, **GREEDY)],
    )
    records = list(engine.tracer.records)
    assert records[0].num_padding_seqs == 2  # two rows of the batch of 4 were never filled
    assert records[0].num_padding_tokens == 7 + 2 * 10  # the short prompt padded to 10
    assert records[-1].num_padding_seqs == 3  # the short request finished: its row is padding
    events = engine.tracer.to_chrome_trace()["traceEvents"]
    padding = [ev for ev in events if ev["ph"] == "X" and ev["cat"] == "padding"]
    assert len(padding) == sum(r.num_padding_seqs for r in records)
    for rec in records:  # padding rows are drawn on slots no request uses in that step
        busy = {e.slot for e in rec.entries}
        rows = {ev["tid"] for ev in padding if ev["args"]["step"] == rec.step}
        assert not rows & busy


def test_speculative_drafts_count_as_decode_tokens():
    # The target as its own draft model: drafts are proposed (and accepted) every step.
    path = str(tiny_model_dir("llama"))
    engine = make_engine(
        speculative_method="draft", speculative_model=path, num_speculative_tokens=3
    )
    seen = capture_scheduled_tokens(engine)
    engine.generate([[11, 12, 13], list(range(50, 70))], SamplingParams(max_tokens=12, **GREEDY))
    for rec, scheduled in seen:
        assert rec.num_tokens == scheduled
    entries = [e for r in engine.tracer.records for e in r.entries]
    drafted = [e for e in entries if e.num_spec_tokens]
    assert drafted, "the repetitive prompt should be drafted from"
    assert all(
        e.num_decode_tokens == 1 + e.num_spec_tokens and not e.num_prefill_tokens for e in drafted
    )
    assert sum(e.num_spec_tokens for e in entries) == engine.stats.spec_draft_tokens


def test_buffer_is_bounded():
    engine = make_engine()
    engine.tracer = StepTracer(max_records=3)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8, **GREEDY))
    assert len(engine.tracer.records) == 3 and engine.tracer.num_steps == 8
    assert engine.tracer.num_dropped == 5
    assert [r.step for r in engine.tracer.records] == [5, 6, 7]
    trace = engine.tracer.to_chrome_trace()
    assert trace["otherData"] == {"steps": 8, "dropped_steps": 5}


def test_tracing_is_off_by_default_and_trace_file_turns_it_on(tmp_path):
    assert make_engine(trace_steps=False).tracer is None
    config = EngineConfig.from_dict({"trace_file": str(tmp_path / "t.json")})
    assert config.trace_file == str(tmp_path / "t.json")
    assert EngineConfig.from_dict({"trace_file": ""}).trace_file is None


def test_engine_loop_writes_trace_file_on_shutdown(tmp_path):
    path = tmp_path / "trace.json"
    config = EngineConfig(
        model=str(tiny_model_dir("llama")),
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=128,
        num_gpu_blocks_override=100,
        trace_file=str(path),
    )
    loop = EngineLoop(config).start()
    outs = [loop.generate(p, SamplingParams(max_tokens=3, **GREEDY)) for p in ("hello", "bye")]
    assert not path.exists()
    loop.shutdown()
    trace = json.loads(path.read_text())
    names = {ev["name"] for ev in trace["traceEvents"] if ev["ph"] == "X" and ev["cat"] != "step"}
    assert names == {o.request_id for o in outs}
