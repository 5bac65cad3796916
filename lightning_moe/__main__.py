"""``python -m lightning_moe fit --config ...``: the `lightning-moe` command line."""

from lightning_moe.cli import main

if __name__ == "__main__":
    main()
