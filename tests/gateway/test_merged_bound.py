"""A stream of several choices (n > 1, batched prompts) keeps the per-request output bound:
a client that reads nothing has every choice dropped and aborted on the worker, as one
choice's stream is, instead of its chunks piling up in the gateway (they did: an unbounded
queue between the choices and the response drained each choice's bounded outputs)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from gateway.choices import Choice, ChoiceStream, merged_events
from gateway.dispatcher import Dispatcher
from gateway.generation import Generation, GenerationParams
from gateway.inflight import InFlight, InFlightRequests, Route
from gateway.limits import KeyLimiter
from gateway.placement import Placement
from gateway.settings import GatewaySettings
from gateway.sse import ChunkFormat
from gateway.workers import WorkerDirectory
from shared.protocol import TokenOutput
from shared.sampling import SamplingParams
from shared.slo import DEFAULT_SLO_CLASSES
from shared.tokenizer import ByteTokenizer

MAX_BUFFERED = 4
NUM_OUTPUTS = 400


class _Generations:
    """What a Generation asks of the gateway's GenerationService, no Redis behind it."""

    def __init__(self, settings: GatewaySettings, live: InFlightRequests) -> None:
        self.settings = settings
        self.directory = WorkerDirectory(Redis(), settings)  # never connected
        self.live = live
        self.tokenizer = ByteTokenizer()

    def finish(self, generation: Generation) -> None:
        self.live.release(generation.record)

    def observe_tokens(self, *_: object) -> None:
        pass  # no metrics here


def _chunk(text: str, reason: str | None) -> dict[str, object]:
    return {"choices": [{"text": text, "finish_reason": reason}]}


async def _silent_client(num_choices: int) -> tuple[list[ChoiceStream], Dispatcher]:
    settings = GatewaySettings(max_buffered_outputs=MAX_BUFFERED, model="tiny-random")
    live = InFlightRequests()
    dispatcher = Dispatcher(Redis(), "gw", 100, live)
    service = _Generations(settings, live)
    params = GenerationParams([1, 2, 3], SamplingParams(), next(iter(DEFAULT_SLO_CLASSES.values())))
    streams = []
    for index in range(num_choices):
        request_id = f"req-{index}"
        placement = Placement(service.directory, KeyLimiter(10, 10), "w", 3, None)
        record = InFlight(request_id, Route("w", "e", request_id), placement, MAX_BUFFERED, 1e18)
        live.add(record)
        choice = Choice(index, Generation(service, record, params))  # type: ignore[arg-type]
        streams.append(ChoiceStream(choice, _chunk))
    events = merged_events(streams, [ChunkFormat(s.build, False) for s in streams], None)
    first = asyncio.ensure_future(events.__anext__())  # the response starts, then nobody reads
    await asyncio.sleep(0)
    for index in range(NUM_OUTPUTS):  # the worker's outputs arrive
        for choice in range(num_choices):
            dispatcher._route(TokenOutput(f"req-{choice}", index, [65 + index % 26]))
        await asyncio.sleep(0)
    first.cancel()
    return streams, dispatcher


async def test_a_client_that_reads_nothing_loses_every_choice_not_the_gateways_memory() -> None:
    for num_choices in (1, 3):
        streams, dispatcher = await _silent_client(num_choices)
        for stream in streams:
            outputs = stream.choice.generation.record.outputs
            assert outputs.error is not None, num_choices  # dropped: overflow
            assert len(outputs) <= MAX_BUFFERED
        held = sum(len(stream.choice.deltas) for stream in streams)
        assert held <= 3 * num_choices, held  # a chunk or so each, not NUM_OUTPUTS
        assert len(dispatcher._to_abort) == num_choices  # each to abort on the worker


async def test_the_choices_tasks_end_with_the_response() -> None:
    """The response ends while every choice has events waiting: its tasks end too (a task
    waiting for room to put its end marker outlived the response)."""
    await _silent_client(3)
    await asyncio.sleep(0.05)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending
