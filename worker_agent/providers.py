"""Where an agent's replies come from: the deterministic ``scripted`` provider for
development, tests and benchmarks, and an OpenAI-compatible HTTP provider for real
models. Standard library only, like the worker that imports it.

A provider answers one turn at a time given the whole conversation so far; it may be
cancelled mid-turn (the worker abandons the turn on a drain it cannot finish).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class ProviderError(Exception):
    """A provider cannot be configured or cannot answer; the message says why."""


class Provider(Protocol):
    name: str

    @property
    def exits_when_done(self) -> bool:
        """Whether the worker exits 0 by itself once ``scripted_prompt`` runs out and no
        prompt is queued (its work is over: the daemon marks the agent ``done``), rather
        than waiting for input."""

    def scripted_prompt(self, turn: int) -> str | None:
        """The prompt the provider drives turn ``turn`` with, or None to wait for input."""

    async def reply(self, messages: list[dict[str, Any]]) -> str:
        """The assistant's answer to the conversation ending in a user message."""


@dataclass(frozen=True)
class ScriptedConfig:
    turns: int = 3
    turn_ms: int = 200
    ignore_sigterm: bool = False
    """Fault injection: the worker ignores SIGTERM, so a drain must SIGKILL it."""
    then_exit: bool = False
    """``then=exit``: after its N turns the worker exits 0 by itself (the agent is
    ``done``); ``then=wait`` (the default) waits for prompts instead."""


SCRIPTED_KEYS = ("turns", "turn_ms", "sigterm", "then")


def parse_scripted_model(model: str) -> ScriptedConfig:
    """``"turns=N,turn_ms=M[,sigterm=ignore][,then=exit]"``; missing keys take the
    defaults."""
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in model.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        value = value.strip()
        if not sep:
            raise ProviderError(f"scripted model part {part!r} is not key=value")
        if key in ("turns", "turn_ms"):
            if not value.isdigit():
                raise ProviderError(f"scripted model {key}={value!r} is not a whole number")
            values[key] = int(value)
        elif key == "sigterm":
            if value not in ("ignore", "honour", "honor"):
                raise ProviderError(f"scripted model sigterm={value!r}: use ignore or honour")
            values["ignore_sigterm"] = value == "ignore"
        elif key == "then":
            if value not in ("wait", "exit"):
                raise ProviderError(
                    f"scripted model then={value!r}: use wait (for prompts after the last "
                    "turn) or exit (finish: exit 0, the agent is done)"
                )
            values["then_exit"] = value == "exit"
        else:
            raise ProviderError(
                f"scripted model has unknown key {key!r}; known: {', '.join(SCRIPTED_KEYS)}"
            )
    return ScriptedConfig(**values)


class ScriptedProvider:
    """N turns of M milliseconds each, deterministic in the conversation so far."""

    name = "scripted"

    def __init__(self, config: ScriptedConfig, initial_prompt: str | None) -> None:
        self.config = config
        self.initial_prompt = initial_prompt

    @property
    def exits_when_done(self) -> bool:
        return self.config.then_exit

    def scripted_prompt(self, turn: int) -> str | None:
        if turn > self.config.turns:
            return None
        if turn == 1 and self.initial_prompt:
            return self.initial_prompt
        return f"scripted prompt {turn}"

    async def reply(self, messages: list[dict[str, Any]]) -> str:
        await asyncio.sleep(self.config.turn_ms / 1000)
        history = json.dumps(messages, sort_keys=True).encode()
        digest = hashlib.sha256(history).hexdigest()[:12]
        prompt = messages[-1].get("content", "")
        return f"scripted reply to {prompt!r} after {len(messages) - 1} messages ({digest})"


class OpenAIProvider:
    """Chat completions from any OpenAI-compatible endpoint (``OPENAI_BASE_URL``)."""

    name = "openai"

    def __init__(self, model: str, env: Mapping[str, str], initial_prompt: str | None) -> None:
        if not model:
            raise ProviderError("the openai provider needs a model name in the spawn spec")
        self.model = model
        self.base_url = env.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1").rstrip("/")
        self.api_key = env.get("OPENAI_API_KEY", "")
        self.timeout = float(env.get("OPENAI_TIMEOUT_SECS", "120"))
        self.initial_prompt = initial_prompt

    @property
    def exits_when_done(self) -> bool:
        return False  # a conversation with a person: it ends when they stop it

    def scripted_prompt(self, turn: int) -> str | None:
        return self.initial_prompt if turn == 1 and self.initial_prompt else None

    async def reply(self, messages: list[dict[str, Any]]) -> str:
        return await asyncio.to_thread(self._complete, messages)

    def _complete(self, messages: list[dict[str, Any]]) -> str:
        # Imported here: urllib.request pulls in ssl, which every scripted worker would
        # otherwise pay for at start-up and exit.
        import urllib.error
        import urllib.request

        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            }
        ).encode()
        request = urllib.request.Request(  # noqa: S310 - the URL is the operator's setting
            f"{self.base_url}/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                payload = json.load(response)
        except (urllib.error.URLError, TimeoutError, ValueError) as exc:
            raise ProviderError(f"chat completion at {self.base_url} failed: {exc}") from None
        try:
            content = payload["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ProviderError(f"chat completion at {self.base_url} has no message") from None
        return str(content)


def make_provider(
    name: str, model: str, env: Mapping[str, str], initial_prompt: str | None
) -> ScriptedProvider | OpenAIProvider:
    if name == "scripted":
        return ScriptedProvider(parse_scripted_model(model), initial_prompt)
    if name in ("openai", "openai-compatible"):
        return OpenAIProvider(model, env, initial_prompt)
    raise ProviderError(f"unknown provider {name!r}; known: scripted, openai")
