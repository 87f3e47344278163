"""The `vllm-hook` command: `vllm-hook extract ...` (activation datasets), `vllm-hook demo`."""

from __future__ import annotations

import sys

USAGE = """usage: vllm-hook {extract,demo} ...

  extract   build an activation dataset from prompts (vllm-hook extract --help)
  demo      capture and steering on a built-in tiny model, on the CPU
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "extract":
        from .extract.cli import main as extract_main

        return extract_main(rest)
    if cmd == "demo":
        from .demo import main as demo_main

        demo_main(rest)
        return 0
    print(f"vllm-hook: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
