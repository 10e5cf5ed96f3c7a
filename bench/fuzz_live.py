"""schemathesis over a live deployment's whole OpenAPI document (``make serve``): every operation,
positive and negative cases, a real video job's id supplied for the job operations' ``video_id``
in every other case. Prints the case count and the statuses seen per operation (JSON).

    python -m bench.fuzz_live --url http://127.0.0.1:8000 --examples 25
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--examples", type=int, default=25, help="hypothesis examples per operation and mode")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    args = ap.parse_args()

    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance

    deadline = time.monotonic() + args.ready_timeout
    while True:
        try:
            if requests.get(f"{args.url}/healthz", timeout=10).status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            print("the deployment never became ready", file=sys.stderr)
            return 2
        time.sleep(2)
    job = requests.post(f"{args.url}/v1/videos", json={"model": "tiny-ltx2", "prompt": "a fox"}, timeout=60)
    job.raise_for_status()
    job_id = job.json()["id"]
    schema = schemathesis.openapi.from_url(f"{args.url}/openapi.json")
    seen: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    cases = 0
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.NEGATIVE and op.method.lower() != "post":
                continue  # a GET's inputs (ids, enums, a bounded limit) have no invalid form left to generate

            @settings(max_examples=args.examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:  # type: ignore[no-untyped-def]
                nonlocal cases
                if case.path_parameters and "video_id" in case.path_parameters and cases % 2 == 0:
                    case.path_parameters["video_id"] = job_id
                response = case.call(base_url=args.url, timeout=600)
                cases += 1
                by = seen.setdefault(op.label, {})
                by[str(response.status_code)] = by.get(str(response.status_code), 0) + 1
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

            try:
                fuzz()
            except Exception as e:  # recorded, the fuzz goes on with the next operation
                failures.append(f"{op.label} {mode.value}: {type(e).__name__}: {str(e)[:300]}")
    server_errors = sum(n for by in seen.values() for s, n in by.items() if s.startswith("5") and s != "503")
    print(json.dumps({"url": args.url, "operations": len(seen), "cases": cases, "server_errors": server_errors,
                      "failures": failures, "seconds": round(time.monotonic() - t0, 1), "statuses": seen}, indent=1))
    return 0 if not failures and server_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
