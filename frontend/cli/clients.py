"""`engine chat` and `engine complete`: interactive clients for a running server (like `vllm chat`).

Standard library only, so they run anywhere; answers stream as they are generated.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any


def add_client_parsers(commands: Any) -> None:
    for name, help_text, func in (
        ("chat", "chat with a running server (one message with -q, else interactive)", cmd_chat),
        ("complete", "complete prompts on a running server (one with -q, else interactive)", cmd_complete),
    ):
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 base URL")
        parser.add_argument("--model", default=None, help="model name (default: the server's first)")
        parser.add_argument(
            "--api-key",
            default=os.environ.get("ENGINE_API_KEY") or os.environ.get("VLLM_API_KEY"),
            help="or ENGINE_API_KEY, or VLLM_API_KEY",
        )
        parser.add_argument("--max-tokens", type=int, default=256)
        parser.add_argument("--temperature", type=float, default=None)
        parser.add_argument(
            "-q", "--quick", default=None, help="send this one message, print the answer, exit"
        )
        if name == "chat":
            parser.add_argument("--system-prompt", default=None)
        parser.set_defaults(func=func)


def _request(args: argparse.Namespace, path: str, body: dict[str, Any] | None) -> Any:
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{args.url.rstrip('/')}{path}", data=data, headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        raise SystemExit(f"error {error.code}: {detail}") from None
    except urllib.error.URLError as error:
        raise SystemExit(f"cannot reach {args.url}: {error.reason}") from None


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    with _request(args, "/models", None) as response:
        return str(json.load(response)["data"][0]["id"])


def _stream(args: argparse.Namespace, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with _request(args, path, {**body, "stream": True}) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise SystemExit(f"error: {event['error']['message']}")
            yield event


def _inputs(args: argparse.Namespace, prompt: str) -> Iterator[str]:
    if args.quick is not None:
        yield args.quick
        return
    while True:
        try:
            yield input(prompt)
        except (EOFError, KeyboardInterrupt):
            print()
            return


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def cmd_chat(args: argparse.Namespace) -> int:
    model = _model(args)
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    for text in _inputs(args, "> "):
        messages.append({"role": "user", "content": text})
        answer = []
        for event in _stream(
            args, "/chat/completions", {"model": model, "messages": messages, **_sampling(args)}
        ):
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                answer.append(piece)
                print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(answer)})
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    model = _model(args)
    for text in _inputs(args, "> "):
        for event in _stream(args, "/completions", {"model": model, "prompt": text, **_sampling(args)}):
            for choice in event.get("choices", []):
                print(choice.get("text") or "", end="", flush=True)
        print()
    return 0
