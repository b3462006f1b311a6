"""The shared-prefix multi-turn workload: a few long system prompts, many users (each behind
one of them), several turns each, users arriving over time and thinking between turns. Turn k
of a user resends the whole conversation so far: the system prompt and the earlier turns are
a prefix some replica may hold."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from slipstream_bench.workload import PromptBuilder


@dataclass
class Conversation:
    id: str
    system_id: int
    system: str  # the system prompt's text
    user_messages: list[str]
    start_s: float  # arrival of the first turn, from the start of the run
    think_s: float  # pause between an answer and the next turn


@dataclass
class WorkloadSpec:
    num_systems: int = 6
    system_tokens: int = 700
    num_users: int = 16
    turns: int = 3
    user_tokens: int = 40
    max_tokens: int = 24
    user_rate: float = 0.1  # users arriving per second (Poisson)
    think_s: float = 2.0
    seed: int = 0

    def describe(self) -> str:
        return (
            f"{self.num_systems} system prompts x {self.system_tokens} tokens, "
            f"{self.num_users} users x {self.turns} turns ({self.user_tokens}-token messages, "
            f"{self.max_tokens}-token answers), users arriving at {self.user_rate}/s, "
            f"{self.think_s:g} s between turns"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def make_conversations(tokenizer, spec: WorkloadSpec) -> list[Conversation]:
    rng = random.Random(spec.seed)
    words = PromptBuilder(tokenizer)
    systems = [
        words.build(spec.system_tokens, rng, prefix=f"System {i}:")[0]
        for i in range(spec.num_systems)
    ]
    conversations, clock = [], 0.0
    for u in range(spec.num_users):
        clock += rng.expovariate(spec.user_rate)
        system_id = u % spec.num_systems
        messages = [
            words.build(spec.user_tokens, rng, prefix=f"User {u} turn {t}:")[0]
            for t in range(spec.turns)
        ]
        conversations.append(
            Conversation(f"u{u}", system_id, systems[system_id], messages, clock, spec.think_s)
        )
    return conversations
