"""An OpenAI request body -> the generation's parameters, in one place: the sampling
parameters (:class:`shared.sampling.SamplingParams`, the one type the worker samples with),
the context-length check and the class and priority the caller is served at."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from gateway.errors import APIError
from gateway.generation import GenerationParams
from gateway.openai_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.tenancy import Caller, served_class, served_priority
from shared.grammar import grammar_problem
from shared.protocol.limits import MAX_PROMPT_LOGPROBS_TOKENS, MAX_SPEC_BYTES
from shared.sampling import SamplingParams, StructuredOutput


def generation_params(
    state: GatewayState,
    request: Request,
    body: SamplingFields,
    caller: Caller,
    prompt_ids: list[int],
    max_tokens: int | None,
    tool_structured: StructuredOutput | None = None,
) -> GenerationParams:
    """The parameters of one generation; 400 for a prompt past the context, 503 with no
    worker to size it against."""
    slo = served_class(state, caller, request.headers.get("x-slo-class"))
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    max_model_len = state.directory.max_model_len()
    if max_model_len is None:
        raise state.directory.no_worker_error()
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    max_tokens = _max_tokens(max_tokens, len(prompt_ids), max_model_len, prompt_param)
    sampling = sampling_params(body, max_tokens, state.settings, tool_structured)
    if sampling.prompt_logprobs is not None and len(prompt_ids) > MAX_PROMPT_LOGPROBS_TOKENS:
        param = "echo" if body.prompt_logprobs is None else "prompt_logprobs"
        message = "the prompt's log-probabilities are served for at most "
        message += f"{MAX_PROMPT_LOGPROBS_TOKENS} prompt tokens; this prompt has {len(prompt_ids)}"
        raise APIError(400, message, param=param)
    state.prompts.check_ids(list(sampling.logit_bias_ids), "logit_bias")
    state.prompts.check_ids(list(sampling.stop_token_ids), "stop_token_ids")
    return GenerationParams(
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        slo=slo,
        priority=served_priority(caller, body.priority, state.directory.knobs.policy),
        tenant=caller.tenant,
        key_id=caller.key_id,
        end_user=body.user,
        prompt_param=prompt_param,
    )


def _max_tokens(
    requested: int | None, num_prompt: int, max_model_len: int, prompt_param: str
) -> int:
    """The request's max_tokens, the rest of the context when it gives none (vLLM's rule); a
    400 naming the prompt when it fills the context alone, else ``max_tokens``. 0 (an
    echo-only completion: its prompt scored, nothing generated) may fill the whole context
    and samples one token, which is not returned."""
    if requested == 0:
        if num_prompt > max_model_len:
            message = f"the prompt has {num_prompt} tokens, over this model's maximum context "
            message += f"length of {max_model_len} tokens"
            raise APIError(400, message, param=prompt_param, code="context_length_exceeded")
        return 1
    max_tokens = max_model_len - num_prompt if requested is None else requested
    if num_prompt + max_tokens > max_model_len or max_tokens < 1:
        limit = f"this model's maximum context length of {max_model_len} tokens"
        if requested is None:
            message = f"the prompt has {num_prompt} tokens, which leaves no room for output "
            message += f"within {limit} (max_tokens not given)"
        else:
            message = f"the prompt has {num_prompt} tokens and max_tokens is {requested}: "
            message += f"{num_prompt + requested} in all, over {limit}"
        param = prompt_param if num_prompt >= max_model_len else "max_tokens"
        raise APIError(400, message, param=param, code="context_length_exceeded")
    return max_tokens


def _logit_bias(bias: dict[str, object] | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """OpenAI's logit_bias (token id as a string -> a bias in [-100, 100]) as the two tuples
    of :class:`SamplingParams`; 400 naming ``logit_bias`` otherwise (ids past the vocabulary:
    :func:`generation_params`)."""
    ids: list[int] = []
    values: list[float] = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if not 0 <= token <= 2**31 - 1 or number is None or not -100 <= number <= 100:
            raise APIError(
                400,
                f"logit_bias maps token ids to biases in [-100, 100]; got {key[:32]!r}: "
                f"{str(value)[:32]}",
                param="logit_bias",
            )
        ids.append(token)
        values.append(float(number))
    return tuple(ids), tuple(values)


# vLLM's structured_outputs keys -> our kinds (json_object: any JSON object)
_VLLM_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# vLLM's structured-output options that hold of every output here, accepted when true: JSON
# is generated without free whitespace (shared/grammar.py), and there is one grammar backend.
_VLLM_OPTIONS = {"disable_any_whitespace", "disable_fallback"}


def _as_structured(kind: str, value: object, param: str) -> StructuredOutput:
    """One field's structured output; 400 naming ``param`` when it is not of its kind's
    type (a schema: an object or its JSON text; a regex or grammar: text; a choice: a list
    of strings)."""
    if kind == "json" and isinstance(value, dict):
        return StructuredOutput("json", json.dumps(value))
    if (
        kind == "choice"
        and isinstance(value, list)
        and value
        and all(isinstance(c, str) for c in value)
    ):
        return StructuredOutput("choice", json.dumps(value))
    if kind in ("json", "regex", "grammar") and isinstance(value, str) and value:
        return StructuredOutput(kind, value)
    raise APIError(400, f"{param}: not a valid {kind} structured output", param=param)


def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The request's structured output, from OpenAI's ``response_format`` (``json_object``,
    ``json_schema``) or vLLM's ``structured_outputs`` / ``guided_*``: at most one of them."""
    found: list[StructuredOutput] = []
    fmt = body.response_format
    if fmt is not None:
        found.extend(_response_format(fmt))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            found.append(_as_structured(kind, value, f"guided_{kind}"))
    if body.structured_outputs is not None:
        found.append(_vllm_structured(body.structured_outputs))
    if len(found) > 1:
        names = [name for name in _STRUCTURED_FIELDS if getattr(body, name) is not None]
        message = f"one structured output at most; given: {', '.join(names)}"
        raise APIError(400, message, param=names[-1])
    return found[0] if found else None


