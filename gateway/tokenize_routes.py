"""vLLM's utility endpoints: ``/tokenize`` and ``/detokenize`` (the served tokenizer and chat
template, as the completions endpoints see them), ``/version`` and ``/ping``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import APIError
from gateway.openai_models import ChatCompletionRequest, ChatMessage, TokenId, valid_unicode
from gateway.state import GatewayState
from gateway.tenancy import authenticate
from gateway.tools import template_tools

router = APIRouter()


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS, as a completion's prompt gets
    return_token_strs: bool = False

    _text = field_validator("prompt", "model")(valid_unicode)


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Any], Field(max_length=128)] | None = None  # rendered by the template
    return_token_strs: bool = False

    _text = field_validator("model", "chat_template_kwargs", "tools")(valid_unicode)


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_048_576)]


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def _caller(request: Request, model: str | None) -> GatewayState:
    """The gateway state, once the caller's key (as /v1 needs) and the model are right."""
    state = _state(request)
    await authenticate(state, request)
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model[:200]!r} does not exist", "model", "model_not_found")
    return state


@router.post("/tokenize")
async def tokenize(raw: Annotated[dict[str, Any], Body()], request: Request) -> dict[str, Any]:
    """vLLM's shape: ``count``, ``max_model_len``, ``tokens``, ``token_strs``. A body with
    ``messages`` is a chat's, else a completion's: validated as that one, so a 400 names
    the field of the form the client meant."""
    if "messages" in raw and "prompt" in raw:
        message = "give either prompt (a completion's) or messages (a chat's), not both"
        raise APIError(400, message, param="prompt")
    form: type[TokenizeChat | TokenizeCompletion]
    form = TokenizeChat if "messages" in raw else TokenizeCompletion
    try:
        body = form.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    state = await _caller(request, body.model)
    if isinstance(body, TokenizeChat):
        chat = ChatCompletionRequest.model_validate(body.model_dump(exclude={"return_token_strs"}))
        tools = template_tools(chat) if chat.tools else None  # as a chat with them renders
        ids = await state.prompts.chat_completion(chat, tools)
    else:
        ids = await state.prompts.text(body.prompt, body.add_special_tokens)
    strs = (await state.prompts.decode(ids, each=True))[1:] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": state.directory.max_model_len(),
        "tokens": ids,
        "token_strs": strs,
    }


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's: what a client needs to tokenize as the server does (lm-eval's remote tokenizer
    reads it): the special tokens' text, the chat template served, the context length."""
    state = await _caller(request, None)
    bundle = state.chat.bundle
    return {
        "tokenizer_class": type(bundle.tokenizer).__name__,
        "bos_token": bundle.bos_token or None,
        "eos_token": bundle.eos_token or None,
        "pad_token": None,
        "chat_template": state.chat.source,
        "model_max_length": state.directory.max_model_len(),
    }


@router.post("/detokenize")
async def detokenize(body: Detokenize, request: Request) -> dict[str, str]:
    state = await _caller(request, body.model)
    return {"prompt": (await state.prompts.decode(body.tokens))[0]}


@router.get("/version")
async def server_version(request: Request) -> dict[str, str]:
    await authenticate(_state(request), request)  # open only where /v1 is
    try:
        return {"version": version("superinfer")}
    except PackageNotFoundError:  # run from a checkout without an install
        return {"version": "unknown"}


@router.get("/ping", operation_id="ping_get")
@router.post("/ping", operation_id="ping_post")  # one operation id each: no duplicate in OpenAPI
async def ping() -> Response:
    """Liveness as vLLM answers it (SageMaker's probe): 200, empty."""
    return Response(status_code=200)
