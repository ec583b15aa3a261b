"""The precise prefix cache's block keys of a novel prompt (``python -m benchmarks.kv_block_keys``).

``TokenProcessor.block_keys`` hashes a prompt's full blocks on the event loop, once per request
whose prefix the processor has not seen (its memo cleared before each run here). Prints the median
of ``--runs`` runs (each the best of three timings of ``--number`` calls) per block size, for a
prompt of ``--tokens`` random ids below 150,000 (a current vocabulary), hashed with ``cbor-fnv``
(the default) or ``--algorithm xxh64``. Compare trees by running this module from each
(``PYTHONPATH=<tree>``), alternately.
"""

from __future__ import annotations

import argparse
import random
import statistics
import timeit
from collections.abc import Sequence

from evergreen_trio.picker.kvblock import HASH_ALGORITHMS, HASH_CBOR_FNV, TokenProcessor, TokenProcessorConfig


def novel_prompt_ms(tokens: Sequence[int], block_size: int, algorithm: str, runs: int, number: int) -> float:
    """Median milliseconds of ``block_keys`` over ``tokens`` with nothing remembered."""
    processor = TokenProcessor(TokenProcessorConfig(block_size_tokens=block_size, hash_algorithm=algorithm))

    def novel() -> None:
        processor._memo.clear()
        processor.block_keys(tokens, "model")

    return statistics.median(min(timeit.repeat(novel, number=number, repeat=3)) / number * 1e3 for _ in range(runs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_block_keys", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64], help="blockSizeTokens (16 64)")
    parser.add_argument("--algorithm", choices=HASH_ALGORITHMS, default=HASH_CBOR_FNV)
    parser.add_argument("--runs", type=int, default=5, help="runs, the median reported (default 5)")
    parser.add_argument("--number", type=int, default=10, help="calls per timing (default 10)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.runs < 1 or args.number < 1 or min(args.block_sizes) < 1:
        parser.error("--tokens, --runs, --number and every block size must be at least 1")
    rng = random.Random(1)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]
    for size in args.block_sizes:
        ms = novel_prompt_ms(tokens, size, args.algorithm, args.runs, args.number)
        print(f"{args.algorithm} block {size}: {ms:.3f} ms a novel {args.tokens:,}-token prompt")


if __name__ == "__main__":
    main()
