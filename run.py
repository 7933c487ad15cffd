"""`python run.py ...` is the same command as `python nnpd.py ...` (the user page's spelling)."""

import sys

import nnpd

__all__: list[str] = []  # a script: it gives nothing to import

if __name__ == "__main__":
    sys.exit(nnpd.main())
