"""Multi-turn conversations synthesized from any trace, for prefix caching (issue 20).

The kit's traces other than Mooncake carry no content, so every prompt is unique and no cache
can hit. A conversation here is ``turns`` consecutive requests of the base trace: turn ``j``
asks the base request's prompt after everything said before (the system prompt, then each
earlier turn's prompt and answer), so its prompt is the previous turn's prompt plus that
turn's answer plus the new question, capped at ``max_prompt_len`` (the prompt then stops
growing). Sessions start at the base trace's arrival
times of their first turns; each next turn comes a think time (exponential, mean
``think_s``) after the previous one's arrival plus an estimate of its answer time. Every
session shares one system prompt of ``system_len`` tokens.

In the simulator (``lab/sim/simulator.py``) a session's prompt tokens are one deterministic
stream per session, so a turn's prompt extends the previous turn's; the previous answer's
tokens in the next prompt are the stream's, not what the simulated model generated, so the
cache can reuse the previous prompt's blocks but not its answer's (a slight underestimate of
the hits a real conversation gives).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lab.traces import TraceRequest

ANSWER_S_PER_TOKEN = 0.03  # the think-time clock starts after the answer would have streamed


def conversations(
    base: Sequence[TraceRequest],
    turns: int = 4,
    think_s: float = 10.0,
    system_len: int = 1024,
    max_prompt_len: int = 16384,
    seed: int = 0,
) -> list[TraceRequest]:
    """``base`` regrouped into sessions of ``turns`` turns (see the module docstring), sorted
    by arrival."""
    if turns < 1 or think_s < 0 or system_len < 0 or max_prompt_len < 1:
        raise ValueError("turns >= 1, think_s >= 0, system_len >= 0, max_prompt_len >= 1")
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    for session, start in enumerate(range(0, len(base), turns)):
        group = base[start : start + turns]
        arrival_s, history = group[0].arrival_s, system_len
        for request in group:
            prompt = min(max_prompt_len, history + request.input_len)
            out.append(
                dataclasses.replace(
                    request,
                    arrival_s=arrival_s,
                    input_len=prompt,
                    session=session,
                    system_len=min(system_len, prompt),
                )
            )
            history = prompt + request.output_len
            answer_s = request.output_len * ANSWER_S_PER_TOKEN
            arrival_s += answer_s + float(rng.exponential(think_s)) if think_s > 0 else answer_s
    return sorted(out, key=lambda r: r.arrival_s)
