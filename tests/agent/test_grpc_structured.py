"""gRPC structured_outputs against a real agent on a random tiny model, with a real grpc client: every output matches
its constraint because the grammar masks the tokens; a constraint that cannot be enforced is INVALID_ARGUMENT."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

import grpc
import jsonschema
import pytest
from server_process import AgentProcess, running_agent

from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server import kvfleet_pb2_grpc as pb_grpc

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y", "z"]},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}


@pytest.fixture(scope="module")
def agent(tiny_checkpoint: Callable[..., str]) -> Iterator[AgentProcess]:
    with running_agent(tiny_checkpoint("llama", max_position_embeddings=2048), "--max-model-len", "2048") as a:
        yield a


@pytest.fixture(scope="module")
def stub(agent: AgentProcess) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        yield pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]


def _request(so: pb.StructuredOutputs, seed: int, **fields: object) -> pb.GenerateRequest:
    given: dict[str, object] = {"max_tokens": 400, **fields}
    return pb.GenerateRequest(text="data:", temperature=1.0, seed=seed, structured_outputs=so,
                              **given)  # type: ignore[arg-type]


def test_json_schema_output_validates_for_every_seed(stub: pb_grpc.GenerationStub) -> None:
    so = pb.StructuredOutputs(json_schema=json.dumps(SCHEMA))
    for seed in range(8):
        r = stub.Generate(_request(so, seed), timeout=120)
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    streamed = list(stub.GenerateStream(_request(so, 99), timeout=120))
    jsonschema.validate(json.loads("".join(r.text for r in streamed)), SCHEMA)
    r = stub.Generate(_request(so, 7, n=3), timeout=120)  # n samples each follow it
    assert len(r.samples) == 3
    for s in r.samples:
        jsonschema.validate(json.loads(s.text), SCHEMA)


def test_regex_choice_grammar_and_json_object(stub: pb_grpc.GenerationStub) -> None:
    for seed in range(4):
        r = stub.Generate(_request(pb.StructuredOutputs(regex=r"[a-c]{3}-[0-9]{2}"), seed), timeout=60)
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", r.text), r.text
        choices = ["yes", "no", "maybe"]
        r = stub.Generate(_request(pb.StructuredOutputs(choice=pb.Choices(choices=choices)), seed), timeout=60)
        assert r.text in choices
        r = stub.Generate(_request(pb.StructuredOutputs(grammar='start: "ab" | "cd" ("!")?'), seed), timeout=60)
        assert r.text in ("ab", "cd", "cd!")
        r = stub.Generate(_request(pb.StructuredOutputs(json_object=True), seed, max_tokens=60), timeout=60)
        assert r.text.startswith("{") and (r.finish_reason != "stop" or isinstance(json.loads(r.text), dict))


@pytest.mark.parametrize(("so", "extra", "named"), [
    (pb.StructuredOutputs(json_schema='{"type": "nope"}'), {}, "structured_outputs.json_schema"),
    (pb.StructuredOutputs(json_schema="{not json"), {}, "structured_outputs.json_schema"),
    (pb.StructuredOutputs(regex="(?=a)b"), {}, "structured_outputs.regex"),
    (pb.StructuredOutputs(grammar="start: ("), {}, "structured_outputs.grammar"),
    (pb.StructuredOutputs(choice=pb.Choices(choices=[])), {}, "structured_outputs.choice"),
    (pb.StructuredOutputs(), {}, "structured_outputs"),
    (pb.StructuredOutputs(regex="[a-z]+"), {"ignore_eos": True}, "ignore_eos"),
    (pb.StructuredOutputs(regex="[a-z]+"), {"min_tokens": 3}, "min_tokens"),
])
def test_a_bad_constraint_is_invalid_argument_naming_the_field(stub: pb_grpc.GenerationStub, so: pb.StructuredOutputs,
                                                               extra: dict[str, object], named: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(_request(so, 0, **extra), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in e.value.details(), e.value.details()
