"""Requests into the engine, between steps: submitted ones, those whose grammar compiled and
those parked while their gateway looked dead; refused ones end at once with an error output."""

from __future__ import annotations

import time

import structlog

from data_plane.engine.engine import Engine
from data_plane.engine.request import RequestError
from data_plane.grammar_intake import PendingGrammars
from data_plane.orphans import GatewayWatch, end_orphan
from data_plane.replies import Replies
from shared.protocol import SubmitRequest, TokenOutput
from shared.protocol.limits import MAX_ERROR_CHARS

log = structlog.get_logger(__name__)


class Admission:
    def __init__(
        self,
        engine: Engine,
        replies: Replies,
        gateways: GatewayWatch,
        grammars: PendingGrammars,
        worker_id: str,
    ) -> None:
        self.engine = engine
        self.replies = replies
        self.gateways = gateways
        self.grammars = grammars
        self.worker_id = worker_id

    def submit(self, msg: SubmitRequest) -> None:
        """Into the engine, unless a duplicate, its gateway is dead (parked, else ended) or its
        structured output must compile first (held)."""
        if msg.request_id in self.replies:
            return  # a redelivered duplicate of a request the engine already owns
        if self.gateways.owns_dead(msg.reply_stream):  # unless it beats again (restarted)
            if not self.gateways.park(msg):
                end_orphan(self.replies, msg.request_id, msg.reply_stream, self.gateways.dead_s)
            return
        if self.grammars.hold(msg):  # its structured output compiles off the loop first
            return
        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.sampling,
                priority=msg.priority,
                slo_ttft_s=msg.slo_ttft_s,
                slo_tbt_s=msg.slo_tbt_s,
                t_arr_s=msg.t_arr_s,
                tenant=msg.tenant,
            )
        except (RequestError, ValueError) as exc:
            log.warning("request_rejected", request_id=msg.request_id, error=str(exc))
            param = exc.param if isinstance(exc, RequestError) else None
            self.refuse(msg, str(exc), "rejected", param)
            return
        except Exception as exc:  # a bug: the client gets an error now, not a timeout
            log.exception("request_admission_failed", request_id=msg.request_id)
            self.refuse(msg, f"engine error: {exc!r}", "engine")
            return
        fields = {"worker_id": self.worker_id, "admitted_s": time.time()}
        fields |= {"arrival_s": msg.t_arr_s, "slo_class": msg.slo_class or ""}
        self.replies.admit(msg.request_id, msg.reply_stream, fields)
        log.info(
            "request_admitted",
            request_id=msg.request_id,
            num_prompt_tokens=len(msg.prompt_token_ids),
        )

    def refuse(self, msg: SubmitRequest, reason: str, kind: str, param: str | None = None) -> None:
        """An error output for ``msg`` (``param``: the field at fault), sent with this
        iteration's outputs (and kept while Redis refuses it, like any output)."""
        error = TokenOutput(
            msg.request_id,
            0,
            [],
            "error",
            reason[:MAX_ERROR_CHARS],
            error_kind=kind,
            error_param=param,
        )
        self.replies.reject(msg.reply_stream, error)

    def take_waiting(self) -> None:
        """Parked requests whose gateway beats again join (those still dead are told, should
        their gateway be only frozen); compiled grammars' requests join or are refused."""
        revived, dropped = self.gateways.unparked()
        for msg in revived:
            self.submit(msg)
        for msg in dropped:
            end_orphan(self.replies, msg.request_id, msg.reply_stream, self.gateways.dead_s)
        for msg, error in self.grammars.ready():  # compiled off the loop: now they join
            if error is None:
                self.submit(msg)
            elif isinstance(error, RequestError):
                self.refuse(msg, str(error), "rejected", error.param)
            else:  # a bug: the client gets an error now, not a timeout
                log.error("grammar_compile_failed", request_id=msg.request_id, error=repr(error))
                self.refuse(msg, f"engine error: {error!r}", "engine")
