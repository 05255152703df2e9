"""schemathesis over the gateway's OpenAPI schema against the running system: no input, with
or without the admin token, gets a 5xx."""

from __future__ import annotations

import os

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.served import Served

# Cases per operation; SUPERINFER_FUZZ_EXAMPLES raises it for a long run (thousands of cases).
FUZZ_EXAMPLES = int(os.environ.get("SUPERINFER_FUZZ_EXAMPLES", "20"))
ALL_CHECKS = list(HealthCheck)


def test_no_input_causes_a_server_error(served: Served) -> None:
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    num_cases = 0
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck)
        )
        def check(case: schemathesis.Case) -> None:
            nonlocal num_cases
            num_cases += 1
            response = case.call(headers=served.admin_headers, timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)

        check()
    print(f"schemathesis: {num_cases} cases over {len(operations)} operations, no 5xx")


def test_restore_defaults_after_fuzzing(served: Served) -> None:
    """The fuzzer may have changed knobs and classes: put the defaults back for later tests."""
    with httpx.Client(base_url=served.url, headers=served.admin_headers) as admin:
        admin.put("/admin/v1/knobs", json={"policy": "vllm", "alpha": 3.0, "b_xfer": 2400})
        default = {"ttft_s": 5.0, "tbt_s": 0.1}
        admin.put(
            "/admin/v1/slo-classes?force=true",  # a key the fuzzer made may use a class it added
            json={
                "interactive": {"ttft_s": 1.0, "tbt_s": 0.05},
                "standard": default,
                "batch": {"ttft_s": 60.0, "tbt_s": 1.0},
            },
        )
