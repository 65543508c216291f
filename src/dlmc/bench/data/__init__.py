"""The benchmark problem files shipped with dlmc: gsm8k, math500, humaneval and mbpp ``.jsonl``.

Public data sets as published; SOURCES.md gives each one's origin, checksum, changes and licence,
LICENSES.md the licence texts. `dlmc.bench.problems.packaged_file` opens them by name.
"""
