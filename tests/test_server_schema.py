"""Schemathesis against the server's own OpenAPI schema (bounded: 40 generated requests per
operation and mode): bodies that fit the schema and bodies that do not. No request may get
a 5xx; schema-invalid bodies must be refused with a 4xx; every status and error body must
be one the schema documents (OpenAI's error JSON).

Schemathesis 4.32's pytest integration (`schemathesis.pytest.from_fixture`) reads a pytest
internal that pytest 9 removed, so the operations' strategies are driven with hypothesis
directly."""

import pytest
from hypothesis import HealthCheck, given, settings
from serving import CHATML, running

from minillm import load_tokenizer
from minillm.engine import Engine
from minillm.serving.api_server import create_app

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import checks  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

CHECKS = [
    checks.not_a_server_error,
    checks.negative_data_rejection,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def schema(model):
    engine = Engine(model, load_tokenizer(), max_num_seqs=8)
    with running(create_app(engine, "bundled", CHATML)) as url:
        yield schemathesis.openapi.from_url(url + "/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_get_no_server_error_and_only_documented_answers(schema, mode):
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to get wrong: a GET here takes no parameters

        @settings(max_examples=40, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            case.call_and_validate(checks=CHECKS, timeout=60)

        run()