_FORMAT_KEYS = {"type", "json_schema"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _response_format(fmt: object) -> list[StructuredOutput]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    for where, given, known in (("", fmt, _FORMAT_KEYS), (".json_schema", spec, _JSON_SCHEMA_KEYS)):
        unknown = sorted(set(given) - known) if isinstance(given, dict) else []
        if unknown:
            param = f"response_format{where}.{unknown[0][:64]}"
            raise APIError(400, f"'{param}' is not a field", param=param)
    if kind in ("text", "json_object") and isinstance(fmt, dict) and "json_schema" in fmt:
        message = f"response_format.json_schema is read only with type json_schema, not {kind}"
        raise APIError(400, message, param="response_format.json_schema")
    if kind == "text":
        return []
    if kind == "json_object":
        return [StructuredOutput("json", '{"type": "object"}')]
    if kind == "json_schema" and isinstance(fmt, dict):
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return [_as_structured("json", schema, "response_format")]
    raise APIError(
        400,
        "response_format is {type: text | json_object | json_schema (with json_schema.schema)}",
        param="response_format",
    )


def _vllm_structured(params: object) -> StructuredOutput:
    """vLLM's ``structured_outputs``: one of json, regex, choice, grammar, json_object; of its
    options, those true of every output here (``_VLLM_OPTIONS``) are accepted, any other
    option is a 400 naming it."""
    if isinstance(params, dict):
        given = {k: v for k, v in params.items() if v not in (None, False)}
        for key, value in given.items():
            param = f"structured_outputs.{str(key)[:64]}"
            if key in _VLLM_OPTIONS and value is not True:
                raise APIError(400, f"{param} takes true or false", param=param)
            if key not in _VLLM_OPTIONS and key not in _VLLM_KEYS and key != "json_object":
                raise APIError(400, f"'{param}' is not supported", param=param)
        given = {k: v for k, v in given.items() if k not in _VLLM_OPTIONS}
        if given == {"json_object": True}:
            return StructuredOutput("json", '{"type": "object"}')
        if len(given) == 1 and next(iter(given)) in _VLLM_KEYS:
            ((key, value),) = given.items()
            return _as_structured(_VLLM_KEYS[key], value, f"structured_outputs.{key}")
    raise APIError(
        400,
        "structured_outputs takes one of json, regex, choice, grammar or json_object",
        param="structured_outputs",
    )


async def refuse_uncompilable(
    state: GatewayState,
    body: SamplingFields,
    structured: StructuredOutput | None,
    from_tools: bool,
) -> None:
    """400 naming the field for a structured output that does not compile, before anything
    is submitted (a stream's 200 would be sent before the worker found out). Built on the
    gateway's one grammar thread, never on the event loop: requests without a structured
    output never wait for it; those with one are checked one at a time (the last 256 answers
    cached: most builds take well under a millisecond)."""
    if structured is None:
        return
    param = "tools" if from_tools else _structured_param(body)
    num_bytes = len(structured.spec.encode())
    if num_bytes > MAX_SPEC_BYTES:
        message = f"the structured output is {num_bytes} bytes as JSON; at most {MAX_SPEC_BYTES}"
        raise APIError(400, message, param=param)
    loop = asyncio.get_running_loop()
    problem = await loop.run_in_executor(state.grammar_thread, grammar_problem, structured)
    if problem is not None:
        raise APIError(400, problem, param=param)


_STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def _structured_param(body: SamplingFields) -> str:
    """The field the request's structured output came from (vLLM's before OpenAI's)."""
    for name in reversed(_STRUCTURED_FIELDS):
        if getattr(body, name) is not None:
            return name
    return "response_format"


def check_choices(body: SamplingFields) -> None:
    """What the fields of one request may not combine (vLLM's answers): prompt_logprobs come
    whole, not streamed; stream_options (a non-empty one) only with stream; an empty stop
    string stops nothing."""
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not served with stream: true", param="stream")
    options = body.stream_options
    if options is not None and options.model_fields_set and not body.stream:
        raise APIError(400, "stream_options can only be given with stream: true", "stream_options")
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        param = "stream_options.continuous_usage_stats"
        raise APIError(400, f"{param} needs stream_options.include_usage: true", param=param)
    if body.stop == "" or (isinstance(body.stop, list) and "" in body.stop):
        raise APIError(400, "stop cannot contain an empty string", param="stop")


def _logprobs(body: SamplingFields) -> tuple[int | None, int | None]:
    """How many top log-probabilities each sampled token and each prompt token need (None:
    none). Chat: ``logprobs: true`` with ``top_logprobs`` (which needs it); completions:
    ``logprobs: N``, for the prompt too with ``echo``; both: vLLM's ``prompt_logprobs``."""
    prompt = body.prompt_logprobs
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None, prompt
    if isinstance(body, CompletionRequest) and body.logprobs is not None:
        if body.echo:
            prompt = max(prompt or 0, body.logprobs)
        return body.logprobs, prompt
    return None, prompt


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    settings: GatewaySettings,
    tool_structured: StructuredOutput | None = None,
) -> SamplingParams:
    """The body's sampling fields with OpenAI's defaults (temperature and top_p 1; top_k -1 or
    0 is off, as in vLLM); stop strings within the gateway's limits."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > settings.max_stop_strings or any(
        len(s) > settings.max_stop_string_chars for s in stop
    ):
        raise APIError(400, "too many or too long stop strings", param="stop")
    if body.min_tokens > max_tokens:
        message = f"min_tokens ({body.min_tokens}) is over max_tokens ({max_tokens})"
        raise APIError(400, message, param="min_tokens")
    bias_ids, bias_values = _logit_bias(body.logit_bias)
    logprobs, prompt_logprobs = _logprobs(body)
    structured = structured_output(body)
    if tool_structured is not None:  # tool_choice required or a named function
        if structured is not None:
            param = _structured_param(body)
            message = "tool_choice required or a named function fixes the output's format"
            raise APIError(400, f"{message}: no {param} beside it", param)
        structured = tool_structured
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=None if body.top_k in (None, -1, 0) else body.top_k,
            seed=body.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(dict.fromkeys(body.stop_token_ids or ())),  # once each
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            min_p=body.min_p or 0.0,
            include_stop_str_in_output=body.include_stop_str_in_output,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
