"""Reasoning parsers: the text between think markers is `reasoning`, the rest `content`.

- deepseek_r1: the template opens `<think>` in the prompt, so the output is reasoning up to `</think>`
  (a leading `<think>` is dropped); an output cut before `</think>` is all reasoning.
- qwen3: reasoning only inside `<think>...</think>` at the start of the output, or up to `</think>` when
  the template opened the section in the prompt; otherwise, or with enable_thinking false, all is content.
"""

from __future__ import annotations

from frontend.parsers.base import Parsed, ReasoningParser, held_back


class DeepSeekR1ReasoningParser(ReasoningParser):
    @property
    def starts_in_reasoning(self) -> bool:
        return self.thinking

    def parse(self, text: str, final: bool) -> Parsed:
        if not self.thinking:
            return Parsed(content=text)
        body = text
        if body.startswith(self.start_marker):
            body = body[len(self.start_marker) :]
        elif not final and held_back(body, self.start_marker) == len(body):
            return Parsed()  # could still be "<think>"
        end = body.find(self.end_marker)
        if end < 0:
            keep = len(body) if final else len(body) - held_back(body, self.end_marker)
            return Parsed(reasoning=body[:keep])
        return Parsed(reasoning=body[:end], content=body[end + len(self.end_marker) :])


class Qwen3ReasoningParser(ReasoningParser):
    def parse(self, text: str, final: bool) -> Parsed:
        if not self.thinking:
            return Parsed(content=text)
        if self.opened_in_prompt:
            body = text
        elif text.startswith(self.start_marker):
            body = text[len(self.start_marker) :]
        elif not final and held_back(text, self.start_marker) == len(text):
            return Parsed()  # could still be "<think>"
        else:
            return Parsed(content=text)
        end = body.find(self.end_marker)
        if end < 0:
            keep = len(body) if final else len(body) - held_back(body, self.end_marker)
            return Parsed(reasoning=body[:keep])
        return Parsed(reasoning=body[:end], content=body[end + len(self.end_marker) :])
