"""math-verify worker process: one JSON request per stdin line, one JSON answer per stdout line.

Started by `dlmc.bench.scorers.math_verify_pool` as ``python -m dlmc.bench.scorers._math_worker``.
Request: ``[gold, candidate]``; answer: ``[equivalent, error]``. Runs in the process's main thread,
so math-verify's ``signal.alarm`` timeouts work.
"""

from __future__ import annotations

import json
import sys


def check(gold: str, candidate: str) -> tuple[bool, str]:
    """``verify(parse("$" + gold + "$"), parse(candidate, boxed first))``, with the error if any."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    try:
        gold_parsed = parse("$" + gold + "$")
        if not gold_parsed:
            return False, f"math-verify could not parse the gold answer {gold!r}"
        answer = parse(candidate, extraction_config=config)
        if not answer:
            return False, "math-verify could not parse the extracted answer"
        return bool(verify(gold_parsed, answer)), ""
    except Exception as exc:  # noqa: BLE001 - any failure of the checker scores wrong
        return False, f"math-verify raised {type(exc).__name__}: {exc}"


def main() -> None:
    """Serve requests until stdin closes."""
    import math_verify  # noqa: F401 - import once, before the first request

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        gold, candidate = json.loads(line)
        sys.stdout.write(json.dumps(check(gold, candidate)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
