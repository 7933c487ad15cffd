"""`python run.py ...` is the same command as `python nnpd.py ...` (the user page's spelling)."""

import nnpd

__all__: list[str] = []  # a script: it gives nothing to import

if __name__ == "__main__":
    nnpd.run_as_process()
