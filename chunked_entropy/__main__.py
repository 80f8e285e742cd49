"""``python -m chunked_entropy``: the same as the ``chunked-entropy`` command."""

from chunked_entropy.cli import main

if __name__ == "__main__":  # guarded: the benchmark's worker processes import this module
    raise SystemExit(main())
