"""The launcher: ``python -m tensorplay.distributed.run`` / ``tprun``.

Same flags and behaviour as ``torchrun`` (it is PyTorch's elastic launcher), so
multi-node c10d rendezvous works as it does there.
"""

from __future__ import annotations

import sys

from torch.distributed.run import get_args_parser, parse_args, run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run(args)


__all__ = ["get_args_parser", "main", "parse_args", "run"]

if __name__ == "__main__":
    main()
