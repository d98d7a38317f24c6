"""`python -m benchmarks.concurrency`: the concurrent-streams benchmark (harness.py)."""

from benchmarks.concurrency.harness import main

if __name__ == "__main__":
    main()
