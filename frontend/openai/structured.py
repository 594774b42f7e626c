"""A request's output constraint, from whichever field carries it: OpenAI's `response_format`, vLLM's
`structured_outputs`, or the legacy `guided_*` fields. One of them at most; the spec is validated by
the engine's grammar backend here, so a bad schema, regex or grammar is a 400 before the engine sees it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from frontend.server.errors import OpenAIError
from protocol.errors import InvalidParameterError
from protocol.structured_outputs import StructuredOutputsParams
from structured_outputs import backend_class

# vLLM's StructuredOutputsParams fields a request may set (the rest are server settings), and their types
SPEC_FIELDS: dict[str, tuple[type, ...]] = {
    "json": (str, dict),
    "regex": (str,),
    "choice": (list,),
    "grammar": (str,),
    "json_object": (bool,),
    "structural_tag": (str, dict),
    "disable_any_whitespace": (bool,),
    "whitespace_pattern": (str,),
}
# vLLM's fields we do not implement: a 400, not a silent default
UNSUPPORTED_SPEC_FIELDS = ("disable_fallback", "disable_additional_properties", "backend")
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}


@dataclass
class SpecValidator:
    """Validates specs with one backend, remembering the ones that passed: an agent sends the same
    schema on every turn, and compiling it to check takes milliseconds of the event loop each time."""

    backend: str
    max_entries: int = 1024
    passed: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def validate(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        key = spec.cache_key()
        if key in self.passed:
            self.passed.move_to_end(key)
            return
        try:
            backend_class(self.backend).validate(spec)
        except InvalidParameterError as error:
            raise OpenAIError(error.message, param=param) from error
        self.passed[key] = None
        while len(self.passed) > self.max_entries:
            self.passed.popitem(last=False)


def spec_of_request(request: Any, validator: SpecValidator) -> StructuredOutputsParams | None:
    """The validated spec of a chat or completions request, or None when it asks for none."""
    backend = validator.backend
    if request.guided_decoding_backend not in (None, "auto", backend):
        raise OpenAIError(
            f"guided_decoding_backend {request.guided_decoding_backend!r} is not this server's; it uses "
            f"{backend!r} (set with --structured-outputs-config).",
            param="guided_decoding_backend",
            code="unsupported_field",
        )
    sources = []
    if request.response_format is not None:
        spec = _from_response_format(request.response_format)
        if spec is not None:
            sources.append(("response_format", spec))
    if request.structured_outputs is not None:
        sources.append(("structured_outputs", _from_structured_outputs(request.structured_outputs)))
    legacy = {
        field: value for field, value in LEGACY_FIELDS.items() if getattr(request, field, None) is not None
    }
    if legacy:
        fields = {kind: _legacy_value(kind, getattr(request, field)) for field, kind in legacy.items()}
        if request.guided_whitespace_pattern is not None:
            fields["whitespace_pattern"] = request.guided_whitespace_pattern
        sources.append((next(iter(legacy)), StructuredOutputsParams(**fields)))
    elif request.guided_whitespace_pattern is not None:
        raise OpenAIError("guided_whitespace_pattern needs guided_json.", param="guided_whitespace_pattern")
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise OpenAIError(f"give one output constraint, not {names}.", param=sources[1][0])
    param, spec = sources[0]
    validator.validate(spec, param)
    return spec


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict):
            raise OpenAIError(
                "response_format.json_schema must be an object with a schema.", param="response_format"
            )
        schema = json_schema.get("schema", {})  # OpenAI: an absent schema means any JSON object
        if not isinstance(schema, dict):
            raise OpenAIError(
                "response_format.json_schema.schema must be an object.", param="response_format"
            )
        return StructuredOutputsParams(json=schema or {"type": "object"})
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(response_format))
    raise OpenAIError(
        f"response_format type must be text, json_object, json_schema or structural_tag; got {kind!r}.",
        param="response_format",
    )


def _from_structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams:
    for name in fields:
        if name in UNSUPPORTED_SPEC_FIELDS and fields[name] not in (None, False):
            raise OpenAIError(
                f"structured_outputs.{name} is not supported by this server.",
                param="structured_outputs",
                code="unsupported_field",
            )
        if name not in SPEC_FIELDS and name not in UNSUPPORTED_SPEC_FIELDS:
            raise OpenAIError(f"structured_outputs has no field {name!r}.", param="structured_outputs")
    values = {name: value for name, value in fields.items() if name in SPEC_FIELDS and value is not None}
    for name, value in values.items():
        if not isinstance(value, SPEC_FIELDS[name]) or (
            isinstance(value, list) and not all(isinstance(item, str) for item in value)
        ):
            expected = " or ".join(t.__name__ for t in SPEC_FIELDS[name])
            raise OpenAIError(
                f"structured_outputs.{name} must be a {expected}{' of strings' if name == 'choice' else ''}.",
                param="structured_outputs",
            )
    if isinstance(values.get("structural_tag"), dict):
        values["structural_tag"] = json.dumps(values["structural_tag"])
    return StructuredOutputsParams(**values)


def _legacy_value(kind: str, value: Any) -> Any:
    if kind == "json" and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise OpenAIError(f"guided_json is not valid JSON: {error}", param="guided_json") from error
    if kind == "structural_tag" and not isinstance(value, str):
        return json.dumps(value)
    return value
