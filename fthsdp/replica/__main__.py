"""`python -m fthsdp.replica ...` is `python -m fthsdp.replica.process ...`."""
from fthsdp.replica.process import main

if __name__ == "__main__":
    import sys

    sys.exit(main())
