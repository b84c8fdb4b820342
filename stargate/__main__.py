"""`python -m stargate` runs the same CLI as the `stargate` console script."""

from stargate.cli import main

if __name__ == "__main__":
    main()
