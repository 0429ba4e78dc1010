"""The OpenAI request bodies the endpoint accepts, checked by pydantic (unknown fields refused), and its errors.

Fields OpenAI defines that the engine cannot honour (penalties, logit_bias, ...) are accepted only at their
neutral value, so a client that sends the defaults works and one that relies on them is told. Extensions, under
vLLM's names: return_token_ids (prompt_token_ids and each choice's token_ids in the response), ignore_eos, top_k.

It imports pydantic and the standard library only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["ChatRequest", "CompletionRequest", "ApiError", "ValidationError", "error_body"]


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    model: str
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    # extensions (vLLM's names)
    return_token_ids: bool = False
    ignore_eos: bool = False
    top_k: int = Field(0, ge=0)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolFunction


class ChatRequest(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One line for a pydantic error: the first problem, and the parameter it concerns."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        return f"unknown field {loc!r}: the endpoint does not support it (remove it)", loc or None
    if err.get("type") == "missing":
        return f"missing required field {loc!r}", loc or None
    return f"{loc}: {err.get('msg')} (got {err.get('input')!r})", loc or None
