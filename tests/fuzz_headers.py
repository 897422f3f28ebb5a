"""The header property test for much longer than the suite runs it.

    .venv/bin/python tests/fuzz_headers.py --examples 50000

Every random or mutated file must either be refused by streamck with its own
error, or be read exactly as the reference reader reads it; and a file the
reference reads must be read by streamck too, unless it is one of the documented
differences (README, "Differences from the reference reader": duplicate keys,
serde's array entries and map dtypes). The generator aims at serde_json's limits:
deep nesting, long and huge numbers, shapes that overflow before a zero dimension,
those alternative encodings, empty headers; compact (orjson fast path) and spaced.
"""

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its neighbours import

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile import check_against_reference, headers, mutated, refused_both_or_neither


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=20000)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    path = Path(tempfile.mkdtemp(prefix="streamck-fuzz-")) / "f.safetensors"

    @settings(max_examples=a.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(headers(), mutated()))
    def fuzz(data: bytes) -> None:
        check_against_reference(path, data)
        refused_both_or_neither(path, data)

    fuzz()
    print(f"{a.examples} examples: streamck and the reference reader agree")


if __name__ == "__main__":
    main()
