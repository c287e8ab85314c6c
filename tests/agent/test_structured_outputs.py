"""Structured outputs and tool calls against a real agent on a random tiny model, with the official openai client
and langchain-openai: every output parses and validates because the grammar masks the tokens, not by luck."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from server_process import AgentProcess, running_agent

MODEL = "tiny"
# Hermes-style (Qwen 2.5, NousResearch): tools in the system turn, calls and results in tags.
HERMES_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools:\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% elif m.role == 'tool' %}<|tool|>\n<tool_response>{{ m.content }}</tool_response>{{ eos_token }}\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address", "kind"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}, "zip": {"type": "string",
                                                                            "pattern": "^[0-9]{5}$"}}},
        "kind": {"enum": ["x", "y", "z"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "local"]}}}}}


class Address(BaseModel):
    city: str = Field(max_length=10)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["x", "y", "z"]
    address: Address


@pytest.fixture(scope="module")
def agent(tiny_checkpoint: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    model = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_checkpoint("llama", max_position_embeddings=2048), model)
    (model / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with running_agent(str(model), "--served-model-name", MODEL) as a:
        yield a


@pytest.fixture(scope="module")
def client(agent: AgentProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(**{"model": MODEL, "max_tokens": 400, "messages": [
        {"role": "user", "content": "Give me data."}], **kw})


def test_json_schema_validates_for_every_seed(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(12):
        r = _chat(client, response_format=fmt, seed=seed, temperature=1.0)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # Completions too, through vLLM's field; n samples each follow it.
    r2 = client.completions.create(model=MODEL, prompt="data:", max_tokens=400, n=3, seed=5,
                                   extra_body={"structured_outputs": {"json": SCHEMA}})
    for c in r2.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(4):
        r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "a person"}],
                                          response_format=Person, max_tokens=300, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_choice_regex_and_grammar(client: openai.OpenAI) -> None:
    for seed in range(4):
        text = _chat(client, response_format={"type": "json_object"}, seed=seed, max_tokens=60).choices[0]
        if text.finish_reason == "stop":  # any object may be long; one that ended must be an object
            assert isinstance(json.loads(text.message.content), dict)
        else:
            assert text.message.content.startswith("{")
        choice = _chat(client, seed=seed, extra_body={"guided_choice": ["yes", "no", "maybe"]})
        assert choice.choices[0].message.content in ("yes", "no", "maybe")
        regex = _chat(client, seed=seed, extra_body={"guided_regex": r"[a-c]{3}-[0-9]{2}"})
        assert __import__("re").fullmatch(r"[a-c]{3}-[0-9]{2}", regex.choices[0].message.content)
        lark = _chat(client, seed=seed, extra_body={"guided_grammar": 'start: "ab" | "cd" ("!")?'})
        assert lark.choices[0].message.content in ("ab", "cd", "cd!")


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    for seed in range(4):
        r = _chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
        schema = {WEATHER["function"]["name"]: WEATHER, TIME["function"]["name"]: TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])  # type: ignore
        named = _chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, seed=seed)
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore


def test_streamed_tool_calls_assemble_in_the_client_helpers(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER], tool_choice=choice, max_tokens=300,  # type: ignore
                                            seed=3) as stream:
            final = stream.get_final_completion()
        (call,) = final.choices[0].message.tool_calls or []
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore


def test_a_tool_result_turn_renders_through_the_template(agent: AgentProcess, client: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=5)  # type: ignore
    short = client.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER], max_tokens=5)  # type: ignore
    assert r.usage is not None and short.usage is not None and r.usage.prompt_tokens > short.usage.prompt_tokens
    tok = client.post("/../tokenize", body={"model": MODEL, "messages": messages, "return_token_strs": True},
                      cast_to=object)
    text = "".join(tok["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")  # type: ignore[index]
    assert "<tool_response>sunny, 21</tool_response>" in text and '"city": "Oslo"' in text


def test_langchain_json_mode(agent: AgentProcess, client: openai.OpenAI) -> None:
    # json_object bounds nothing, and a random model never chooses to close a string or an object, so the client
    # nudges it with a standard OpenAI parameter (logit_bias on "}"); the grammar alone makes every output JSON.
    tokens = client.post("/../tokenize", body={"model": MODEL, "prompt": "}", "add_special_tokens": False},
                         cast_to=object)["tokens"]  # type: ignore[index]
    assert len(tokens) == 1
    llm = ChatOpenAI(model=MODEL, base_url=agent.url + "/v1", api_key="unused", max_retries=0,  # type: ignore
                     max_completion_tokens=60, seed=3, logit_bias={tokens[0]: 30})
    schema = {"title": "Anything", "description": "any JSON object", "type": "object"}
    for prompt in ("an object", "another object", "a third one"):
        out = llm.with_structured_output(schema, method="json_mode").invoke(prompt)
        assert isinstance(out, dict), out


def test_langchain_structured_output_and_bound_tools(agent: AgentProcess) -> None:
    llm = ChatOpenAI(model=MODEL, base_url=agent.url + "/v1", api_key="unused", max_retries=0,  # type: ignore
                     max_completion_tokens=300, seed=1)
    person = llm.with_structured_output(Person, method="json_schema").invoke("a person")
    assert isinstance(person, Person)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("weather?")
    assert isinstance(msg, AIMessage) and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])  # type: ignore
    msg = llm.bind_tools([WEATHER, TIME], tool_choice="required").invoke("anything")
    assert isinstance(msg, AIMessage) and msg.tool_calls and msg.tool_calls[0]["name"] in ("get_weather", "get_time")


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(?=a)b"}, "guided_regex"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": ["yes", "no"], "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "[a-z]+", "min_tokens": 4}, "min_tokens"),
])
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra_body=body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    assert param.split(".")[0] in e.value.body["message"]  # type: ignore[index]
