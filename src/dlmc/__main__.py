"""`python -m dlmc` runs the command line."""

from dlmc.cli import main

if __name__ == "__main__":
    main()
